"""DiLoCo, asynchronous local SGD (delayed Nesterov) and EAMSGD against their published
updates, written out here in float64 (issue 29). The workers' gradients come from a
fixed quadratic, f(x) = |A x - b|^2 / 2, so every step is known; the inner optimiser is
the real torch SGD over the flat buffer, as on a worker. The contracts every rule keeps
are in test_rule_contracts.py, which picks these rules up from the registry."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nbdist.algorithms import EAMSGD, AsyncLocalSGD, DiLoCo, Update, make_algorithm
from nbdist.backends.torch import TorchFlatOptimizer
from nbdist.errors import OptionsError
from nbdist.options import TrainOptions
from nbdist.specs import SpecError, parse_spec
from nbdist.train.rules import resolve_rules

F32 = np.float32
RNG = np.random.default_rng(5)
A = RNG.normal(size=(6, 6)) / 3
B = RNG.normal(size=6)
THETA0 = RNG.normal(size=6)
INNER_LR = 0.1


def grad(x):
    return A.T @ (A @ x - B)


class Worker:
    """One worker's weights, rule state and real inner optimiser (plain SGD)."""

    def __init__(self, rule, centre, sync_every):
        self.params = np.array(centre, F32)
        self.opt = TorchFlatOptimizer(torch.optim.SGD, parse_spec(f"sgd(lr={INNER_LR})"), self.params)
        self.state = rule.new_worker_state(self.params.size, sync_every)
        rule.worker_start(self.state, self.params)
        self.rule = rule

    def window(self, steps):
        """Train `steps` batches; the message the worker sends then."""
        for _ in range(steps):
            self.rule.worker_step(self.state, self.params, grad(self.params).astype(F32), self.opt)
        out = np.empty_like(self.params)
        self.rule.worker_message(self.state, self.params, out)
        return out


def inner_sgd(x, steps):
    for _ in range(steps):
        x = x - INNER_LR * grad(x)
    return x


def nesterov(theta, m, g, lr, mu):
    """torch.optim.SGD(nesterov=True) on gradient g: DiLoCo's outer step."""
    m = mu * m + g
    return theta - lr * (g + mu * m), m


# ----------------------------------------------------------------------------- DiLoCo
def test_a_synchronous_diloco_round_is_outer_nesterov_on_the_mean_pseudo_gradient():
    """Douillard et al. 2023, Algorithm 1: H inner steps per worker from the centre, the
    mean of theta - theta_i, outer Nesterov SGD; two rounds so the momentum carries."""
    H, lr, mu, samples = 3, 0.7, 0.9, [5, 7, 12]
    rule = make_algorithm(parse_spec(f"diloco(inner_steps={H}, outer_lr={lr}, outer_momentum={mu})"))
    rule.bind(3)
    centre = THETA0.astype(F32)
    state = rule.new_master_state(6)
    theta, m = THETA0.copy(), np.zeros(6)
    workers = [Worker(rule, centre, H) for _ in range(3)]
    for w, shift in zip(workers, (0.0, 0.3, -0.2), strict=True):  # different data, different windows
        w.params += F32(shift)
        w.state.pulled[...] = centre
    offsets = [0.0, 0.3, -0.2]
    for _ in range(2):
        sent = [w.window(H) for w in workers]
        replies = rule.master_apply(state, centre, [Update(s, 0, n) for s, n in zip(sent, samples, strict=True)], None)
        for w, r in zip(workers, replies, strict=True):
            rule.worker_reply(w.state, w.params, r.copy())
        deltas = [theta - inner_sgd(theta + off, H) for off in offsets]
        mean = sum(n * d for n, d in zip(samples, deltas, strict=True)) / sum(samples)
        theta, m = nesterov(theta, m, mean, lr, mu)
        offsets = [0.0, 0.0, 0.0]
    np.testing.assert_allclose(centre, theta, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state.momentum, m, rtol=1e-5, atol=1e-5)
    for w in workers:
        np.testing.assert_array_equal(w.params, centre)


