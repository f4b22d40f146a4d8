"""Update rules, simulated in one process: a master and k workers that call the rule's
methods in the order the master/worker topology does, with the real TorchBackend and
its flat optimisers, compared with plain single-process torch training."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn

from nbdist.algorithms import ADAG, EASGD, GEM, Downpour, DynSGD, Update, allreduce_sgd, make_algorithm
from nbdist.algorithms.arrays import to_numpy
from nbdist.algorithms.base import _NoState
from nbdist.backends import DeviceRequest
from nbdist.backends.torch import TorchBackend, TorchFlatOptimizer, torch_optimizers
from nbdist.data.sharding import ShardPlan
from nbdist.specs import Spec, SpecError, parse_spec
from nbdist.transport.staging import Staging

F32 = np.float32


# ----------------------------------------------------------------------------- helpers
def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def make_batches(count: int, size: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(size, 6)).astype(F32), rng.integers(0, 3, size=size)) for _ in range(count)]


def flat(model: nn.Module) -> np.ndarray:
    """A model's weights laid out like TorchBackend.params (reverse registration order)."""
    return torch.cat([p.detach().reshape(-1) for p in reversed(list(model.parameters()))]).numpy().copy()


def reference_run(model: nn.Module, spec: str, batches) -> np.ndarray:
    """Plain single-process training: per-parameter torch.optim (single-tensor path)."""
    ref = copy.deepcopy(model)
    s = parse_spec(spec)
    opt = torch_optimizers()[s.name](ref.parameters(), **s.kwargs, foreach=False)
    loss_fn = nn.CrossEntropyLoss()
    for x, y in batches:
        opt.zero_grad()
        loss_fn(ref(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()
    return flat(ref)


def assert_close(actual, expected, rtol=1e-6, atol=1e-7):
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


class Simulation:
    """One master and k workers in one process, calling the rule as roles/master/ does.

    synchronous: the master waits for every worker's update and applies them together.
    asynchronous: every worker computes from the weights it holds, then the master
    serves the updates one at a time (as Testsome hands them over), so the later ones
    are stale by the number served before them.

    tensors: every backend is placed with --device cpu, so the rules run on torch tensors
    and every message and reply goes through the transport's staging, as on a GPU.
    """

    def __init__(
        self,
        algorithm,
        model: nn.Module,
        k: int,
        *,
        worker_opt: str | None = None,
        master_opt: str | None = None,
        sync_every: int = 1,
        synchronous: bool = False,
        tensors: bool = False,
    ):
        self.algorithm, self.k, self.synchronous = algorithm, k, synchronous
        algorithm.bind(k)
        self.master = self._backend(model, tensors)
        self.center = self.master.rule_params
        n = self.master.num_params
        self.master_state = algorithm.new_master_state(n, like=self.center)
        self.master_opt = (
            self.master.make_optimizer(parse_spec(master_opt))
            if master_opt and algorithm.uses_master_optimizer
            else None
        )
        self.workers = [self._backend(model, tensors) for _ in range(k)]
        self.worker_opts = [
            w.make_optimizer(parse_spec(worker_opt)) if worker_opt and algorithm.uses_worker_optimizer else None
            for w in self.workers
        ]
        self.worker_states = [algorithm.new_worker_state(n, sync_every, like=w.rule_params) for w in self.workers]
        self.version = 0
        self.worker_versions = [0] * k
        self.samples = [0] * k
        self.stalenesses: list[int] = []
        for w, state in zip(self.workers, self.worker_states, strict=True):
            w.rule_params[...] = self.center  # the Bcast of the initial weights
            algorithm.worker_start(state, w.rule_params)

    @staticmethod
    def _backend(model: nn.Module, tensors: bool) -> TorchBackend:
        backend = TorchBackend(copy.deepcopy(model))
        if tensors:
            backend.place(DeviceRequest("cpu"))
        return backend

    def run(self, batches_per_worker) -> None:
        """batches_per_worker[i]: worker i's (x, y) batches of one epoch, all of one length."""
        steps = len(batches_per_worker[0])
        algo = self.algorithm
        for step in range(steps):
            pending: list[tuple[int, np.ndarray, int]] = []
            for i, w in enumerate(self.workers):
                x, y = batches_per_worker[i][step]
                w.compute_gradients(x, y)
                self.samples[i] += len(y)
                sync = algo.worker_step(self.worker_states[i], w.rule_params, w.rule_grads, self.worker_opts[i])
                if sync or step == steps - 1:
                    message = Staging.of_host(np.empty(w.num_params, F32), w.rule_params, w.copier)
                    algo.worker_message(self.worker_states[i], w.rule_params, message.device)
                    # What the master's receive buffer holds, as its rule sees it.
                    out = Staging.of_host(message.to_host().copy(), self.center).device
                    pending.append((i, out, self.samples[i]))
                    self.samples[i] = 0
            if not pending:
                continue
            if self.synchronous:
                assert len(pending) == self.k
                groups = [pending]
            else:
                groups = [[p] for p in pending]
            for group in groups:
                # Staleness as the master sees it: its version now - the one the worker used.
                updates = [Update(out, self.version - self.worker_versions[i], samples) for i, out, samples in group]
                replies = algo.master_apply(self.master_state, self.center, updates, self.master_opt)
                self.version += 1
                assert len(replies) == len(group)
                for (i, _, _), update, reply in zip(group, updates, replies, strict=True):
                    self.stalenesses.append(update.staleness)
                    worker = self.workers[i]
                    received = Staging.of_host(to_numpy(reply).copy(), worker.rule_params, worker.copier)  # MPI's
                    received.to_device()
                    algo.worker_reply(self.worker_states[i], worker.rule_params, received.device)
                    self.worker_versions[i] = self.version


# ----------------------------------------------------------------------------- Downpour
@pytest.mark.parametrize("opt", ["sgd(lr=0.1, momentum=0.9)", "adam(lr=0.01)"])
@pytest.mark.parametrize("synchronous", [False, True])
def test_downpour_one_worker_is_plain_training(opt, synchronous):
    model = make_model()
    batches = make_batches(12, 7, seed=1)
    sim = Simulation(
        Downpour(), model, 1, worker_opt="sgd(lr=0.5)", master_opt=opt, sync_every=1, synchronous=synchronous
    )
    start = sim.center.copy()
    sim.run([batches])
    expected = reference_run(model, opt, batches)
    assert not np.allclose(start, expected, rtol=1e-3)  # it did train
    assert_close(sim.center, expected)
    np.testing.assert_array_equal(sim.workers[0].params, sim.center)
    assert sim.stalenesses == [0] * 12


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
    assert_close(sim.center, expected)
    for w in sim.workers:
        np.testing.assert_array_equal(w.params, sim.center)

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
    start = sim.center.copy()
    sim.run(data)
    assert sim.version > 4  # they did talk to the master
    np.testing.assert_array_equal(sim.center, start)
    for i, w in enumerate(sim.workers):
        assert_close(w.params, reference_run(model, opt, data[i]))


def easgd_two_rounds(algo: EASGD):
    """A synchronous round with two workers, then one asynchronous update from worker 0.
    Returns (replies, worker weights, centres, velocities) after each round."""
    center = np.array([0.0, 1.0, -2.0, 4.0], F32)
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
        replies = algo.master_apply(state, center, updates, None)
        replies = [r.copy() for r in replies]
        for i, r in zip(round_workers, replies, strict=True):
            algo.worker_reply(worker_states[i], xs[i], r)
        record.append((replies, [x.copy() for x in xs], center.copy(), state.velocity.copy()))
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
    before = sim.center.copy()
    data = [make_batches(2, 5, seed=20 + i) for i in range(2)]
    sim.run(data)
    # Each worker did two plain SGD steps from `before`; worker 1 was served second
    # (staleness 1), and ADAG adds its update all the same.
    moved = [(reference_run(model, "sgd(lr=0.1)", data[i]) - before) / 2 for i in range(2)]
    assert sim.stalenesses == [0, 1]
    assert_close(sim.center, before + moved[0] + moved[1], rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------- the rules as published
# Each master against its source's update, written out here in float64: one asynchronous
# update that is STALE versions old, then a synchronous round of three updates with
# different sample counts, which every rule averages, sample-weighted.
C0 = np.array([0.5, -1.0, 2.0, 0.25])
PAYLOADS = [np.array([0.2, -0.4, 0.1, 1.0]), np.array([-0.3, 0.5, 0.0, 0.6]), np.array([1.0, 0.25, -0.5, -0.2])]
SAMPLES = [5, 7, 12]
STALE = 3


def master_round(algo, payloads, samples, staleness, opt_spec=None):
    """(centre after master_apply from C0, replies); staleness is each update's."""
    center = C0.astype(F32)
    opt = TorchFlatOptimizer(torch.optim.SGD, parse_spec(opt_spec), center) if opt_spec else None
    updates = [Update(np.array(p, F32), s, n) for p, s, n in zip(payloads, staleness, samples, strict=True)]
    replies = algo.master_apply(algo.new_master_state(C0.size), center, updates, opt)
    return center, [np.array(r, copy=True) for r in replies]


def sample_mean(vectors, samples):
    return sum(n * v for n, v in zip(samples, vectors, strict=True)) / sum(samples)


@pytest.mark.parametrize("rule", [ADAG, DynSGD])
def test_adag_and_dynsgd_as_published(rule):
    # Hermans' ADAG (dist-keras ADAGParameterServer): centre += update, stale or not.
    # DynSGD (Jiang et al. 2017; dist-keras DynSGDParameterServer): centre += update / (staleness + 1).
    discount = 1.0 / (STALE + 1) if rule is DynSGD else 1.0
    center, replies = master_round(rule(), PAYLOADS[:1], SAMPLES[:1], [STALE])
    assert_close(center, C0 + discount * PAYLOADS[0])
    np.testing.assert_array_equal(replies[0], center)
    # A synchronous round (never stale): the sample-weighted mean, not the sum.
    center, replies = master_round(rule(), PAYLOADS, SAMPLES, [0, 0, 0])
    assert_close(center, C0 + sample_mean(PAYLOADS, SAMPLES))
    for reply in replies:
        np.testing.assert_array_equal(reply, center)


def test_adag_with_the_staleness_discount_is_dynsgd():
    """What a run sets for ADAG under --momentum-correction auto (train/asynchrony.py):
    centre += update / (staleness + 1), as DynSGD's master does."""
    adag = ADAG()
    adag.discount_stale = True
    center, _ = master_round(adag, PAYLOADS[:1], SAMPLES[:1], [STALE])
    assert_close(center, C0 + PAYLOADS[0] / (STALE + 1))
    assert_close(center, master_round(DynSGD(), PAYLOADS[:1], SAMPLES[:1], [STALE])[0], rtol=0, atol=0)
    assert not ADAG().discount_stale and DynSGD().discount_stale


def test_dynsgd_workers_are_adags():
    adag, dyn = ADAG(), DynSGD()
    assert dyn.name == "dynsgd" and dyn.sends_weights and dyn.default_sync_every == adag.default_sync_every
    assert isinstance(make_algorithm(parse_spec("dynsgd")), DynSGD)


def test_downpour_as_published():
    # Dean et al.: the master's optimiser steps on the pushed gradient (here sgd, lr 0.1):
    # centre -= lr * g. Synchronous: one step on the sample-weighted mean gradient.
    lr = 0.1
    center, _ = master_round(Downpour(), PAYLOADS[:1], SAMPLES[:1], [STALE], f"sgd(lr={lr})")
    assert_close(center, C0 - lr * PAYLOADS[0])
    center, replies = master_round(Downpour(), PAYLOADS, SAMPLES, [0, 0, 0], f"sgd(lr={lr})")
    assert_close(center, C0 - lr * sample_mean(PAYLOADS, SAMPLES))


def test_easgd_as_published():
    # Zhang et al.: the worker sends x_i, the master replies alpha (x_i - centre) and adds it;
    # a synchronous round adds sum_i alpha (x_i - centre) = beta (mean_i x_i - centre),
    # beta = 3 alpha = 0.9 with the default alpha = 0.9 / workers (whatever the samples).
    weights = [C0 + p for p in PAYLOADS]  # the workers' x_i
    algo = EASGD()
    algo.bind(3)
    alpha = 0.9 / 3
    center, replies = master_round(algo, weights[:1], SAMPLES[:1], [STALE])
    assert_close(replies[0], alpha * (weights[0] - C0))
    assert_close(center, C0 + alpha * (weights[0] - C0))
    algo = EASGD()
    algo.bind(3)
    center, replies = master_round(algo, weights, SAMPLES, [0, 0, 0])
    assert_close(center, C0 + sum(alpha * (x - C0) for x in weights))
    assert_close(center, C0 + 0.9 * (np.mean(weights, axis=0) - C0))
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
    center, _ = master_round(algo, sent[:1], SAMPLES[:1], [STALE])
    assert_close(center, C0 + expected[0], rtol=1e-5, atol=1e-6)
    center, replies = master_round(algo, sent, SAMPLES, [0, 0, 0])
    assert_close(center, C0 + sample_mean(expected, SAMPLES), rtol=1e-5, atol=1e-6)
    for reply in replies:
        np.testing.assert_array_equal(reply, center)


def test_gem_with_the_staleness_discount_adds_each_update_over_one_plus_its_staleness():
    """What a run sets for GEM under --momentum-correction auto from 8 workers
    (train/asynchrony.py): centre += update / (staleness + 1), one update after another."""
    gem = GEM()
    gem.discount_stale = True
    center, replies = master_round(gem, PAYLOADS[:1], SAMPLES[:1], [STALE])
    assert_close(center, C0 + PAYLOADS[0] / (STALE + 1))
    np.testing.assert_array_equal(replies[0], center)
    center, _ = master_round(gem, PAYLOADS[:1], SAMPLES[:1], [0])  # a fresh one, whole
    assert_close(center, C0 + PAYLOADS[0])
    assert not GEM().discount_stale


@pytest.mark.parametrize("rule", [Downpour, EASGD, GEM, ADAG, DynSGD], ids=lambda r: r.name)
def test_a_synchronous_round_of_equal_updates_moves_the_centre_as_one(rule):
    """--synchronous does not multiply the step by the number of workers: a round of W
    identical updates moves the centre exactly as one of them does."""

    def move(count):
        algo = rule()
        algo.bind(count)
        payload = (C0 + PAYLOADS[0]) if rule is EASGD else PAYLOADS[0]
        spec = "sgd(lr=0.1)" if rule is Downpour else None
        center, _ = master_round(algo, [payload] * count, [8] * count, [0] * count, spec)
        return center - C0

    assert np.abs(move(1)).max() > 0.01
    assert_close(move(4), move(1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tensors", [False, True], ids=["numpy", "torch-worker"])
@pytest.mark.parametrize(
    "rule",
    [Downpour, lambda: EASGD(elastic_momentum=0.5), GEM, ADAG, DynSGD],
    ids=["downpour", "easgd", "gem", "adag", "dynsgd"],
)
def test_a_streamed_synchronous_round_gives_master_apply_bit_for_bit(rule, tensors):
    """master_round, drawing one payload at a time (each clobbered once the next is drawn,
    as the master's pooled buffers are), then worker_round_reply on each worker's weights
    (torch tensors too), against master_apply and worker_reply on the whole round: the
    same centre, velocity and worker weights, bit for bit, over two rounds with uneven
    samples (and a round of one)."""
    rng = np.random.default_rng(3)
    results = []
    for streamed in (False, True):
        algo = rule()
        algo.bind(3)
        center = rng.normal(size=64).astype(F32) if not results else results[0][2].copy()
        start = center.copy()
        state = algo.new_master_state(center.size)
        opt = TorchFlatOptimizer(torch.optim.SGD, parse_spec("sgd(lr=0.1, momentum=0.9)"), center)
        inputs = np.random.default_rng(7)
        workers = [(start + inputs.normal(size=64).astype(F32)) for _ in range(3)]
        params = [torch.from_numpy(x) if tensors else x for x in workers]  # views: the same weights
        worker_states = [algo.new_worker_state(64, 1, like=p) for p in params]
        for samples in ([5, 7, 12], [9]):
            sent = [
                inputs.normal(size=64).astype(F32) if not algo.sends_weights else x.copy()
                for x in workers[: len(samples)]
            ]
            if streamed:

                def draw(sent, samples):
                    buffer = np.empty(64, F32)
                    for payload, n in zip(sent, samples, strict=True):
                        buffer[...] = payload
                        yield Update(buffer, 0, n)
                        buffer[...] = np.nan  # the pool's next body

                reply = algo.master_round(state, center, draw(sent, samples), samples, opt, np.empty(64, F32))
                for p, ws in zip(params[: len(samples)], worker_states[: len(samples)], strict=True):
                    algo.worker_round_reply(ws, p, torch.from_numpy(reply.copy()) if tensors else reply.copy())
            else:
                replies = algo.master_apply(
                    state, center, [Update(p.copy(), 0, n) for p, n in zip(sent, samples, strict=True)], opt
                )
                for p, ws, r in zip(params[: len(samples)], worker_states[: len(samples)], replies, strict=True):
                    algo.worker_reply(ws, p, torch.from_numpy(r.copy()) if tensors else r.copy())
        results.append((center, [to_numpy(v) for v in state.to_arrays().values()], start, workers))
    (center, velocity, _, workers), (center2, velocity2, _, workers2) = results
    np.testing.assert_array_equal(center2, center)
    assert np.abs(center - results[0][2]).max() > 1e-3  # it moved
    for a, b in zip(velocity, velocity2, strict=True):
        np.testing.assert_array_equal(b, a)
    for a, b in zip(workers, workers2, strict=True):
        np.testing.assert_array_equal(b, a)


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


# ----------------------------------------------------------------------------- the device path
# Each rule with its worker (and master) optimiser; windows of 2 so local steps count too.
DEVICE_RUNS = {
    "downpour": dict(rule=Downpour, worker_opt="sgd(lr=0.1, momentum=0.9)", master_opt="adam(lr=0.01)"),
    "easgd": dict(rule=lambda: EASGD(elastic_momentum=0.5), worker_opt="sgd(lr=0.1, momentum=0.9)"),
    "gem": dict(rule=GEM),
    "adag": dict(rule=ADAG, worker_opt="adam(lr=0.01)"),
    "dynsgd": dict(rule=DynSGD, worker_opt="sgd(lr=0.1, momentum=0.9)"),
}


@pytest.mark.parametrize("synchronous", [False, True], ids=["async", "sync"])
@pytest.mark.parametrize("name", list(DEVICE_RUNS))
def test_torch_tensors_through_staging_give_the_numpy_result(name, synchronous):
    """The path a GPU run takes (rules on torch tensors, messages and replies through the
    transport's staging), run on the CPU, against the numpy path: equal to 1e-6."""
    model = make_model()
    batches = [make_batches(6, 5, seed=20 + i) for i in range(3)]
    runs = []
    for tensors in (False, True):
        spec = dict(DEVICE_RUNS[name])
        rule = spec.pop("rule")
        sim = Simulation(rule(), model, 3, sync_every=2, synchronous=synchronous, tensors=tensors, **spec)
        sim.run(batches)
        runs.append(sim)
    host, device = runs
    assert isinstance(host.center, np.ndarray) and isinstance(device.center, torch.Tensor)
    assert all(isinstance(w.rule_params, torch.Tensor) for w in device.workers)
    assert np.abs(host.center - flat(model)).max() > 1e-3  # it trained
    assert_close(to_numpy(device.center), host.center, rtol=0, atol=1e-6)
    for on_device, on_host in zip(device.workers, host.workers, strict=True):
        assert_close(to_numpy(on_device.rule_params), on_host.params, rtol=0, atol=1e-6)
    assert device.stalenesses == host.stalenesses


def test_allreduce_sgd_on_torch_tensors_gives_the_numpy_result():
    x, y = make_batches(1, 9, seed=4)[0]
    results = []
    for tensors in (False, True):
        backend = Simulation._backend(make_model(), tensors)
        opt = backend.make_optimizer(parse_spec("sgd(lr=0.1, momentum=0.9)"))
        for _ in range(3):
            backend.compute_gradients(x, y)
            allreduce_sgd.apply(opt, backend.rule_grads)
        results.append(to_numpy(backend.rule_params).copy())
    assert_close(results[1], results[0], rtol=0, atol=1e-6)
    assert np.abs(results[0] - flat(make_model())).max() > 1e-3


@pytest.mark.parametrize("algo", [Downpour(), EASGD(), GEM(), ADAG(), DynSGD()], ids=lambda a: a.name)
def test_rule_state_on_torch_tensors_checkpoints_as_numpy(algo):
    like = torch.zeros(1)
    state = algo.new_worker_state(5, 3, like=like)
    arrays = [name for name in state.__dataclass_fields__ if isinstance(getattr(state, name), torch.Tensor)]
    assert arrays or algo.name == "easgd"  # EASGD's workers keep no arrays
    for name in arrays:
        getattr(state, name)[...] = torch.arange(5, dtype=torch.float32)
    saved = state.to_arrays()
    assert all(isinstance(v, np.ndarray) for v in saved.values())
    restored = algo.new_worker_state(5, 3, like=like)
    restored.load_arrays(saved)
    for name in arrays:
        assert torch.equal(getattr(restored, name), torch.arange(5, dtype=torch.float32))


# ----------------------------------------------------------------------------- rule state
def _scramble(state, rng):
    for name in state.__dataclass_fields__:
        value = getattr(state, name)
        if isinstance(value, np.ndarray):
            value[:] = rng.normal(size=value.shape)
        else:
            setattr(state, name, int(rng.integers(2, 50)))


@pytest.mark.parametrize("algo", [Downpour(), EASGD(), GEM(), ADAG(), DynSGD()], ids=lambda a: a.name)
def test_rule_state_round_trips(algo):
    rng = np.random.default_rng(0)
    for make in (lambda: algo.new_worker_state(5, 3), lambda: algo.new_master_state(5)):
        saved_state = make()
        _scramble(saved_state, rng)
        arrays = {k: v.copy() for k, v in saved_state.to_arrays().items()}
        restored = make()
        restored.load_arrays(arrays)
        assert type(restored) is type(saved_state)
        for name in saved_state.__dataclass_fields__:
            a, b = getattr(saved_state, name), getattr(restored, name)
            if isinstance(a, np.ndarray):
                assert b.dtype == np.float32
                np.testing.assert_array_equal(a, b)
            else:
                assert type(b) is type(a) and b == a


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
