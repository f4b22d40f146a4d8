"""TorchBackend: flat views, gradients, BatchNorm state, bucket hooks, evaluation, optimisers."""

from __future__ import annotations

import copy
from itertools import pairwise

import numpy as np
import pytest
import torch
from torch import nn

from nbdist.backends import backend_for
from nbdist.backends.base import ModelError
from nbdist.backends.torch import TorchBackend
from nbdist.specs import Spec, SpecError, parse_spec

F32 = np.float32


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 3)
    )


def data(n: int = 9, seed: int = 0, features: int = 5):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, features)).astype(F32), rng.integers(0, 3, size=n)


def reversed_flat(tensors) -> np.ndarray:
    return torch.cat([t.detach().reshape(-1) for t in reversed(list(tensors))]).numpy().copy()


def buffer_range(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


# ----------------------------------------------------------------------------- views
def test_params_and_grads_are_views_of_the_model():
    model = mlp()
    reference = copy.deepcopy(model)
    backend = TorchBackend(model)
    n = sum(p.numel() for p in reference.parameters())
    assert backend.params.shape == (n,) and backend.params.dtype == np.float32
    assert backend.num_params == n
    np.testing.assert_array_equal(backend.params, reversed_flat(reference.parameters()))

    x, _ = data()
    before = model(torch.from_numpy(x)).detach().clone()
    backend.params[:] = 0.0
    after = model(torch.from_numpy(x)).detach()
    assert not torch.equal(before, after)
    assert torch.count_nonzero(after) == 0  # every weight and bias was zeroed through the view
    for p in model.parameters():
        assert torch.count_nonzero(p) == 0

    with torch.no_grad():
        model[0].bias.fill_(3.5)
    assert (backend.params == 3.5).sum() == 7
    lo, hi = backend._slices[-2]  # registered second (0.bias), laid out second to last
    np.testing.assert_array_equal(backend.params[hi - 7 : hi], 3.5)


def test_every_grad_lives_inside_the_flat_buffer():
    model = mlp()
    backend = TorchBackend(model)
    x, y = data()
    backend.compute_gradients(x, y)
    p_lo, p_hi = buffer_range(torch.from_numpy(backend.params))
    g_lo, g_hi = buffer_range(torch.from_numpy(backend.grads))
    grad_ranges, param_ranges = [], []
    for p in model.parameters():
        assert p.grad is not None
        glo, ghi = buffer_range(p.grad)
        plo, phi = buffer_range(p)
        assert g_lo <= glo and ghi <= g_hi
        assert p_lo <= plo and phi <= p_hi
        grad_ranges.append((glo, ghi))
        param_ranges.append((plo, phi))
    # Disjoint and together exactly the whole buffer.
    for ranges, (lo, hi) in ((grad_ranges, (g_lo, g_hi)), (param_ranges, (p_lo, p_hi))):
        ranges.sort()
        assert ranges[0][0] == lo and ranges[-1][1] == hi
        assert all(a[1] == b[0] for a, b in pairwise(ranges))
    # Flat gradient and per-parameter .grad are the same numbers.
    np.testing.assert_array_equal(backend.grads, reversed_flat(p.grad for p in model.parameters()))


def test_gradient_matches_autograd_and_scale_scales():
    model = mlp()
    reference = copy.deepcopy(model)
    backend = TorchBackend(model)
    x, y = data(11)
    stats = backend.compute_gradients(x, y)
    loss = nn.CrossEntropyLoss()(reference(torch.from_numpy(x)), torch.from_numpy(y))
    loss.backward()
    expected = reversed_flat(p.grad for p in reference.parameters())
    np.testing.assert_allclose(backend.grads, expected, rtol=1e-6, atol=1e-8)
    assert np.abs(expected).max() > 0
    assert stats.n == 11
    assert stats.loss_sum == pytest.approx(loss.item() * 11, rel=1e-6)
    out = reference(torch.from_numpy(x))
    assert stats.metric_sum == int((out.argmax(1) == torch.from_numpy(y)).sum())

    # Gradients are overwritten, not accumulated, and `scale` multiplies them.
    backend.compute_gradients(x, y, scale=0.25)
    np.testing.assert_allclose(backend.grads, 0.25 * expected, rtol=1e-6, atol=1e-9)
    backend.compute_gradients(x, y)
    np.testing.assert_allclose(backend.grads, expected, rtol=1e-6, atol=1e-8)


def test_batchnorm_statistics_live_in_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 3))
    backend = TorchBackend(model)
    bn = model[1]
    assert backend.state.size == 8  # running_mean + running_var (num_batches_tracked is an int)
    assert backend.state.dtype == np.float32
    initial = backend.state.copy()
    np.testing.assert_array_equal(np.sort(initial), np.array([0.0] * 4 + [1.0] * 4, F32))
    x, y = data(16)
    backend.compute_gradients(x, y)
    assert not np.array_equal(backend.state, initial)
    state = backend.state.copy()
    values = np.concatenate([bn.running_mean.numpy(), bn.running_var.numpy()])
    np.testing.assert_array_equal(np.sort(state), np.sort(values))
    # Writing the state writes the module's buffers (the master averages workers' states).
    backend.state[:] = 2.0
    assert torch.all(bn.running_mean == 2.0) and torch.all(bn.running_var == 2.0)
    backend.state[:] = state
    # Evaluation uses, and does not change, the running statistics.
    backend.evaluate(x, y)
    np.testing.assert_array_equal(backend.state, state)
    assert model.training


