"""Gradient Energy Matching (Hermans & Louppe, 2018, arXiv:1805.08469).

Asynchronous updates from n workers act like momentum the user never asked for
(implicit momentum ~ 1 - 1/n). GEM rescales each worker's update, per parameter, so
that the kinetic energy of the central variable matches that of a proxy: momentum SGD
(lr, momentum) as one worker would run it, amplified by kappa:

    v_t   = momentum * v_{t-1} + lr * g_t               (the proxy's velocity)
    c_t   = centre_t - centre_{t-1}                    (the centre's observed velocity)
    pi_t  = clip((kappa * |v_t| - |c_t|) / (|lr * g_t| + eps), 0, pi_max)
    send    -pi_t * lr * g_t ;   master: centre += update

The rescaling runs on the workers (they see the centre at every pull), which keeps
the master's work to one addition per update. GEM is an asynchronous rule; a synchronous
round adds the sample-weighted mean of its W updates (one proxy step, not W of them).

How this differs from the authors' code (github.com/montefiore-institute/gradient-energy-matching,
code/gem.py): its parameter server serves one worker at a time, and a worker pulls
the centre just before it sends, so |c| reaches up to the moment its update is applied.
Here a worker's pull is the master's reply to its previous update, and the update it
sends next was scaled by a |c| one computation older: the updates of the other W - 1
workers in between are not in it. Each worker makes up the whole shortfall of energy it
sees, so W workers answer a shortfall about W times over, a cycle late: with many workers
the centre oscillates, and on the jet images at 16 workers it collapsed. So a run sets
`discount_stale` under --momentum-correction auto from 8 asynchronous workers
(nbdist.train.asynchrony): the master scales each update by 1 / (1 + staleness), DynSGD's
discount, before adding it, which takes each worker's answer down to about its 1/W share,
while the energy matching raises pi where the centre then moves too little. With it GEM
did not collapse at 8 or 16 workers (bench/results/2026-11-25-convergence.md).
`--momentum-correction off` keeps the rule above.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from nbdist.algorithms.arrays import Array, namespace, zeros_like_buffer
from nbdist.algorithms.base import MOMENTUM, RULES, Algorithm, RuleState, Update
from nbdist.backends.base import FlatOptimizer
from nbdist.specs import ValueRange

# epsilon > 0 keeps pi finite where a gradient is zero.
ABOVE_ZERO = ValueRange(0.0, low_open=True)
RANGES = {"lr": ABOVE_ZERO, "momentum": MOMENTUM, "kappa": ABOVE_ZERO, "epsilon": ABOVE_ZERO, "pi_max": ABOVE_ZERO}


@dataclass(slots=True)
class GEMWorker(RuleState):
    velocity: Array  # v, the proxy's momentum
    previous_centre: Array  # centre at the pull before the last one
    accumulated: Array
    scratch: Array
    count: int
    sync_every: int
    pulls: int

    def saved_before_as(self) -> dict[str, str]:
        return {"previous_centre": "previous_center"}  # before the project took one spelling


@RULES.register
class GEM(Algorithm):
    """Gradient energy matching: each update is rescaled so that the centre moves with the
    energy of momentum SGD as one worker would run it (Hermans & Louppe 2018)."""

    name = "gem"
    parameter_help = {
        "lr": "the learning rate of the proxy momentum SGD",
        "momentum": "the proxy's momentum, in [0, 1)",
        "kappa": "amplifies the proxy's energy",
        "epsilon": "keeps the rescaling finite where a gradient is zero",
        "pi_max": "the largest rescaling of an update",
    }
    uses_worker_optimizer = False
    auto_stale_discount = True  # see above

    def __init__(
        self, lr: float = 0.05, momentum: float = 0.9, kappa: float = 1.0, epsilon: float = 1e-12, pi_max: float = 5.0
    ):
        super().__init__(lr=lr, momentum=momentum, kappa=kappa, epsilon=epsilon, pi_max=pi_max)
        for name, allowed in RANGES.items():
            allowed.check("gem", name, self.params[name])
        self.lr, self.momentum, self.kappa = np.float32(lr), np.float32(momentum), np.float32(kappa)
        self.epsilon, self.pi_max = np.float32(epsilon), np.float32(pi_max)

    # -- its lr, driven by train/lr.py (scaling, warm-up, --worker-lr-schedule) ----------
    @property
    def learning_rate(self) -> float:
        return float(self.lr)

    def set_learning_rate(self, lr: float) -> None:
        self.lr = np.float32(lr)

    def new_worker_state(self, n: int, sync_every: int, like: Array | None = None) -> GEMWorker:
        z = lambda: zeros_like_buffer(n, like)  # noqa: E731
        return GEMWorker(z(), z(), z(), z(), 0, sync_every, 0)

    def worker_start(self, state, params) -> None:
        state.pulls = 1

    def worker_step(self, state, params, grad, opt) -> bool:
        # No local steps: the worker's weights stay the centre it last pulled.
        state.accumulated += grad
        state.count += 1
        return state.count == state.sync_every

    def scaled_update(self, state: GEMWorker, params: Array, grad: Array, out: Array) -> None:
        """pi * (-lr * grad) for the gradient `grad` taken at the centre `params`."""
        xp = namespace(grad)
        lr = float(self.lr)
        step = state.scratch
        step[...] = grad
        step *= lr  # lr * g
        state.velocity *= float(self.momentum)
        state.velocity += step
        # |c|: how far the centre moved between this worker's last two pulls.
        if state.pulls >= 2:
            out[...] = params
            out -= state.previous_centre
            out[...] = xp.abs(out)
        else:
            out[...] = 0.0
        # pi = (kappa |v| - |c|) / (|lr g| + eps), clipped
        out[...] = xp.abs(state.velocity) * float(self.kappa) - out
        state.scratch[...] = xp.abs(step)
        state.scratch += float(self.epsilon)
        out /= state.scratch
        out[...] = xp.clip(out, 0.0, float(self.pi_max))
        # update = -pi * lr * g
        out *= grad
        out *= -lr

    def worker_message(self, state, params, out) -> None:
        if state.count > 1:
            state.accumulated /= float(state.count)
        self.scaled_update(state, params, state.accumulated, out)
        state.accumulated[...] = 0.0
        state.count = 0

    def worker_reply(self, state, params, reply) -> None:
        state.previous_centre[...] = params
        state.pulls += 1
        params[...] = reply

    def master_apply(self, state, centre, updates: Sequence[Update], opt: FlatOptimizer | None):
        return self.add_updates(centre, updates)
