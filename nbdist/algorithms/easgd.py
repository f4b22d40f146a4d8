"""Elastic Averaging SGD (Zhang, Choromanska & LeCun, "Deep learning with Elastic Averaging
SGD", NIPS 2015, arXiv:1412.6651).

Workers train freely with their own optimiser and every `sync_every` steps are pulled
towards the centre by an elastic force, while the centre is pulled towards them:

    diff_i   = alpha * (x_i - centre),        alpha = elastic_lr * elastic_force
                                              (elastic_force default: 0.9 / workers)
    x_i     <- x_i - diff_i
    u       <- elastic_momentum * u + sum_i diff_i
    centre  <- centre + u

The worker sends its weights x_i; the master computes diff_i against the centre it
holds *now* (so the elastic step never uses a stale centre), replies with diff_i, and
moves the centre. With elastic_momentum = 0 (the default) this is Zhang et al.'s
asynchronous EASGD (their Algorithm 1) and, for a synchronous round, their synchronous
EASGD (section 3). With elastic_force = 0 the centre never moves and the workers train
independently.

A synchronous round is already the average form that every rule's round takes
(base.py): with alpha = 0.9 / W (beta = W * alpha = 0.9, Zhang et al.'s choice),

    sum_i alpha * (x_i - centre) = beta * (mean_i x_i - centre),

the centre moves 90% of the way to the workers' mean, whatever W. It is kept as the sum
of the workers' elastic forces because each worker is pulled by its own alpha * (x_i -
centre): the force is symmetric, and the round is exactly Zhang's.

A synchronous round with many workers would hold every worker's elastic step until the
round is applied, to reply it. Instead the master streams the round (`master_round`,
each diff_i added to u as its x_i arrives) and replies every worker the same array,
the centre before the round; each worker computes its own diff_i from it and from the
x_i it sent, with the master's float32 operations (`worker_round_reply`): the same bits,
and the master holds one centre's copy whatever the number of workers.

`elastic_momentum` is momentum on the centre's elastic moves (the velocity u above, a
heavy ball on the centre), an nbdist addition. It is NOT Zhang et al.'s EAMSGD, whose
momentum is Nesterov momentum on each worker's local gradient steps (their Algorithm 2):
for that, give the workers a momentum optimiser, e.g.
`--worker-optimizer "sgd(lr=0.01, momentum=0.9, nesterov=True)"`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from nbdist.algorithms.arrays import Array, zeros_like_buffer
from nbdist.algorithms.base import MOMENTUM, RULES, Algorithm, RuleState, Update
from nbdist.backends.base import FlatOptimizer
from nbdist.specs import ValueRange

# A negative force or rate pushes workers away from the centre.
AT_LEAST_ZERO = ValueRange(0.0)


@dataclass(slots=True)
class EASGDWorker(RuleState):
    count: int
    sync_every: int


@dataclass(slots=True)
class EASGDMaster(RuleState):
    velocity: Array  # u, the centre's elastic momentum


@RULES.register
class EASGD(Algorithm):
    """Elastic averaging: workers train freely and are pulled towards the centre, which
    is pulled towards them (Zhang, Choromanska & LeCun 2015)."""

    name = "easgd"
    parameter_help = {
        "elastic_force": "how hard a worker and the centre pull each other, per sync (None: 0.9 / workers)",
        "elastic_lr": "multiplies the elastic force (the elastic step is elastic_lr * elastic_force)",
        "elastic_momentum": "momentum on the centre's elastic moves, in [0, 1) (not Zhang et al.'s EAMSGD)",
    }
    example_parameters = {"elastic_momentum": 0.5}
    carries_local_steps = True
    message_is_weights = True
    default_sync_every = 4

    def __init__(self, elastic_force: float | None = None, elastic_lr: float = 1.0, elastic_momentum: float = 0.0):
        if elastic_force is not None:
            AT_LEAST_ZERO.check("easgd", "elastic_force", elastic_force)
        AT_LEAST_ZERO.check("easgd", "elastic_lr", elastic_lr)
        MOMENTUM.check("easgd", "elastic_momentum", elastic_momentum)
        super().__init__(elastic_force=elastic_force, elastic_lr=elastic_lr, elastic_momentum=elastic_momentum)
        self.momentum = np.float32(elastic_momentum)
        self.alpha = np.float32(elastic_lr * (elastic_force if elastic_force is not None else 0.9))

    def bind(self, workers: int) -> None:
        # Zhang et al. keep beta = workers * alpha = 0.9: a synchronous round then moves the
        # centre 90% of the way to the workers' mean, and no further (beta > 1 overshoots).
        if self.params["elastic_force"] is None:
            self.params["elastic_force"] = 0.9 / workers
            self.alpha = np.float32(self.params["elastic_lr"] * self.params["elastic_force"])

    def new_worker_state(self, n: int, sync_every: int, like: Array | None = None) -> EASGDWorker:
        return EASGDWorker(0, sync_every)

    def worker_step(self, state, params, grad, opt) -> bool:
        opt.step(grad)
        state.count += 1
        return state.count >= state.sync_every

    def worker_message(self, state, params, out) -> None:
        out[...] = params
        state.count = 0  # a sync forced at an epoch's end starts a new window

    def worker_reply(self, state, params, reply) -> None:
        params -= reply

    def new_master_state(self, n: int, like: Array | None = None) -> EASGDMaster:
        return EASGDMaster(zeros_like_buffer(n, like))

    def master_apply(self, state, centre, updates: Sequence[Update], opt: FlatOptimizer | None):
        # Every diff is taken against the same centre before the centre moves, so a
        # synchronous round is Zhang's synchronous EASGD.
        self._elastic_round(state, centre, updates)
        return [u.payload for u in updates]

    def master_round(self, state, centre, updates: Iterable[Update], samples, opt, out):
        out[...] = centre  # the reply: each worker's diff follows from it and its own x_i
        self._elastic_round(state, centre, updates)
        return out

    def _elastic_round(self, state: EASGDMaster, centre: Array, updates: Iterable[Update]) -> None:
        """The velocity decays, each update's payload becomes its diff alpha * (x_i - c)
        against the centre before the round and is added to the velocity in order (one
        payload at a time: master_round streams them), then the centre moves by it."""
        if self.momentum:
            state.velocity *= float(self.momentum)
        else:
            state.velocity[...] = 0.0
        for u in updates:
            u.payload -= centre
            u.payload *= float(self.alpha)
            state.velocity += u.payload
        centre += state.velocity

    def worker_round_reply(self, state, params, reply) -> None:
        # `reply` is the centre c before the round; the master's diff is alpha * (x - c).
        # (c - x) * -alpha rounds to the same float32 (negation is exact), computed in the
        # reply buffer, so the worker needs no scratch array.
        reply -= params
        reply *= -float(self.alpha)
        params -= reply

    def merge_master_steps(self, centre, steps: Sequence[Update]) -> None:
        # alpha is bound to every worker of the run (bind), so each master's step is its
        # workers' share of the elastic round: the round is their sum, not their mean.
        for step in steps:
            centre += step.payload