def test_synchronised_batchnorm_keeps_the_flat_buffers_and_on_one_rank_is_batchnorm():
    """--sync-batchnorm's conversion keeps the layers' parameters and statistics (views of
    the flat buffers, the same state_dict names); reducing over MPI's COMM_SELF it trains
    as plain BatchNorm does (the 4-rank equivalence: tests/test_equivalence_mpi.py)."""
    from mpi4py import MPI

    from nbdist.transport.batch_sums import SumOverRanks
    from nbdist.transport.collectives import Collectives

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 3))
    plain = TorchBackend(copy.deepcopy(model))
    backend = TorchBackend(model)
    names, state_at = list(backend.model.state_dict()), backend.state.ctypes.data
    assert backend.convert_batchnorm() == 1
    assert type(backend.model[1]).__name__ == "SyncBatchNorm"
    assert list(backend.model.state_dict()) == names
    assert backend.model[1].running_mean.data_ptr() in range(state_at, state_at + backend.state.nbytes)
    backend.reduce_batchnorm_over(SumOverRanks(MPI.COMM_SELF, Collectives(lambda: 30.0)))
    x, y = data(16)
    for _ in range(2):
        assert backend.compute_gradients(x, y).loss_sum == pytest.approx(plain.compute_gradients(x, y).loss_sum)
        np.testing.assert_allclose(backend.grads, plain.grads, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(backend.state, plain.state, rtol=1e-6, atol=1e-7)
    assert backend.evaluate(x, y).loss_sum == pytest.approx(plain.evaluate(x, y).loss_sum)


# ----------------------------------------------------------------------------- buckets
def test_bucket_hooks_fire_once_with_final_gradients():
    model = mlp()
    backend = TorchBackend(model)
    n = backend.num_params
    fired: list[int] = []
    snapshots: dict[int, np.ndarray] = {}
    buckets: list[tuple[int, int]] = []

    def on_ready(i: int) -> None:
        fired.append(i)
        lo, hi = buckets[i]
        snapshots[i] = backend.grads[lo:hi].copy()

    buckets.extend(backend.bucket_hooks(30, on_ready))
    assert len(buckets) >= 3
    assert buckets[0][0] == 0 and buckets[-1][1] == n
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in pairwise(buckets))
    # Buckets end at parameter boundaries.
    ends = {hi for _, hi in backend._slices}
    assert all(hi in ends for _, hi in buckets)

    for seed in (1, 2):
        fired.clear()
        snapshots.clear()
        x, y = data(8, seed)
        backend.compute_gradients(x, y)
        assert sorted(fired) == list(range(len(buckets)))  # each exactly once
        assert fired == sorted(fired)  # in backward order: the last layers' bucket first
        for i, (lo, hi) in enumerate(buckets):
            np.testing.assert_array_equal(snapshots[i], backend.grads[lo:hi])
        assert any(np.abs(s).max() > 0 for s in snapshots.values())

    with pytest.raises(RuntimeError, match="already installed"):
        backend.bucket_hooks(30, on_ready)


