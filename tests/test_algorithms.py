"""Each update rule's own maths, against its source: simulated in one process (a master and
k workers calling the rule's methods in the order the master/worker topology does, with
the real TorchBackend and its flat optimisers), compared with plain single-process torch
training or the published update written out. What every rule must do whatever its maths
is in test_rule_contracts.py, run on every registered rule."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from rule_simulation import (
    C0,
    F32,
    PAYLOADS,
    SAMPLES,
    STALE,
    Simulation,
    allreduce_sgd_steps,
    assert_close,
    device_runs,
    flat,
    make_batches,
    make_model,
    master_round,
    reference_run,
    sample_mean,
)

from nbdist.algorithms import (
    ADAG,
    EASGD,
    GEM,
    RULES,
    Downpour,
    DynSGD,
    SynchronousSGD,
    Update,
    allreduce_sgd,
    make_algorithm,
)
from nbdist.algorithms.base import _NoState
from nbdist.backends.torch import TorchBackend, TorchFlatOptimizer
from nbdist.data.sharding import ShardPlan
from nbdist.specs import Spec, SpecError, parse_spec

# Every registered rule with its optimisers: what tests/test_gpu.py runs on a device.
DEVICE_RUNS = device_runs()


# ----------------------------------------------------------------------------- Downpour
def test_downpour_synchronous_two_workers_is_big_batch_training():
    model = make_model()
    opt = "sgd(lr=0.2, momentum=0.9)"
    b1 = make_batches(4, 5, seed=2)
    b2 = make_batches(4, 6, seed=3)
    sim = Simulation(Downpour(), model, 2, worker_opt="sgd(lr=0.5)", master_opt=opt, synchronous=True)
    sim.run([b1, b2])
    concatenated = [
        (np.concatenate([x1, x2]), np.concatenate([y1, y2])) for (x1, y1), (x2, y2) in zip(b1, b2, strict=True)
    ]
    expected = reference_run(model, opt, concatenated)
    assert_close(sim.centre, expected)
    for w in sim.workers:
        np.testing.assert_array_equal(w.params, sim.centre)

    # The batch sizes differ by one, so an unweighted mean would be measurably different.
    plain = copy.deepcopy(model)
    backend = TorchBackend(plain)
    o = backend.make_optimizer(parse_spec(opt))
    for (x1, y1), (x2, y2) in zip(b1, b2, strict=True):
        backend.compute_gradients(x1, y1)
        g1 = backend.grads.copy()
        backend.compute_gradients(x2, y2)
        o.step((g1 + backend.grads) / 2)
    assert np.abs(backend.params - expected).max() > 1e-5


def test_downpour_asynchronous_staleness_is_recorded():
    model = make_model()
    sim = Simulation(Downpour(), model, 3, worker_opt="sgd(lr=0.1)", master_opt="sgd(lr=0.1)")
    sim.run([make_batches(2, 4, seed=s) for s in range(3)])
    # Each round the three workers compute from the same version; the master serves
    # them one at a time.
    assert sim.stalenesses == [0, 1, 2, 2, 2, 2]
    assert sim.version == 6


def test_downpour_local_steps_push_the_sum_of_gradients():
    algo = Downpour()
    state = algo.new_worker_state(3, sync_every=3)
    params = np.zeros(3, F32)
    opt = TorchFlatOptimizer(torch.optim.SGD, Spec("sgd", {"lr": 0.5}), params)
    grads = [np.array(g, F32) for g in ([1, 2, 3], [0.5, -1, 0], [2, 2, 2])]
    assert algo.worker_step(state, params, grads[0], opt) is False
    assert algo.worker_step(state, params, grads[1], opt) is False
    # Two local steps were taken; the third gradient is pushed without a local step.
    np.testing.assert_allclose(params, -0.5 * (grads[0] + grads[1]))
    assert algo.worker_step(state, params, grads[2], opt) is True
    out = np.empty(3, F32)
    algo.worker_message(state, params, out)
    np.testing.assert_allclose(out, grads[0] + grads[1] + grads[2])
    assert state.count == 0 and not state.accumulated.any()


# ----------------------------------------------------------------------------- EASGD
@pytest.mark.parametrize("synchronous", [False, True])
def test_easgd_zero_force_means_independent_workers(synchronous):
    model = make_model()
    opt = "sgd(lr=0.1, momentum=0.9)"
    data = [make_batches(9, 5, seed=10 + i) for i in range(2)]
    sim = Simulation(
        EASGD(elastic_force=0.0, elastic_momentum=0.5), model, 2, worker_opt=opt, sync_every=2, synchronous=synchronous
    )
    start = sim.centre.copy()
    sim.run(data)
    assert sim.version > 4  # they did talk to the master
    np.testing.assert_array_equal(sim.centre, start)
    for i, w in enumerate(sim.workers):
        assert_close(w.params, reference_run(model, opt, data[i]))


def easgd_two_rounds(algo: EASGD):
    """A synchronous round with two workers, then one asynchronous update from worker 0.
    Returns (replies, worker weights, centres, velocities) after each round."""
    centre = np.array([0.0, 1.0, -2.0, 4.0], F32)
    xs = [np.array([1.0, 3.0, -2.0, 0.0], F32), np.array([-1.0, 1.0, 2.0, 4.5], F32)]
    state = algo.new_master_state(4)
    worker_states = [algo.new_worker_state(4, 1) for _ in xs]
    record = []
    for round_workers, moves in (([0, 1], None), ([0], np.array([0.5, -1.0, 1.0, 2.0], F32))):
        if moves is not None:
            xs[0] += moves  # local training between the rounds
        updates = []
        for i in round_workers:
            out = np.empty(4, F32)
            algo.worker_message(worker_states[i], xs[i], out)
            np.testing.assert_array_equal(out, xs[i])
            updates.append(Update(out, 0, 10))
        replies = algo.master_apply(state, centre, updates, None)
        replies = [r.copy() for r in replies]
        for i, r in zip(round_workers, replies, strict=True):
            algo.worker_reply(worker_states[i], xs[i], r)
        record.append((replies, [x.copy() for x in xs], centre.copy(), state.velocity.copy()))
    return record


def easgd_formula(alpha: float, momentum: float):
    """The same two rounds by the formula, in float64."""
    c = np.array([0.0, 1.0, -2.0, 4.0])
    xs = [np.array([1.0, 3.0, -2.0, 0.0]), np.array([-1.0, 1.0, 2.0, 4.5])]
    u = np.zeros(4)
    record = []
    diffs = [alpha * (x - c) for x in xs]
    xs = [x - d for x, d in zip(xs, diffs, strict=True)]
    u = momentum * u + sum(diffs)
    c = c + u
    record.append((diffs, [x.copy() for x in xs], c.copy(), u.copy()))
    xs[0] = xs[0] + np.array([0.5, -1.0, 1.0, 2.0])
    d = alpha * (xs[0] - c)
    xs[0] = xs[0] - d
    u = momentum * u + d
    c = c + u
    record.append(([d], [x.copy() for x in xs], c.copy(), u.copy()))
    return record


@pytest.mark.parametrize(
    "force, lr, momentum",
    [
        (0.25, 1.0, 0.0),
        (0.25, 0.5, 0.0),
        (0.25, 0.5, 0.5),
        (0.5, 0.25, 0.75),
    ],
)
def test_easgd_elastic_step_follows_the_formula(force, lr, momentum):
    got = easgd_two_rounds(EASGD(elastic_force=force, elastic_lr=lr, elastic_momentum=momentum))
    want = easgd_formula(lr * force, momentum)
    for (replies, xs, c, u), (w_diffs, w_xs, w_c, w_u) in zip(got, want, strict=True):
        for r, d in zip(replies, w_diffs, strict=True):
            assert_close(r, d)
        for x, w_x in zip(xs, w_xs, strict=True):
            assert_close(x, w_x)
        assert_close(c, w_c)
        assert_close(u, w_u)


def test_easgd_elastic_lr_and_momentum_change_the_result():
    base = easgd_two_rounds(EASGD(elastic_force=0.25, elastic_lr=1.0, elastic_momentum=0.0))
    half_lr = easgd_two_rounds(EASGD(elastic_force=0.25, elastic_lr=0.5, elastic_momentum=0.0))
    with_momentum = easgd_two_rounds(EASGD(elastic_force=0.25, elastic_lr=1.0, elastic_momentum=0.5))
    # First round: halving elastic_lr halves every diff exactly.
    for r_base, r_half in zip(base[0][0], half_lr[0][0], strict=True):
        assert np.abs(r_base).max() > 0
        assert_close(r_half, 0.5 * r_base)
    # Momentum does nothing in the first round, and adds momentum * u_1 to the second move.
    assert_close(with_momentum[0][2], base[0][2])
    u1 = base[0][3]
    move_base = base[1][2] - base[0][2]
    move_momentum = with_momentum[1][2] - with_momentum[0][2]
    assert np.abs(u1).max() > 0
    assert_close(move_momentum, move_base + 0.5 * u1)


def test_easgd_default_elastic_force():
    algo = EASGD()
    algo.bind(workers=4)
    assert algo.params["elastic_force"] == pytest.approx(0.9 / 4)
    got = easgd_two_rounds(algo)
    want = easgd_formula(0.9 / 4, 0.0)
    assert_close(got[0][0][0], want[0][0][0])
    algo = EASGD(elastic_lr=2.0)
    algo.bind(workers=3)
    assert algo.alpha == pytest.approx(2.0 * 0.3)
    explicit = EASGD(elastic_force=0.5)
    explicit.bind(workers=4)
    assert explicit.params["elastic_force"] == 0.5 and explicit.alpha == pytest.approx(0.5)


@pytest.mark.parametrize(
    "kwargs", [{"elastic_momentum": 1.0}, {"elastic_momentum": -0.1}, {"elastic_force": -1.0}, {"elastic_lr": -0.5}]
)
def test_easgd_rejects_bad_parameters(kwargs):
    with pytest.raises(ValueError, match="easgd"):
        EASGD(**kwargs)
    with pytest.raises(SpecError, match="easgd"):
        make_algorithm(Spec("easgd", kwargs))


@pytest.mark.parametrize(
    "spec, message",
    [
        ("easgd(elastic_force=-1)", "easgd: elastic_force must be >= 0, got -1"),
        ("easgd(elastic_lr='fast')", "easgd: elastic_lr must be a number >= 0, got 'fast'"),
        ("easgd(elastic_momentum=1.0)", "easgd: elastic_momentum must be in [0, 1), got 1.0"),
        ("gem(lr=-1)", "gem: lr must be > 0, got -1"),
        ("gem(momentum=1.5)", "gem: momentum must be in [0, 1), got 1.5"),
        ("gem(kappa=0)", "gem: kappa must be > 0, got 0"),
        ("gem(epsilon=0)", "gem: epsilon must be > 0, got 0"),
        ("gem(lr=1e999)", "gem: lr must be a number > 0, got inf"),
    ],
)
def test_rule_arguments_out_of_range_name_the_range(spec, message):
    with pytest.raises(SpecError) as err:
        make_algorithm(parse_spec(spec))
    assert str(err.value) == message


# ----------------------------------------------------------------------------- GEM
def gem_reference(lr, momentum, kappa, eps, pi_max, grads, pulls):
    """pi and the update by the formula, in float64. pulls[t] is the centre held at message t."""
    v = np.zeros_like(grads[0], dtype=np.float64)
    out = []
    for t, g in enumerate(grads):
        g = np.asarray(g, np.float64)
        v = momentum * v + lr * g
        c = np.abs(pulls[t] - pulls[t - 1]) if t >= 1 else np.zeros_like(v)
        pi = np.clip((kappa * np.abs(v) - c) / (np.abs(lr * g) + eps), 0.0, pi_max)
        out.append((pi, -pi * lr * g))
    return out


def test_gem_rescaling_by_hand():
    lr, momentum, kappa, eps, pi_max = 0.5, 0.5, 2.0, 1e-12, 3.0
    algo = GEM(lr=lr, momentum=momentum, kappa=kappa, epsilon=eps, pi_max=pi_max)
    grads = [np.array(g, F32) for g in ([1, 2, -1, 0.5], [1, 0.1, 1, -0.5], [0.5, -1, 2, 1])]
    # The centres this worker pulls: the master moved them with other workers' updates too.
    pulls = [np.array(c, F32) for c in ([0, 0, 0, 0], [-1, -0.25, 0.5, 3.0], [-2, 0.5, 0.5, 2.0])]
    state = algo.new_worker_state(4, sync_every=1)
    params = pulls[0].copy()
    algo.worker_start(state, params)
    sent = []
    for t, g in enumerate(grads):
        before = params.copy()
        assert algo.worker_step(state, params, g, None) is True
        np.testing.assert_array_equal(params, before)  # no local steps
        out = np.empty(4, F32)
        algo.worker_message(state, params, out)
        sent.append(out)
        if t + 1 < len(pulls):
            algo.worker_reply(state, params, pulls[t + 1].copy())
    # By hand: pi_1 = kappa (no centre velocity yet); message 2 clips at pi_max (element 1:
    # (1.1 - 0.25) / 0.05 = 17) and at 0 (elements 1..3); message 3 uses |c2 - c1|, not |c2 - c0|.
    by_hand = [[-1.0, -2.0, 1.0, -0.5], [-0.5, -0.15, 0.0, 0.0], [-0.25, 0.0, -2.25, 0.0]]
    pis = [[2, 2, 2, 2], [1, 3, 0, 0], [1, 0, 2.25, 0]]
    reference = gem_reference(lr, momentum, kappa, eps, pi_max, grads, [p.astype(np.float64) for p in pulls])
    for out, hand, pi, (ref_pi, ref_update) in zip(sent, by_hand, pis, reference, strict=True):
        assert_close(ref_pi, pi)
        assert_close(ref_update, hand)
        assert_close(out, hand)


def test_gem_averages_the_window():
    algo = GEM(lr=0.1, momentum=0.9, kappa=1.5)
    ga, gb = np.array([1.0, -2.0, 0.5], F32), np.array([3.0, 0.0, -0.5], F32)
    two = algo.new_worker_state(3, sync_every=2)
    one = algo.new_worker_state(3, sync_every=1)
    params = np.array([0.1, 0.2, 0.3], F32)
    for s in (two, one):
        algo.worker_start(s, params)
    assert algo.worker_step(two, params, ga, None) is False
    assert algo.worker_step(two, params, gb, None) is True
    assert algo.worker_step(one, params, (ga + gb) / 2, None) is True
    out_two, out_one = np.empty(3, F32), np.empty(3, F32)
    algo.worker_message(two, params, out_two)
    algo.worker_message(one, params, out_one)
    assert_close(out_two, out_one)
    assert_close(out_two, -1.5 * 0.1 * (ga + gb) / 2)  # no centre velocity: pi = kappa


# ----------------------------------------------------------------------------- ADAG
def test_adag_worker_sends_the_displacement_normalised_by_the_window():
    algo = ADAG()
    n, lam, lr = 4, 3, 0.25
    pulled = np.array([1.0, -1.0, 0.5, 2.0], F32)
    params = pulled.copy()
    state = algo.new_worker_state(n, sync_every=lam)
    algo.worker_start(state, params)
    opt = TorchFlatOptimizer(torch.optim.SGD, Spec("sgd", {"lr": lr}), params)
    grads = [np.array(g, F32) for g in ([1, 2, 3, 4], [0, -4, 1, 1], [2, 2, -2, 0])]
    for t, g in enumerate(grads):
        assert algo.worker_step(state, params, g, opt) is (t == lam - 1)
    local = pulled - lr * sum(grads)
    assert_close(params, local)
    out = np.empty(n, F32)
    algo.worker_message(state, params, out)
    assert_close(out, (local - pulled) / lam)
    assert state.count == 0
    reply = np.array([0.0, 1.0, 2.0, 3.0], F32)
    algo.worker_reply(state, params, reply.copy())
    np.testing.assert_array_equal(params, reply)
    np.testing.assert_array_equal(state.pulled, reply)


def test_adag_asynchronous_simulation_adds_every_update_undiscounted():
    model = make_model()
    sim = Simulation(ADAG(), model, 2, worker_opt="sgd(lr=0.1)", sync_every=2)
    before = sim.centre.copy()
    data = [make_batches(2, 5, seed=20 + i) for i in range(2)]
    sim.run(data)
    # Each worker did two plain SGD steps from `before`; worker 1 was served second
    # (staleness 1), and ADAG adds its update all the same.
    moved = [(reference_run(model, "sgd(lr=0.1)", data[i]) - before) / 2 for i in range(2)]
    assert sim.stalenesses == [0, 1]
    assert_close(sim.centre, before + moved[0] + moved[1], rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- the rules as published
@pytest.mark.parametrize("rule", [ADAG, DynSGD])
def test_adag_and_dynsgd_as_published(rule):
    # Hermans' ADAG (dist-keras ADAGParameterServer): centre += update, stale or not.
    # DynSGD (Jiang et al. 2017; dist-keras DynSGDParameterServer): centre += update / (staleness + 1).
    discount = 1.0 / (STALE + 1) if rule is DynSGD else 1.0
    centre, replies = master_round(rule(), PAYLOADS[:1], SAMPLES[:1], [STALE])
    assert_close(centre, C0 + discount * PAYLOADS[0])
    np.testing.assert_array_equal(replies[0], centre)
    # A synchronous round (never stale): the sample-weighted mean, not the sum.
    centre, replies = master_round(rule(), PAYLOADS, SAMPLES, [0, 0, 0])
    assert_close(centre, C0 + sample_mean(PAYLOADS, SAMPLES))
    for reply in replies:
        np.testing.assert_array_equal(reply, centre)


def test_adag_with_the_staleness_discount_is_dynsgd():
    """What a run sets for ADAG under --momentum-correction auto (train/asynchrony.py):
    centre += update / (staleness + 1), as DynSGD's master does."""
    adag = ADAG()
    adag.discount_stale = True
    centre, _ = master_round(adag, PAYLOADS[:1], SAMPLES[:1], [STALE])
    assert_close(centre, C0 + PAYLOADS[0] / (STALE + 1))
    assert_close(centre, master_round(DynSGD(), PAYLOADS[:1], SAMPLES[:1], [STALE])[0], rtol=0, atol=0)
    assert not ADAG().discount_stale and DynSGD().discount_stale