def test_diloco_with_one_inner_step_outer_lr_1_and_no_momentum_is_model_averaging():
    rule = DiLoCo(inner_steps=1, outer_lr=1.0, outer_momentum=0.0)
    rule.bind(3)
    centre = THETA0.astype(F32)
    weights = [centre + RNG.normal(size=6).astype(F32) for _ in range(3)]
    updates = [Update(centre - w, 0, n) for w, n in zip(weights, [2, 3, 5], strict=True)]
    rule.master_apply(rule.new_master_state(6), centre, updates, None)
    np.testing.assert_allclose(centre, (2 * weights[0] + 3 * weights[1] + 5 * weights[2]) / 10, rtol=1e-6, atol=1e-6)


def test_asynchronous_diloco_applies_each_delta_as_its_share_of_a_round():
    """Asynchronous: each arrival is one outer Nesterov step on delta / workers; with one
    worker that is H inner steps followed by the outer step."""
    lr, mu = 0.7, 0.9
    for workers in (1, 4):
        rule = DiLoCo(inner_steps=2, outer_lr=lr, outer_momentum=mu)
        rule.bind(workers)
        rule.asynchronous = True
        centre, state = THETA0.astype(F32), rule.new_master_state(6)
        theta, m = THETA0.copy(), np.zeros(6)
        w = Worker(rule, centre, 2)
        for _ in range(3):
            rule.worker_reply(w.state, w.params, rule.master_apply(state, centre, [Update(w.window(2), 0, 8)], None)[0])
            theta, m = nesterov(theta, m, (theta - inner_sgd(theta, 2)) / workers, lr, mu)
        np.testing.assert_allclose(centre, theta, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- asynchronous local SGD
def delayed_nesterov(theta, arrivals, lr, mu, n):
    """Liu et al. 2024, Algorithm 3, with the step between activations g / N."""
    m, buffered = np.zeros_like(theta), np.zeros_like(theta)
    for t, g in enumerate(arrivals, start=1):
        buffered = buffered + g
        theta = theta - lr * g / n
        if t % n == 0:
            m = mu * m + buffered / n
            theta = theta - lr * mu * m
            buffered = np.zeros_like(theta)
    return theta, m, buffered


def test_async_local_sgd_is_delayed_nesterov():
    lr, mu, n = 0.5, 0.8, 3
    rule = AsyncLocalSGD(outer_lr=lr, outer_momentum=mu, activation=n)
    rule.bind(5)
    rule.asynchronous = True
    arrivals = [RNG.normal(size=6) for _ in range(7)]
    centre, state = THETA0.astype(F32), rule.new_master_state(6)
    for g in arrivals:
        rule.master_apply(state, centre, [Update(g.astype(F32), 2, 8)], None)
    theta, m, buffered = delayed_nesterov(THETA0, arrivals, lr, mu, n)
    np.testing.assert_allclose(centre, theta, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state.momentum, m, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(state.buffered, buffered, rtol=1e-5, atol=1e-5)
    assert state.arrivals == 7


def test_n_fresh_arrivals_of_async_local_sgd_are_one_diloco_round():
    """The momentum activates every N = workers arrivals; N arrivals without staleness
    move the centre as one synchronous DiLoCo round on their mean does."""
    deltas = [RNG.normal(size=6).astype(F32) for _ in range(4)]
    centres = []
    for rule in (AsyncLocalSGD(outer_lr=0.7, outer_momentum=0.9), DiLoCo(outer_lr=0.7, outer_momentum=0.9)):
        rule.bind(4)
        centre, state = THETA0.astype(F32), rule.new_master_state(6)
        for _ in range(2):
            if isinstance(rule, AsyncLocalSGD):
                rule.asynchronous = True
                for d in deltas:
                    rule.master_apply(state, centre, [Update(d.copy(), 0, 8)], None)
            else:
                rule.master_apply(state, centre, [Update(d.copy(), 0, 8) for d in deltas], None)
        centres.append(centre)
    np.testing.assert_allclose(centres[0], centres[1], rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- EAMSGD
def test_eamsgd_is_zhang_et_al_algorithm_2():
    """Two asynchronous workers taking turns, tau = 2, Nesterov momentum on their local
    steps with the gradient at x + delta v, the elastic force on x."""
    eta, delta, force, tau = 0.05, 0.9, 0.3, 2
    rule = EAMSGD(lr=eta, momentum=delta, elastic_force=force)
    rule.bind(2)
    rule.asynchronous = True
    alpha = force
    centre, state = THETA0.astype(F32), rule.new_master_state(6)
    start = [THETA0 + 0.1, THETA0 - 0.2]
    params = [s.astype(F32) for s in start]
    states = [rule.new_worker_state(6, tau) for _ in range(2)]
    x, v, c = [s.copy() for s in start], [np.zeros(6), np.zeros(6)], THETA0.copy()
    for t in range(7):
        for i in range(2):
            # the reference: exchange when tau divides t, then one Nesterov step
            if t % tau == 0 and t > 0:
                diff = alpha * (x[i] - c)
                x[i], c = x[i] - diff, c + diff
            v[i] = delta * v[i] - eta * grad(x[i] + delta * v[i])
            x[i] = x[i] + v[i]
            # the rule: the exchange is the sync after the previous window's last step
            if t % tau == 0 and t > 0:
                out = np.empty(6, F32)
                rule.worker_message(states[i], params[i], out)
                reply = rule.master_apply(state, centre, [Update(out, 0, 8)], None)[0]
                rule.worker_reply(states[i], params[i], reply.copy())
            rule.worker_step(states[i], params[i], grad(params[i]).astype(F32), None)
    np.testing.assert_allclose(centre, c, rtol=1e-5, atol=1e-5)
    for i in range(2):
        np.testing.assert_allclose(params[i] - delta * states[i].velocity, x[i], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(states[i].velocity, v[i], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "spec, says",
    [
        ("diloco(inner_steps=0)", "inner_steps must be a whole number of at least 1"),
        ("diloco(outer_momentum=1.0)", "outer_momentum must be"),
        ("async_local_sgd(activation=0)", "activation must be a whole number of at least 1"),
        ("eamsgd(momentum=1.0)", "momentum must be"),
    ],
)
def test_bad_parameters_are_one_clear_error(spec, says):
    with pytest.raises(SpecError, match=says):
        make_algorithm(parse_spec(spec))


@pytest.mark.parametrize("rule", ["diloco", "async_local_sgd", "eamsgd"])
def test_an_outer_optimiser_the_rule_cannot_take_is_one_clear_error(rule):
    """Their outer steps are the rules' own (an outer SGD with the rule's lr and momentum,
    or EAMSGD's elastic pull): a master optimiser is refused, saying what to do."""
    with pytest.raises(OptionsError, match=f"^{rule} takes no master optimizer: .* drop --master-optimizer$"):
        resolve_rules(TrainOptions(algorithm=rule, master_optimizer="sgd(lr=0.7, momentum=0.9, nesterov=True)"))


def test_inner_steps_is_the_window_and_a_different_sync_every_is_refused():
    rule, window, worker, _ = resolve_rules(TrainOptions(algorithm="diloco(inner_steps=7)"))
    assert window == 7 and worker is not None and worker.name == "adamw"
    assert resolve_rules(TrainOptions(algorithm="diloco(inner_steps=7)", sync_every=7))[1] == 7
    with pytest.raises(OptionsError, match="syncs every 7 batches .* --sync-every says 3"):
        resolve_rules(TrainOptions(algorithm="diloco(inner_steps=7)", sync_every=3))