def test_bucket_of_an_unused_parameter_still_fires():
    class Partly(nn.Module):
        def __init__(self):
            super().__init__()
            self.unused = nn.Linear(5, 50)
            self.a = nn.Linear(5, 6)
            self.b = nn.Linear(6, 3)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(0)
    backend = TorchBackend(Partly())
    fired: list[int] = []
    buckets = backend.bucket_hooks(20, fired.append)
    x, y = data(4)
    for _ in range(2):
        fired.clear()
        backend.compute_gradients(x, y)
        assert sorted(fired) == list(range(len(buckets)))
    lo, hi = backend._slices[-2]  # unused.weight (registered first, laid out last)
    assert not backend.grads[lo:].any()


def test_one_big_bucket_when_cap_exceeds_the_model():
    backend = TorchBackend(mlp())
    fired: list[int] = []
    assert backend.bucket_hooks(10**9, fired.append) == [(0, backend.num_params)]
    backend.compute_gradients(*data())
    assert fired == [0]


# ----------------------------------------------------------------------------- evaluate
def test_evaluate_sums_loss_and_correct_predictions():
    model = mlp()
    backend = TorchBackend(model)
    x, y = data(10, seed=3)
    stats = backend.evaluate(x, y, batch_size=4)  # three chunks: 4, 4, 2
    with torch.no_grad():
        out = model(torch.from_numpy(x))
        losses = nn.CrossEntropyLoss(reduction="none")(out, torch.from_numpy(y))
        correct = int((out.argmax(1) == torch.from_numpy(y)).sum())
    assert stats.n == 10
    assert stats.loss_sum == pytest.approx(float(losses.sum()), rel=1e-6)
    assert stats.metric_sum == correct
    assert stats.loss == pytest.approx(float(losses.mean()), rel=1e-6)
    assert backend.metric_name == "acc"


def test_binary_accuracy_and_custom_metric():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    backend = TorchBackend(
        model, loss=lambda out, y: nn.functional.binary_cross_entropy_with_logits(out.reshape(-1), y)
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 3)).astype(F32)
    y = (rng.random(12) > 0.5).astype(F32)
    stats = backend.evaluate(x, y)
    with torch.no_grad():
        predicted = (model(torch.from_numpy(x)).reshape(-1) > 0).float()
    assert stats.metric_sum == int((predicted == torch.from_numpy(y)).sum())

    def mae(out, y):
        return (out.reshape(-1) - y).abs().mean()

    b2 = TorchBackend(copy.deepcopy(model), loss=lambda o, t: ((o.reshape(-1) - t) ** 2).mean(), metric=mae)
    assert b2.metric_name == "mae"
    s2 = b2.evaluate(x, y, batch_size=5)
    with torch.no_grad():
        expected = float((model(torch.from_numpy(x)).reshape(-1) - torch.from_numpy(y)).abs().sum())
    assert s2.metric_sum == pytest.approx(expected, rel=1e-5)