def test_dynsgd_workers_are_adags():
    adag, dyn = ADAG(), DynSGD()
    assert dyn.name == "dynsgd" and dyn.carries_local_steps and dyn.default_sync_every == adag.default_sync_every
    assert isinstance(make_algorithm(parse_spec("dynsgd")), DynSGD)


def test_downpour_as_published():
    # Dean et al.: the master's optimiser steps on the pushed gradient (here sgd, lr 0.1):
    # centre -= lr * g. Synchronous: one step on the sample-weighted mean gradient.
    lr = 0.1
    centre, _ = master_round(Downpour(), PAYLOADS[:1], SAMPLES[:1], [STALE], f"sgd(lr={lr})")
    assert_close(centre, C0 - lr * PAYLOADS[0])
    centre, replies = master_round(Downpour(), PAYLOADS, SAMPLES, [0, 0, 0], f"sgd(lr={lr})")
    assert_close(centre, C0 - lr * sample_mean(PAYLOADS, SAMPLES))


def test_easgd_as_published():
    # Zhang et al.: the worker sends x_i, the master replies alpha (x_i - centre) and adds it;
    # a synchronous round adds sum_i alpha (x_i - centre) = beta (mean_i x_i - centre),
    # beta = 3 alpha = 0.9 with the default alpha = 0.9 / workers (whatever the samples).
    weights = [C0 + p for p in PAYLOADS]  # the workers' x_i
    algo = EASGD()
    algo.bind(3)
    alpha = 0.9 / 3
    centre, replies = master_round(algo, weights[:1], SAMPLES[:1], [STALE])
    assert_close(replies[0], alpha * (weights[0] - C0))
    assert_close(centre, C0 + alpha * (weights[0] - C0))
    algo = EASGD()
    algo.bind(3)
    centre, replies = master_round(algo, weights, SAMPLES, [0, 0, 0])
    assert_close(centre, C0 + sum(alpha * (x - C0) for x in weights))
    assert_close(centre, C0 + 0.9 * (np.mean(weights, axis=0) - C0))
    for reply, x in zip(replies, weights, strict=True):
        assert_close(reply, alpha * (x - C0))


