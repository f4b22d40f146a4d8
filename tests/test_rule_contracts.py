"""What every master/worker update rule must do, whatever its maths: the contract tests,
parametrised over the rules registered on nbdist.algorithms.RULES when they are collected
(rule_simulation.master_worker_rules). A rule's class attributes say which contracts
apply beyond those every rule keeps (`one_worker_is_plain_training`), and with what
parameters it is built (`example_parameters`). The rules' own maths, against their
sources, is tested in test_algorithms.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from rule_simulation import (
    C0,
    F32,
    PAYLOADS,
    Simulation,
    assert_close,
    build,
    flat,
    make_batches,
    make_model,
    master_round,
    master_worker_rules,
    optimizers,
    reference_run,
    scramble,
)

from nbdist.algorithms import RULES, Update, make_algorithm
from nbdist.algorithms.arrays import to_numpy
from nbdist.backends.torch import TorchFlatOptimizer
from nbdist.specs import Spec, parse_spec

EVERY_RULE = master_worker_rules()


# ----------------------------------------------------------------------------- what a rule says of itself
@pytest.mark.parametrize("rule", EVERY_RULE)
def test_the_rule_is_built_by_name_and_describes_itself(rule):
    """--algorithm NAME(...) builds it; the help and the docs reference have a summary and
    a help line for every parameter, and the defaults build a working rule."""
    assert RULES.summary(rule.name), f"{rule.name}: give the class a docstring (its first paragraph is the summary)"
    for parameter in RULES.parameters(rule.name):
        assert parameter.help, f"{rule.name}: parameter_help has no line for {parameter.name}"
    assert isinstance(make_algorithm(Spec(rule.name, dict(rule.example_parameters))), rule)
    assert isinstance(make_algorithm(Spec(rule.name)), rule)


# ----------------------------------------------------------------------------- training
@pytest.mark.parametrize("synchronous", [False, True], ids=["async", "sync"])
@pytest.mark.parametrize("opt", ["sgd(lr=0.1, momentum=0.9)", "adam(lr=0.01)"])
@pytest.mark.parametrize("rule", master_worker_rules(lambda rule: rule.one_worker_is_plain_training))
def test_one_worker_is_plain_training(rule, opt, synchronous):
    """One worker that syncs after every batch trains as one process with the rule's
    optimiser would (the master's where it has one, else the worker's)."""
    model = make_model()
    batches = make_batches(12, 7, seed=1)
    sim = Simulation(build(rule), model, 1, worker_opt=opt, master_opt=opt, sync_every=1, synchronous=synchronous)
    start = sim.centre.copy()
    sim.run([batches])
    expected = reference_run(model, opt, batches)
    assert not np.allclose(start, expected, rtol=1e-3)  # it did train
    assert_close(sim.centre, expected)
    np.testing.assert_array_equal(sim.workers[0].params, sim.centre)
    assert sim.stalenesses == [0] * 12


@pytest.mark.parametrize("rule", EVERY_RULE)
def test_a_synchronous_round_of_equal_updates_moves_the_centre_as_one(rule):
    """--synchronous does not multiply the step by the number of workers: a round of W
    identical updates moves the centre exactly as one of them does."""

    def move(count):
        algo = build(rule)
        algo.bind(count)
        payload = (C0 + PAYLOADS[0]) if rule.message_is_weights else PAYLOADS[0]
        spec = "sgd(lr=0.1)" if rule.uses_master_optimizer else None
        centre, _ = master_round(algo, [payload] * count, [8] * count, [0] * count, spec)
        return centre - C0

    assert np.abs(move(1)).max() > 1e-4  # it moved
    assert_close(move(4), move(1), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("tensors", [False, True], ids=["numpy", "torch-worker"])
@pytest.mark.parametrize("rule", EVERY_RULE)
def test_a_streamed_synchronous_round_gives_master_apply_bit_for_bit(rule, tensors):
    """master_round, drawing one payload at a time (each clobbered once the next is drawn,
    as the master's pooled buffers are), then worker_round_reply on each worker's weights
    (torch tensors too), against master_apply and worker_reply on the whole round: the
    same centre, velocity and worker weights, bit for bit, over two rounds with uneven
    samples (and a round of one)."""
    rng = np.random.default_rng(3)
    results = []
    for streamed in (False, True):
        algo = build(rule)
        algo.bind(3)
        centre = rng.normal(size=64).astype(F32) if not results else results[0][2].copy()
        start = centre.copy()
        state = algo.new_master_state(centre.size)
        opt = TorchFlatOptimizer(torch.optim.SGD, parse_spec("sgd(lr=0.1, momentum=0.9)"), centre)
        inputs = np.random.default_rng(7)
        workers = [(start + inputs.normal(size=64).astype(F32)) for _ in range(3)]
        params = [torch.from_numpy(x) if tensors else x for x in workers]  # views: the same weights
        worker_states = [algo.new_worker_state(64, 1, like=p) for p in params]
        for samples in ([5, 7, 12], [9]):
            sent = [
                inputs.normal(size=64).astype(F32) if not algo.carries_local_steps else x.copy()
                for x in workers[: len(samples)]
            ]
            if streamed:

                def draw(sent, samples):
                    buffer = np.empty(64, F32)
                    for payload, n in zip(sent, samples, strict=True):
                        buffer[...] = payload
                        yield Update(buffer, 0, n)
                        buffer[...] = np.nan  # the pool's next body

                reply = algo.master_round(state, centre, draw(sent, samples), samples, opt, np.empty(64, F32))
                for p, ws in zip(params[: len(samples)], worker_states[: len(samples)], strict=True):
                    algo.worker_round_reply(ws, p, torch.from_numpy(reply.copy()) if tensors else reply.copy())
            else:
                round_ = [Update(p.copy(), 0, n) for p, n in zip(sent, samples, strict=True)]
                replies = algo.master_apply(state, centre, round_, opt)
                for p, ws, r in zip(params[: len(samples)], worker_states[: len(samples)], replies, strict=True):
                    algo.worker_reply(ws, p, torch.from_numpy(r.copy()) if tensors else r.copy())
        results.append((centre, [to_numpy(v) for v in state.to_arrays().values()], start, workers))
    (centre, velocity, _, workers), (centre2, velocity2, _, workers2) = results
    np.testing.assert_array_equal(centre2, centre)
    assert np.abs(centre - results[0][2]).max() > 1e-3  # it moved
    for a, b in zip(velocity, velocity2, strict=True):
        np.testing.assert_array_equal(b, a)
    for a, b in zip(workers, workers2, strict=True):
        np.testing.assert_array_equal(b, a)


# ----------------------------------------------------------------------------- the device path
@pytest.mark.parametrize("synchronous", [False, True], ids=["async", "sync"])
@pytest.mark.parametrize("rule", EVERY_RULE)
def test_torch_tensors_through_staging_give_the_numpy_result(rule, synchronous):
    """The path a GPU run takes (the rule on torch tensors, messages and replies through
    the transport's staging), run on the CPU, against the numpy path: equal to 1e-6, with
    windows of 2 so that local steps count too."""
    model = make_model()
    batches = [make_batches(6, 5, seed=20 + i) for i in range(3)]
    runs = []
    for tensors in (False, True):
        sim = Simulation(
            build(rule), model, 3, sync_every=2, synchronous=synchronous, tensors=tensors, **optimizers(rule)
        )
        sim.run(batches)
        runs.append(sim)
    host, device = runs
    assert isinstance(host.centre, np.ndarray) and isinstance(device.centre, torch.Tensor)
    assert all(isinstance(w.rule_params, torch.Tensor) for w in device.workers)
    assert np.abs(host.centre - flat(model)).max() > 1e-3  # it trained
    assert_close(to_numpy(device.centre), host.centre, rtol=0, atol=1e-6)
    for on_device, on_host in zip(device.workers, host.workers, strict=True):
        assert_close(to_numpy(on_device.rule_params), on_host.params, rtol=0, atol=1e-6)
    assert device.stalenesses == host.stalenesses


# ----------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("rule", EVERY_RULE)
def test_rule_state_on_torch_tensors_checkpoints_as_numpy(rule):
    algo = build(rule)
    like = torch.zeros(1)
    state = algo.new_worker_state(5, 3, like=like)
    arrays = [name for name in state.__dataclass_fields__ if isinstance(getattr(state, name), torch.Tensor)]
    for name in arrays:
        getattr(state, name)[...] = torch.arange(5, dtype=torch.float32)
    saved = state.to_arrays()
    assert all(isinstance(v, np.ndarray) for v in saved.values())
    restored = algo.new_worker_state(5, 3, like=like)
    restored.load_arrays(saved)
    for name in arrays:
        assert torch.equal(getattr(restored, name), torch.arange(5, dtype=torch.float32))


@pytest.mark.parametrize("rule", EVERY_RULE)
def test_rule_state_round_trips(rule):
    """A worker's and a master's state, saved as arrays and loaded into a fresh one, are
    the same: values, dtypes, counters."""
    algo = build(rule)
    rng = np.random.default_rng(0)
    for make in (lambda: algo.new_worker_state(5, 3), lambda: algo.new_master_state(5)):
        saved_state = make()
        scramble(saved_state, rng)
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
