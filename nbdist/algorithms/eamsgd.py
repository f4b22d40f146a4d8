"""Elastic averaging momentum SGD, EAMSGD (Zhang, Choromanska & LeCun, "Deep learning with
Elastic Averaging SGD", NIPS 2015, arXiv:1412.6651, their Algorithm 2).

EASGD's elastic exchange (easgd.py) with Nesterov momentum on each worker's local steps.
Worker i, with learning rate eta (`lr`), momentum delta (`momentum`) and the elastic
step alpha, every `sync_every` (tau) steps:

    if tau divides t:
        diff   = alpha * (x_i - centre)
        x_i   <- x_i - diff
        centre <- centre + diff               (the master's side, EASGD's)
    v_i  <- delta * v_i - eta * grad f(x_i + delta * v_i)
    x_i  <- x_i + v_i

The gradient is taken at the look-ahead point x_i + delta * v_i. So the worker keeps its
model's weights AT that point, y = x + delta * v (the gradient the backend computes is
then the one the algorithm needs), and the local step written for y is

    v  <- delta * v - eta * g(y)
    y  <- y - delta * v_old + (1 + delta) * v

It sends x = y - delta * v, the weights the elastic force acts on, and moves y by the
same diff as x (v is unchanged by the exchange). The master is EASGD's: diff against the
centre it holds now, centre += the sum of the diffs (alpha = elastic_lr *
elastic_force, elastic_force 0.9 / workers by default); a synchronous round is Zhang et
al.'s synchronous form, as for EASGD.

This differs from `easgd` with `--worker-optimizer "sgd(..., nesterov=True)"`: there the
elastic force acts on the look-ahead weights y, here on x, as in Algorithm 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nbdist.algorithms.arrays import Array, zeros_like_buffer
from nbdist.algorithms.base import MOMENTUM, RULES, RuleState
from nbdist.algorithms.diloco import ABOVE_ZERO
from nbdist.algorithms.easgd import EASGD


@dataclass(slots=True)
class EAMSGDWorker(RuleState):
    velocity: Array  # v
    scratch: Array
    count: int
    sync_every: int


@RULES.register
class EAMSGD(EASGD):
    """EASGD's elastic averaging with Nesterov momentum on the workers' local steps, the
    elastic force acting on the weights behind the look-ahead (Zhang et al. 2015,
    Algorithm 2)."""

    name = "eamsgd"
    parameter_help = {
        "lr": "eta, the workers' local learning rate",
        "momentum": "delta, the workers' Nesterov momentum, in [0, 1)",
        "elastic_force": EASGD.parameter_help["elastic_force"],
        "elastic_lr": EASGD.parameter_help["elastic_lr"],
    }
    example_parameters = {"lr": 0.05, "momentum": 0.9}
    uses_worker_optimizer = False  # the rule's own Nesterov steps

    def __init__(
        self, lr: float = 0.01, momentum: float = 0.9, elastic_force: float | None = None, elastic_lr: float = 1.0
    ):
        ABOVE_ZERO.check("eamsgd", "lr", lr)
        MOMENTUM.check("eamsgd", "momentum", momentum)
        super().__init__(elastic_force=elastic_force, elastic_lr=elastic_lr)
        self.params = {"lr": lr, "momentum": momentum, "elastic_force": elastic_force, "elastic_lr": elastic_lr}
        self.lr, self.delta = np.float32(lr), np.float32(momentum)

    # -- its lr, driven by train/lr.py (warm-up, --worker-lr-schedule) -------------------
    @property
    def learning_rate(self) -> float:
        return float(self.lr)

    def set_learning_rate(self, lr: float) -> None:
        self.lr = np.float32(lr)

    def new_worker_state(self, n: int, sync_every: int, like: Array | None = None) -> EAMSGDWorker:  # type: ignore[override]
        return EAMSGDWorker(zeros_like_buffer(n, like), zeros_like_buffer(n, like), 0, sync_every)

    def worker_step(self, state, params, grad, opt) -> bool:
        v, delta = state.velocity, float(self.delta)
        v *= delta  # delta * v_old
        params -= v
        state.scratch[...] = grad
        state.scratch *= float(self.lr)
        v -= state.scratch  # v = delta * v_old - eta * g
        state.scratch[...] = v
        state.scratch *= 1.0 + delta
        params += state.scratch
        state.count += 1
        return state.count >= state.sync_every

    def _behind_lookahead(self, state: EAMSGDWorker, params: Array, out: Array) -> None:
        """out = x = y - delta * v."""
        out[...] = state.velocity
        out *= -float(self.delta)
        out += params

    def worker_message(self, state, params, out) -> None:
        self._behind_lookahead(state, params, out)
        state.count = 0

    # worker_reply is EASGD's: the master's reply is the diff, and y moves by it as x does.

    def worker_round_reply(self, state, params, reply) -> None:
        # `reply` is the centre c before the round; the master's diff is alpha * (x - c),
        # computed here from the x this worker sent, with the master's float32 operations.
        self._behind_lookahead(state, params, state.scratch)
        reply -= state.scratch
        reply *= -float(self.alpha)
        params -= reply