def test_gem_as_published():
    # Hermans & Louppe: each worker sends -pi * lr * g with
    # pi = clip((kappa |v| - |c|) / (|lr g| + eps), 0, pi_max), v = momentum v + lr g,
    # c the centre's move between its last two pulls; the master adds it (asynchronous)
    # or the sample-weighted mean of the round's (synchronous).
    lr, momentum, kappa, eps, pi_max = 0.1, 0.5, 2.0, 1e-12, 4.0
    previous, now = C0 - np.array([0.05, -0.02, 0.0, 0.3]), C0
    grads = [np.array([1.0, -2.0, 0.5, 3.0]), np.array([-0.5, 1.0, 2.0, 0.1]), np.array([0.2, 0.2, -1.0, -1.5])]
    algo = GEM(lr=lr, momentum=momentum, kappa=kappa, epsilon=eps, pi_max=pi_max)
    sent, expected, pis = [], [], []
    for g in grads:
        state = algo.new_worker_state(4, sync_every=1)
        params = previous.astype(F32)
        algo.worker_start(state, params)
        algo.worker_reply(state, params, now.astype(F32))  # a second pull: the centre moved
        assert algo.worker_step(state, params, g.astype(F32), None) is True
        out = np.empty(4, F32)
        algo.worker_message(state, params, out)
        v = lr * g  # momentum * 0 + lr g
        pi = np.clip((kappa * np.abs(v) - np.abs(now - previous)) / (np.abs(lr * g) + eps), 0.0, pi_max)
        pis.append(pi)
        expected.append(-pi * lr * g)
        sent.append(out)
        assert_close(out, expected[-1], rtol=1e-5, atol=1e-7)
    # The rescaling is at work: pi is neither constant nor only at its bounds.
    assert len({round(float(p), 6) for p in np.concatenate(pis)}) > 3
    assert ((np.concatenate(pis) > 0) & (np.concatenate(pis) < pi_max)).any()
    centre, _ = master_round(algo, sent[:1], SAMPLES[:1], [STALE])
    assert_close(centre, C0 + expected[0], rtol=1e-5, atol=1e-6)
    centre, replies = master_round(algo, sent, SAMPLES, [0, 0, 0])
    assert_close(centre, C0 + sample_mean(expected, SAMPLES), rtol=1e-5, atol=1e-6)
    for reply in replies:
        np.testing.assert_array_equal(reply, centre)


