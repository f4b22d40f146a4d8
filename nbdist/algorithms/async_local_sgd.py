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
the one this rule makes.) The paper's second part, dynamic local steps by worker speed
(DyLU), is not implemented: every worker takes inner_steps.

m, Delta and the arrival count t are the master's rule state: checkpointed, and resumed
exactly.
"""

from __future__ import annotations

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
    }
    example_parameters = {"outer_lr": 0.7, "outer_momentum": 0.9, "activation": 2}

    def __init__(
        self,
        inner_steps: int | None = None,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        activation: int | None = None,
    ):
        ABOVE_ZERO.check(self.name, "outer_lr", outer_lr)
        MOMENTUM.check(self.name, "outer_momentum", outer_momentum)
        if activation is not None:
            check_inner_steps(self.name, activation, "activation")
        super().__init__(inner_steps, outer_lr=outer_lr, outer_momentum=outer_momentum, activation=activation)
        self.outer_lr, self.mu = np.float32(outer_lr), np.float32(outer_momentum)

    @property
    def every(self) -> int:
        """N: arrivals between momentum updates."""
        return int(self.params["activation"] or self.workers)

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
