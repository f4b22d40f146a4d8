"""Asynchronous local SGD with delayed Nesterov momentum (Liu, Chhaparia, Douillard, Kale,
Rusu, Shen, Szlam & Ranzato, "Asynchronous Local-SGD Training for Language Modeling",
arXiv:2401.09135, 2024, their Algorithm 3, "Delayed Nesterov Update").

The workers are DiLoCo's (diloco.py): `inner_steps` local steps with their own optimiser
(AdamW by default), then the pseudo-gradient g = theta_pulled - theta. The master applies
each worker's g as it arrives. Applying outer Nesterov momentum to every stale arrival
accelerates the centre along directions that are already out of date (the paper's
finding: naive asynchronous local SGD needs more updates than synchronous); instead
the momentum is updated only once every N arrivals (`activation`, by default N = the
number of workers), from the buffered mean of those N, while every arrival moves the
centre by its own share:

    Delta  <- Delta + g_t                          (every arrival t)
    theta  <- theta - outer_lr * g_t / N
    if t mod N == 0:
        m      <- mu * m + Delta / N
        theta  <- theta - outer_lr * mu * m
        Delta  <- 0

So N arrivals with no staleness move the centre exactly as one DiLoCo round of N
workers with outer Nesterov momentum does (theta <- theta - outer_lr * (mean g + mu * m));
a synchronous round (--synchronous) is that round. (The paper writes the step between
activations with a factor c; 1 / N is the choice that keeps the equivalence above, and
the one this rule makes.)

Asynchrony still adds a momentum of its own (Mitliagkas et al. 2016), about (1 - 1/W)^N
over the N arrivals between two momentum updates: with the paper's 0.9 on top, the
centre fell back to chance on jet images at 8 and 16 workers, so under
--momentum-correction auto (the default) the run lowers mu by it (train/asynchrony.py:
0.556 at 8 workers).

The paper's second part, Dynamic Local Updates (DyLU), is `dynamic_steps=True`: each
worker's number of local steps is scaled by its speed relative to the fastest worker,

    H_i = max(1, floor(H * v_i / v_max))

so that workers of different speeds send their pseudo-gradients about equally often
(a worker half as fast takes H / 2 steps per window). The speeds are measured, never
assumed: a worker's master times each of its windows, from the reply that began it to
the arrival of the update that ended it (its local steps plus one message each way),
and v_i is that update's samples over that time; v_max is the fastest among the workers
still training under that master (a dropped or finished worker no longer counts). The
master names H_i in the reply's header (messages.WINDOW), and the worker's next window
has that length (roles/master/windows.py). A worker's first window, not yet timed, is
H; so is any window named before the worker's speed is known. A window still ends at
every epoch's end, whatever its length. DyLU needs an asynchronous master (a
synchronous round waits for every worker whatever their windows): with --synchronous it
is refused; under --warm-start-epochs it acts from the switch to asynchronous on.

m, Delta and the arrival count t are the master's rule state: checkpointed, and resumed
exactly. With dynamic_steps, the window lengths depend on measured times, which a
resume cannot re-derive: they are checkpointed instead, each worker's current window in
its share (its rule state's sync_every) and the speeds in its master's share, and a
resumed run starts from them (and times the windows anew).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from nbdist.algorithms.arrays import Array, f32, zeros_like_buffer
from nbdist.algorithms.base import MOMENTUM, RULES, RuleState, Update, weighted_mean
from nbdist.algorithms.diloco import ABOVE_ZERO, LocalWindows, check_inner_steps, outer_sgd_step
from nbdist.backends.base import FlatOptimizer


@dataclass(slots=True)
class DelayedNesterov(RuleState):
    momentum: Array  # m
    buffered: Array  # Delta, the arrivals since the last momentum update
    arrivals: int  # t


@RULES.register
class AsyncLocalSGD(LocalWindows):
    """Local SGD whose master applies each worker's pseudo-gradient as it arrives and
    updates its outer Nesterov momentum once every N arrivals (delayed Nesterov, Liu et
    al. 2024)."""

    name = "async_local_sgd"
    parameter_help = {
        "inner_steps": "the worker's local steps between syncs (None: --sync-every, default 50)",
        "outer_lr": "the outer learning rate on the pseudo-gradients",
        "outer_momentum": "the outer Nesterov momentum, in [0, 1)",
        "activation": "N, arrivals between momentum updates (None: the number of workers)",
        "dynamic_steps": "DyLU: each worker's window scaled by its measured speed over the fastest's "
        "(asynchronous runs only)",
    }
    example_parameters = {"outer_lr": 0.7, "outer_momentum": 0.9, "activation": 2, "dynamic_steps": True}

    def __init__(
        self,
        inner_steps: int | None = None,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        activation: int | None = None,
        dynamic_steps: bool = False,
    ):
        ABOVE_ZERO.check(self.name, "outer_lr", outer_lr)
        MOMENTUM.check(self.name, "outer_momentum", outer_momentum)
        if activation is not None:
            check_inner_steps(self.name, activation, "activation")
        if not isinstance(dynamic_steps, bool):
            raise ValueError(f"{self.name}: dynamic_steps must be True or False, got {dynamic_steps!r}")
        super().__init__(
            inner_steps,
            outer_lr=outer_lr,
            outer_momentum=outer_momentum,
            activation=activation,
            dynamic_steps=dynamic_steps,
        )
        self.outer_lr, self.mu = np.float32(outer_lr), np.float32(outer_momentum)
        self.adapts_windows = dynamic_steps

    def next_window(self, window: int, speed: float, fastest: float) -> int:
        return dynamic_local_steps(window, speed, fastest) if self.adapts_windows else window

    @property
    def every(self) -> int:
        """N: arrivals between momentum updates."""
        return int(self.params["activation"] or self.workers)

    @property
    def momentum_every(self) -> int:
        return self.every

    def new_master_state(self, n: int, like: Array | None = None) -> DelayedNesterov:
        return DelayedNesterov(zeros_like_buffer(n, like), zeros_like_buffer(n, like), 0)

    def master_apply(self, state, centre, updates: Sequence[Update], opt: FlatOptimizer | None):
        if not self.asynchronous:
            # A synchronous round: N fresh arrivals at once, i.e. one Nesterov step on their mean.
            outer_sgd_step(state.momentum, centre, weighted_mean(updates), self.outer_lr, self.mu, True)
            return [centre] * len(updates)
        for u in updates:  # one, asynchronous
            self._arrive(state, centre, u.payload)
        return [centre] * len(updates)

    def _arrive(self, state: DelayedNesterov, centre: Array, g: Array) -> None:
        n = self.every
        state.buffered += g
        g *= f32(float(self.outer_lr) / n)
        centre -= g
        state.arrivals += 1
        if state.arrivals % n == 0:
            state.buffered *= f32(1.0 / n)
            state.momentum *= float(self.mu)
            state.momentum += state.buffered
            state.buffered[...] = state.momentum
            state.buffered *= f32(float(self.outer_lr) * float(self.mu))
            centre -= state.buffered
            state.buffered[...] = 0.0


def dynamic_local_steps(window: int, speed: float, fastest: float) -> int:
    """DyLU's local steps (Liu et al. 2024): H_i = max(1, floor(H * v_i / v_max)), for a
    worker at `speed` when the fastest is at `fastest`; H itself while either is unknown
    (not positive). Never more than H: a worker measured faster than the fastest known
    (it is the fastest) takes H."""
    if speed <= 0 or fastest <= 0:
        return window
    return max(1, min(window, math.floor(window * (speed / fastest))))