def test_gem_with_the_staleness_discount_adds_each_update_over_one_plus_its_staleness():
    """What a run sets for GEM under --momentum-correction auto from 8 workers
    (train/asynchrony.py): centre += update / (staleness + 1), one update after another."""
    gem = GEM()
    gem.discount_stale = True
    centre, replies = master_round(gem, PAYLOADS[:1], SAMPLES[:1], [STALE])
    assert_close(centre, C0 + PAYLOADS[0] / (STALE + 1))
    np.testing.assert_array_equal(replies[0], centre)
    centre, _ = master_round(gem, PAYLOADS[:1], SAMPLES[:1], [0])  # a fresh one, whole
    assert_close(centre, C0 + PAYLOADS[0])
    assert not GEM().discount_stale


# ----------------------------------------------------------------------------- allreduce sgd
@pytest.mark.parametrize("n, shards, batch", [(11, 2, 6), (23, 3, 8)])
def test_sample_shares_give_the_concatenated_batch_gradient(n, shards, batch):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(n, 6)).astype(F32)
    y = rng.integers(0, 3, size=n)
    backend = TorchBackend(make_model())
    plan = ShardPlan(n, shards, batch, seed=1)
    sizes = plan.step_sizes(0)
    assert len(set(sizes[0])) > 1  # uneven shards: the shares matter
    total = np.zeros_like(backend.grads)
    indices = [plan.epoch(0, s)[0] for s in range(shards)]
    for s in range(shards):
        share = allreduce_sgd.sample_share(sizes[0], s)
        assert share == pytest.approx(len(indices[s]) / sum(len(i) for i in indices))
        backend.compute_gradients(x[indices[s]], y[indices[s]], scale=share)
        total += backend.grads
    everything = np.concatenate(indices)
    backend.compute_gradients(x[everything], y[everything])
    assert_close(total, backend.grads, rtol=1e-5, atol=1e-7)
    assert sum(allreduce_sgd.sample_share(sizes[0], s) for s in range(shards)) == pytest.approx(1.0)