# ----------------------------------------------------------------------------- optimisers
def test_unknown_optimizer_lists_choices():
    backend = TorchBackend(mlp())
    with pytest.raises(SpecError) as err:
        backend.make_optimizer(Spec("rmsprob"))
    text = str(err.value)
    assert "did you mean 'rmsprop'" in text
    for name in ("sgd", "adam", "adamw", "rmsprop"):
        assert name in text
    assert "lbfgs" not in text  # needs a closure: cannot step a flat buffer


def test_optimizer_bad_kwarg_and_bad_value_are_clear():
    backend = TorchBackend(mlp())
    with pytest.raises(SpecError) as err:
        backend.make_optimizer(parse_spec("sgd(lr=0.1, momentun=0.9)"))
    assert "momentun" in str(err.value) and "momentum" in str(err.value).split("takes:")[1]
    with pytest.raises(SpecError, match=r"sgd\(lr=-1\).*[Ii]nvalid learning rate"):
        backend.make_optimizer(parse_spec("sgd(lr=-1)"))
    with pytest.raises(SpecError, match="adam"):
        backend.make_optimizer(parse_spec("adam(lr=0.1, betas=(1.5, 0.9))"))


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            "sgd(lr=-1.0)",
            "optimizer sgd(lr=-1.0): a learning rate below 0 climbs the loss instead of descending it",
        ),
        ("sgd(lr='fast')", "optimizer sgd(lr='fast'): lr must be a number, got 'fast'"),
        ("adam(betas=(1.5, 0.9))", "optimizer adam(betas=(1.5, 0.9)): Invalid beta parameter at index 0: 1.5"),
        ("adam(amsgrad='yes')", "optimizer adam(amsgrad='yes'): amsgrad must be True or False, got 'yes'"),
        # torch takes alpha=2, and its first step is a square root of a negative number.
        ("rmsprop(alpha=2)", "optimizer rmsprop(alpha=2): one step from zero weights with a unit gradient gives nan"),
    ],
)
def test_check_optimizer_builds_and_steps_it_on_a_scratch_buffer(spec, message):
    backend = TorchBackend(mlp())
    before = backend.params.copy()
    with pytest.raises(SpecError) as err:
        backend.check_optimizer(parse_spec(spec))
    assert str(err.value).startswith(message)
    backend.check_optimizer(parse_spec("adam(lr=0.01, betas=(0.8, 0.99))"))
    np.testing.assert_array_equal(backend.params, before)  # the model's weights were not stepped


