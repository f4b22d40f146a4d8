"""DiLoCo: distributed low-communication training (Douillard, Feng, Rusu, Chhaparia, Donchev,
Kuncoro, Ranzato, Szlam & Shen, "DiLoCo: Distributed Low-Communication Training of
Language Models", arXiv:2311.08455, 2023, their Algorithm 1).

Each worker takes H inner steps (`inner_steps`, its window) with its own optimiser
(AdamW in the paper, and this rule's default worker optimiser), starting from the centre
it last pulled; it then sends its *pseudo-gradient*, how far the window moved it,
counted as a gradient (the way back):

    delta_i  = theta_pulled - theta_i                     (after H inner steps)

The master averages the round's deltas (sample-weighted, base.weighted_mean) and applies
the mean with an outer SGD with Nesterov momentum (`outer_lr`, `outer_momentum`; the
paper's 0.7 and 0.9), in torch.optim.SGD's form:

    delta    = mean_i delta_i
    m       <- mu * m + delta
    theta   <- theta - outer_lr * (delta + mu * m)        (nesterov=True)
    theta   <- theta - outer_lr * m                       (nesterov=False)

and every worker starts its next window from the new centre. With H = 1, outer_lr = 1
and outer_momentum = 0 a synchronous round is plain model averaging: theta becomes the
workers' (sample-weighted) mean.

Asynchronous (no --synchronous), the master applies each worker's delta as it arrives,
with the same outer step, the delta weighted by the worker's share of a round (1 /
workers): W arrivals then move the centre as far as one round of W would, and one
worker is exactly H inner steps followed by the outer step. That is the "naive"
asynchronous DiLoCo of Liu et al. 2024 (their outer momentum sees stale deltas);
`async_local_sgd` is their fix. Asynchrony adds a momentum of its own, about 1 - 1/W a
step (Mitliagkas et al. 2016): with the paper's 0.9 on top, the centre fell back to
chance on jet images at 8 and 16 workers, so under --momentum-correction auto (the
default) the run lowers the outer momentum by it (train/asynchrony.py: 0.025 at 8
workers, 0 from 10).

The outer momentum m is the master's rule state: it is checkpointed with the centre and
a resume continues it exactly. The deltas are what --compression encodes (fp16 is safe
for pseudo-gradients, per OpenDiLoCo, Jaghouar et al. 2024).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from nbdist.algorithms.arrays import Array, f32, zeros_like_buffer
from nbdist.algorithms.base import MOMENTUM, RULES, Algorithm, RuleState, Update, weighted_mean
from nbdist.backends.base import FlatOptimizer
from nbdist.specs import ValueRange

ABOVE_ZERO = ValueRange(0.0, low_open=True)


@dataclass(slots=True)
class LocalWindowWorker(RuleState):
    pulled: Array  # the centre this worker's window started from
    count: int
    sync_every: int


@dataclass(slots=True)
class OuterMomentum(RuleState):
    momentum: Array  # m, the outer optimiser's momentum buffer


def check_inner_steps(rule: str, inner_steps: int | None, name: str = "inner_steps") -> None:
    """A count of steps (or None): a whole number of at least 1."""
    if inner_steps is not None and (
        isinstance(inner_steps, bool) or int(inner_steps) != inner_steps or inner_steps < 1
    ):
        raise ValueError(f"{rule}: {name} must be a whole number of at least 1, got {inner_steps!r}")


class LocalWindows(Algorithm):
    """What DiLoCo and asynchronous local SGD share: workers take `inner_steps` steps with
    their own optimiser and send theta_pulled - theta (the pseudo-gradient); the master
    replies the centre, from which the next window starts."""

    carries_local_steps = True
    default_sync_every = 50
    default_worker_optimizer: ClassVar[str | None] = "adamw(lr=0.001)"

    def __init__(self, inner_steps: int | None = None, **params):
        check_inner_steps(self.name, inner_steps)
        super().__init__(inner_steps=inner_steps, **params)
        self.inner_steps = None if inner_steps is None else int(inner_steps)
        self.workers = 1

    def sync_window(self) -> int | None:
        return self.inner_steps

    # The outer optimiser's momentum (each rule's own parameter) and the arrivals between
    # two of its updates: every arrival, unless a rule waits for more (async_local_sgd).
    mu = np.float32(0.0)

    @property
    def momentum_every(self) -> int:
        return 1

    def outer_momentum(self) -> tuple[float, int] | None:
        return float(self.mu), self.momentum_every

    def set_outer_momentum(self, momentum: float) -> None:
        self.mu = np.float32(momentum)
        self.params["outer_momentum"] = momentum  # what the run's first line shows

    def bind(self, workers: int) -> None:
        self.workers = max(int(workers), 1)

    def new_worker_state(self, n: int, sync_every: int, like: Array | None = None) -> LocalWindowWorker:
        return LocalWindowWorker(zeros_like_buffer(n, like), 0, sync_every)

    def worker_start(self, state, params) -> None:
        state.pulled[...] = params

    def worker_step(self, state, params, grad, opt) -> bool:
        opt.step(grad)
        state.count += 1
        return state.count >= state.sync_every

    def worker_message(self, state, params, out) -> None:
        out[...] = state.pulled
        out -= params
        state.count = 0  # a sync forced at an epoch's end starts a new window

    def worker_reply(self, state, params, reply) -> None:
        params[...] = reply
        state.pulled[...] = reply

    def worker_window(self, state, steps: int) -> None:
        state.sync_every = int(steps)  # from the next step: worker_message reset the count


@RULES.register
class DiLoCo(LocalWindows):
    """Workers take inner_steps local steps with their own optimiser (AdamW by default); the
    master applies the mean of their parameter deltas with outer Nesterov momentum
    (Douillard et al. 2023)."""

    name = "diloco"
    round_averages_windows = True
    parameter_help = {
        "inner_steps": "H, the worker's local steps between syncs (None: --sync-every, default 50)",
        "outer_lr": "the outer SGD's learning rate on the mean pseudo-gradient",
        "outer_momentum": "the outer SGD's momentum, in [0, 1)",
        "nesterov": "Nesterov momentum for the outer step (the paper's), else heavy ball",
    }
    example_parameters = {"outer_lr": 0.7, "outer_momentum": 0.9}

    def __init__(
        self,
        inner_steps: int | None = None,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
    ):
        ABOVE_ZERO.check("diloco", "outer_lr", outer_lr)
        MOMENTUM.check("diloco", "outer_momentum", outer_momentum)
        super().__init__(inner_steps, outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=nesterov)
        self.outer_lr, self.mu = np.float32(outer_lr), np.float32(outer_momentum)
        self.nesterov = bool(nesterov)

    def new_master_state(self, n: int, like: Array | None = None) -> OuterMomentum:
        return OuterMomentum(zeros_like_buffer(n, like))

    def master_apply(self, state, centre, updates: Sequence[Update], opt: FlatOptimizer | None):
        if self.asynchronous:
            # One worker's delta as it arrives: its share of a round.
            delta = updates[0].payload
            delta *= f32(1.0 / self.workers)
        else:
            delta = weighted_mean(updates)
        self.outer_step(state, centre, delta)
        return [centre] * len(updates)

    def outer_step(self, state: OuterMomentum, centre: Array, delta: Array) -> None:
        outer_sgd_step(state.momentum, centre, delta, self.outer_lr, self.mu, self.nesterov)


def outer_sgd_step(m: Array, centre: Array, delta: Array, lr: float, mu: float, nesterov: bool) -> None:
    """torch.optim.SGD(lr, momentum=mu, nesterov) on `centre` with the gradient `delta`,
    the momentum buffer `m` (delta is overwritten: it becomes the step)."""
    m *= float(mu)
    m += delta
    if nesterov:
        delta += m * float(mu)
    else:
        delta[...] = m
    delta *= float(lr)
    centre -= delta