def test_allreduce_apply_steps_the_optimizer():
    params = np.array([1.0, 2.0], F32)
    opt = TorchFlatOptimizer(torch.optim.SGD, Spec("sgd", {"lr": 0.5}), params)
    allreduce_sgd.apply(opt, np.array([2.0, -2.0], F32))
    np.testing.assert_array_equal(params, [0.0, 3.0])


def test_allreduce_sgd_on_torch_tensors_gives_the_numpy_result():
    results = [allreduce_sgd_steps(tensors) for tensors in (False, True)]
    assert_close(results[1], results[0], rtol=0, atol=1e-6)
    assert np.abs(results[0] - flat(make_model())).max() > 1e-3


# ----------------------------------------------------------------------------- rule state


def test_master_state_kinds():
    assert isinstance(Downpour().new_master_state(3), _NoState)
    assert Downpour().new_master_state(3).to_arrays() == {}
    assert set(EASGD().new_master_state(3).to_arrays()) == {"velocity"}


# ----------------------------------------------------------------------------- registry
def test_make_algorithm_builds_each_rule():
    algo = make_algorithm(parse_spec("easgd(elastic_force=0.5, elastic_momentum=0.9)"))
    assert isinstance(algo, EASGD) and algo.params["elastic_force"] == 0.5
    assert isinstance(make_algorithm(parse_spec("gem(lr=0.01)")), GEM)
    assert isinstance(make_algorithm(parse_spec("adag")), ADAG)
    assert isinstance(make_algorithm(parse_spec("Downpour")), Downpour)