def test_flat_optimizer_matches_per_parameter_optimizer():
    model = mlp()
    reference = copy.deepcopy(model)
    backend = TorchBackend(model)
    opt = backend.make_optimizer(parse_spec("adamw(lr=0.01, weight_decay=0.1)"))
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.01, weight_decay=0.1, foreach=False)
    for seed in range(4):
        x, y = data(6, seed)
        backend.compute_gradients(x, y)
        opt.step(backend.grads)
        ref_opt.zero_grad()
        nn.CrossEntropyLoss()(reference(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        ref_opt.step()
    np.testing.assert_allclose(backend.params, reversed_flat(reference.parameters()), rtol=1e-6, atol=1e-7)
    # The model's .grad views survive the optimizer steps.
    g_lo, g_hi = buffer_range(torch.from_numpy(backend.grads))
    for p in model.parameters():
        assert g_lo <= p.grad.data_ptr() < g_hi


@pytest.mark.parametrize("device", ["host path", "cpu"])
def test_optimizer_state_arrays_are_copies_that_the_next_step_leaves_alone(device):
    """A checkpoint keeps the optimiser state it took while training goes on (it copies the
    model's buffers, not these: FlatOptimizer.state_arrays returns arrays of their own)."""
    from nbdist.backends.base import DeviceRequest

    backend = TorchBackend(mlp())
    if device == "cpu":
        backend.place(DeviceRequest("cpu"))  # the device path's tensors, on the CPU
    opt = backend.make_optimizer(parse_spec("adam(lr=0.01)"))
    x, y = data(6, 0)
    backend.compute_gradients(x, y)
    opt.step(backend.grads)
    taken = opt.state_arrays()
    before = {k: v.copy() for k, v in taken.items()}
    backend.compute_gradients(x, y)
    opt.step(backend.grads)
    after = opt.state_arrays()
    for key, value in taken.items():
        np.testing.assert_array_equal(value, before[key])
    assert any(not np.array_equal(after[k], before[k]) for k in before)  # the state did move on


@pytest.mark.parametrize("spec", ["adam(lr=0.01)", "sgd(lr=0.05, momentum=0.9)"])
def test_optimizer_state_round_trip_resumes_exactly(spec):
    model = mlp()
    resumed_model = copy.deepcopy(model)
    fresh_model = copy.deepcopy(model)
    batches = [data(6, seed) for seed in range(6)]

    a = TorchBackend(model)
    opt_a = a.make_optimizer(parse_spec(spec))
    for x, y in batches[:3]:
        a.compute_gradients(x, y)
        opt_a.step(a.grads)
    saved_params = a.params.copy()
    saved_state = {k: v.copy() for k, v in opt_a.state_arrays().items()}
    assert saved_state  # Adam: step, exp_avg, exp_avg_sq; SGD: momentum_buffer
    for x, y in batches[3:]:
        a.compute_gradients(x, y)
        opt_a.step(a.grads)

    b = TorchBackend(resumed_model)
    b.params[:] = saved_params
    opt_b = b.make_optimizer(parse_spec(spec))
    opt_b.load_state_arrays(saved_state)
    for x, y in batches[3:]:
        b.compute_gradients(x, y)
        opt_b.step(b.grads)
    np.testing.assert_array_equal(b.params, a.params)
    for k, v in opt_a.state_arrays().items():
        np.testing.assert_array_equal(opt_b.state_arrays()[k], v)

    # Without the state, resuming gives a different trajectory: the state matters.
    c = TorchBackend(fresh_model)
    c.params[:] = saved_params
    opt_c = c.make_optimizer(parse_spec(spec))
    for x, y in batches[3:]:
        c.compute_gradients(x, y)
        opt_c.step(c.grads)
    assert np.abs(c.params - a.params).max() > 1e-6


def test_named_arrays_and_rng_state():
    model = mlp()
    backend = TorchBackend(model)
    named = backend.named_arrays()
    assert set(named) == set(model.state_dict())
    backend.params[:] = 1.0
    assert named["0.weight"].max() != 1.0  # a copy, not a view
    rng = backend.rng_state()
    first = torch.rand(3)
    backend.set_rng_state(rng)
    assert torch.equal(torch.rand(3), first)


# ----------------------------------------------------------------------------- errors
def test_models_that_cannot_be_trained():
    with pytest.raises(ModelError, match="no trainable parameters"):
        TorchBackend(nn.ReLU())
    frozen = nn.Linear(3, 2)
    frozen.requires_grad_(False)
    with pytest.raises(ModelError, match="no trainable parameters"):
        TorchBackend(frozen)
    with pytest.raises(ModelError, match="torch.nn.Module"):
        TorchBackend(lambda x: x)  # type: ignore[arg-type]
    with pytest.raises(ModelError, match="metric"):
        TorchBackend(nn.Linear(3, 2), metric="f1")
    with pytest.raises(ModelError, match="nbdist trains torch.nn.Module"):
        backend_for(object())
    assert isinstance(backend_for(nn.Linear(2, 2)), TorchBackend)


# ----------------------------------------------------------------------------- precision
def digits_run(model: str, precision: str, runs_dir) -> dict:
    """Three epochs of digits on one allreduce rank (its gradient goes through the bucket
    hooks) in `precision`; the last epoch's metrics."""
    from mpi4py import MPI

    import nbdist

    root = __import__("pathlib").Path(__file__).resolve().parent.parent
    result = nbdist.train(
        root / "examples" / model,
        comm=MPI.COMM_SELF,
        topology="allreduce",
        epochs=3,
        precision=precision,
        runs_dir=str(runs_dir),
        store="off",
        quiet=True,
    )
    return result.history[-1]


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_digits_learns_in_each_precision(precision, tmp_path):
    assert digits_run("digits_mlp.py", precision, tmp_path)["val_acc"] >= 0.85


def overflowing_fp16(scale: float) -> tuple[TorchBackend, object]:
    backend = TorchBackend(mlp(), precision="fp16")
    backend.loss_scale.scale = scale
    return backend, backend.make_optimizer(parse_spec("sgd(lr=0.1, momentum=0.9)"))


def test_fp16_autocasts_and_skips_an_overflowed_step_then_recovers():
    x, y = data(n=32)
    # 2**40 times the loss overflows fp16's range (65504) in the backward pass.
    backend, opt = overflowing_fp16(2.0**40)
    outputs = []
    backend.model.register_forward_hook(lambda _m, _i, out: outputs.append(out.dtype))
    before = backend.params.copy()
    backend.compute_gradients(x, y)
    assert outputs == [torch.float16]  # the forward pass ran in fp16
    assert not np.isfinite(backend.grads).all()
    opt.step(backend.grads)
    assert opt.skipped == 1
    np.testing.assert_array_equal(backend.params, before)  # skipped: weights and momentum untouched
    # Each overflow halves the scale at the next backward, until the gradient fits.
    steps = 0
    while not np.isfinite(backend.grads).all():
        backend.compute_gradients(x, y)
        opt.step(backend.grads)
        steps += 1
    assert 1 <= steps < 40 and backend.loss_scale.scale < 2.0**40 and opt.skipped == steps
    assert not np.array_equal(backend.params, before)
    # Unscaled: the same gradient as fp32 autocast-free up to fp16 rounding.
    reference = TorchBackend(copy.deepcopy(backend.model))
    backend.compute_gradients(x, y)
    reference.compute_gradients(x, y)
    np.testing.assert_allclose(backend.grads, reference.grads, atol=2e-2)


def test_fp16_resumes_exactly_with_the_loss_scale(tmp_path):
    """A checkpoint right after an overflow holds the halved scale: resuming from it takes
    the same steps as not stopping."""
    from nbdist.train.checkpoint import Checkpoints

    x, y = data(n=32)
    a, opt_a = overflowing_fp16(2.0**22)
    twin = copy.deepcopy(a.model)

    def steps(backend, opt, n):
        for _ in range(n):
            backend.compute_gradients(x, y)
            opt.step(backend.grads)

    steps(a, opt_a, 3)
    assert opt_a.skipped == 3 and not np.isfinite(a.grads).all()  # the scale halves at the next backward
    ckpt = Checkpoints(tmp_path)
    ckpt.write_rank(
        "epoch-0001",
        0,
        {"model": {"params": a.params, "state": a.state}, "opt": opt_a.state_arrays(), "rng": a.rng_state()},
        {},
    )
    ckpt.commit("epoch-0001", {})
    steps(a, opt_a, 20)
    arrays, _ = Checkpoints.read_rank(ckpt.latest(), 0)
    b = TorchBackend(twin, precision="fp16")
    b.params[:] = arrays["model"]["params"]
    opt_b = b.make_optimizer(parse_spec("sgd(lr=0.1, momentum=0.9)"))
    opt_b.load_state_arrays(arrays.get("opt", {}))
    b.set_rng_state(arrays["rng"])
    assert b.loss_scale.scale == 2.0**19  # 2**22 halved by each of the three overflows
    steps(b, opt_b, 20)
    np.testing.assert_array_equal(b.params, a.params)
    assert (b.loss_scale.scale, b.loss_scale.good_steps) == (a.loss_scale.scale, a.loss_scale.good_steps)
