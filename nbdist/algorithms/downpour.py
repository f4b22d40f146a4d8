"""Downpour SGD (Dean et al., 2012): workers push gradients, the master's optimiser applies them.

Between synchronisations (`sync_every` > 1) a worker keeps training its own copy with its
own optimiser and accumulates the gradients it computed; it pushes their sum. With one
worker and sync_every=1 this is exactly the master optimiser on a single process.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from nbdist.algorithms.arrays import Array, zeros_like_buffer
from nbdist.algorithms.base import RULES, Algorithm, RuleState, Update, weighted_mean
from nbdist.backends.base import FlatOptimizer


@dataclass(slots=True)
class DownpourWorker(RuleState):
    accumulated: Array
    count: int
    sync_every: int


@RULES.register
class Downpour(Algorithm):
    """Workers push their gradients; the master's optimiser applies each as it arrives
    (Dean et al. 2012)."""

    name = "downpour"
    uses_master_optimizer = True
    one_worker_is_plain_training = True

    def __init__(self) -> None:
        super().__init__()

    def new_worker_state(self, n: int, sync_every: int, like: Array | None = None) -> DownpourWorker:
        return DownpourWorker(zeros_like_buffer(n, like), 0, sync_every)

    def worker_step(self, state, params, grad, opt) -> bool:
        state.accumulated += grad
        state.count += 1
        if state.count < state.sync_every:
            # Explore locally until the next push; the master only sees the gradients.
            opt.step(grad)
            return False
        return True

    def worker_message(self, state, params, out) -> None:
        out[...] = state.accumulated
        state.accumulated[...] = 0.0
        state.count = 0

    def worker_reply(self, state, params, reply) -> None:
        params[...] = reply

    def master_apply(self, state, centre, updates: Sequence[Update], opt: FlatOptimizer | None):
        if opt is None:
            raise ValueError("downpour's master steps with its optimizer, and it was given none")
        # Synchronous: one step on the sample-weighted mean, i.e. the big-batch gradient.
        opt.step(weighted_mean(updates))
        return [centre] * len(updates)