def test_make_algorithm_unknown_name_suggests():
    with pytest.raises(SpecError, match=r"did you mean 'easgd'") as err:
        make_algorithm(parse_spec("easdg"))
    for name in ("downpour", "easgd", "gem", "adag", "dynsgd"):
        assert name in str(err.value)


def test_make_algorithm_bad_parameter_lists_accepted():
    with pytest.raises(SpecError) as err:
        make_algorithm(parse_spec("easgd(elastic_forse=0.5)"))
    text = str(err.value)
    assert "elastic_forse" in text
    for name in ("elastic_force", "elastic_lr", "elastic_momentum"):
        assert name in text
    with pytest.raises(SpecError, match="lr, momentum, kappa, epsilon, pi_max"):
        make_algorithm(parse_spec("gem(learning_rate=0.1)"))
    with pytest.raises(SpecError, match="takes no parameters") as err:
        make_algorithm(parse_spec("downpour(lr=0.1)"))
    assert "'lr'" in str(err.value)


def test_the_allreduce_rule_is_registered_and_refused_on_the_master_worker_topology():
    assert RULES.get("sgd") is SynchronousSGD and SynchronousSGD.topologies == ("allreduce",)
    with pytest.raises(SpecError, match="sgd trains the allreduce topology; the master-worker topology takes one of: "):
        make_algorithm(parse_spec("sgd"))
