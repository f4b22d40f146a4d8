"""The device path on a real device: the checks `bench/device_check.sh` runs on a GPU node.

Every test takes its device from NBDIST_TEST_DEVICE, or "cuda" where torch sees a GPU;
on a machine with neither they are skipped. `bench/device_check.sh --cpu-dry-run` (run by
the test command through tests/test_device_check.py) sets NBDIST_TEST_DEVICE=cpu, so the
same tests run there on CPU tensors through the same staging: the GPU path's code, minus
the GPU.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from conftest import ROOT, run_mpi
from mpi4py import MPI
from rule_simulation import Simulation, allreduce_sgd_steps, assert_close, device_runs, flat, make_batches, make_model
from torch import nn

from nbdist.algorithms.arrays import to_numpy
from nbdist.backends import DeviceRequest
from nbdist.backends.torch import TorchBackend
from nbdist.specs import parse_spec
from nbdist.transport.staging import DIRECT, PINNED, VIEW, Staging, mpi_is_cuda_aware

DEVICE_RUNS = device_runs()


def _device() -> str | None:
    asked = os.environ.get("NBDIST_TEST_DEVICE")
    if asked:
        return asked
    return "cuda" if torch.cuda.is_available() else None


DEVICE = _device()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        DEVICE is None,
        reason="no GPU here: bench/device_check.sh --cpu-dry-run runs these with NBDIST_TEST_DEVICE=cpu",
    ),
]


def placed(model: nn.Module, precision: str = "fp32") -> TorchBackend:
    backend = TorchBackend(model, precision=precision)
    backend.place(DeviceRequest(DEVICE or "cpu"))
    return backend


# ----------------------------------------------------------------------------- update rules
@pytest.mark.parametrize("synchronous", [False, True], ids=["async", "sync"])
@pytest.mark.parametrize("name", list(DEVICE_RUNS))
def test_every_rule_on_the_device_gives_the_numpy_result(name, synchronous):
    """Each rule with its optimisers, on the device's tensors, messages and replies through
    the staging, against the numpy path on the host: equal to 1e-6."""
    model = make_model()
    batches = [make_batches(6, 5, seed=20 + i) for i in range(3)]
    runs = []
    for tensors in (False, DEVICE):
        spec = dict(DEVICE_RUNS[name])
        rule = spec.pop("rule")
        sim = Simulation(rule(), model, 3, sync_every=2, synchronous=synchronous, tensors=tensors, **spec)
        sim.run(batches)
        runs.append(sim)
    host, device = runs
    assert all(w.rule_params.device.type == DEVICE for w in device.workers)
    assert np.abs(host.centre - flat(model)).max() > 1e-3  # it trained
    assert_close(to_numpy(device.centre), host.centre, rtol=0, atol=1e-6)
    for on_device, on_host in zip(device.workers, host.workers, strict=True):
        assert_close(to_numpy(on_device.rule_params), on_host.params, rtol=0, atol=1e-6)
    assert device.stalenesses == host.stalenesses


def test_allreduce_sgd_on_the_device_gives_the_numpy_result():
    results = [allreduce_sgd_steps(tensors) for tensors in (False, DEVICE)]
    assert_close(results[1], results[0], rtol=0, atol=1e-6)
    assert np.abs(results[0] - flat(make_model())).max() > 1e-3


# ----------------------------------------------------------------------------- staging through MPI
def _ways() -> list[str]:
    if DEVICE != "cuda":
        return [VIEW]
    return [PINNED, DIRECT] if mpi_is_cuda_aware() else [PINNED]


@pytest.mark.parametrize("way", _ways())
def test_a_workers_message_and_the_masters_reply_cross_mpi_through_the_staging(way):
    """A worker's flat device buffer goes to a host master's receive buffer through MPI,
    and the master's reply comes back into the device buffer, as the master/worker
    channels move them (the staging picks the way: pinned host copies, or the device
    memory itself where MPI is CUDA-aware)."""
    worker = placed(make_model())
    worker.rule_params[...] = torch.arange(worker.num_params, dtype=torch.float32, device=worker.device) / 7.0
    message = Staging(worker.rule_params, worker.copier, cuda_aware=(way == DIRECT))
    assert message.way == way
    comm = MPI.COMM_SELF
    on_master = np.empty(worker.num_params, np.float32)
    comm.Sendrecv(message.to_host(), dest=0, sendtag=1, recvbuf=on_master, source=0, recvtag=1)
    np.testing.assert_array_equal(on_master, to_numpy(worker.rule_params))

    reply = -2.0 * on_master
    comm.Sendrecv(reply, dest=0, sendtag=2, recvbuf=message.host, source=0, recvtag=2)
    message.to_device()
    np.testing.assert_array_equal(to_numpy(worker.rule_params), reply)
    assert worker.rule_params.device.type == DEVICE


# ----------------------------------------------------------------------------- precisions
def _digits_batch(n: int = 64) -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data[:n] / 16.0).astype(np.float32)
    return x, digits.target[:n].astype(np.int64)


def _mlp() -> nn.Module:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_gradients_follow_fp32s(precision):
    """The autocast step's gradient (unscaled, for fp16) points where fp32's does."""
    x, y = _digits_batch()
    reference = placed(_mlp())
    reference.compute_gradients(x, y)
    expected = to_numpy(reference.rule_grads).copy()
    reduced = placed(_mlp(), precision)
    reduced.compute_gradients(x, y)
    got = to_numpy(reduced.rule_grads)
    assert np.all(np.isfinite(got))
    cosine = float(got @ expected / (np.linalg.norm(got) * np.linalg.norm(expected)))
    assert cosine > 0.99, f"{precision}: cosine {cosine:.4f} with fp32's gradient"
    assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < 0.05


def test_fp16_loss_scale_backs_off_from_an_overflow_and_the_step_is_skipped():
    """An fp16 step whose scaled gradient overflows halves the scale, and the optimiser
    skips it (the weights stay); the next finite step is taken."""
    x, y = _digits_batch()
    backend = placed(_mlp(), "fp16")
    opt = backend.make_optimizer(parse_spec("sgd(lr=0.1)"))
    scale = backend.loss_scale.scale
    backend.compute_gradients(x * 1e4, y, scale=1e4)  # fp16 overflows: inf gradient
    assert not np.all(np.isfinite(to_numpy(backend.rule_grads)))
    before = to_numpy(backend.rule_params).copy()
    opt.step(backend.rule_grads)
    np.testing.assert_array_equal(to_numpy(backend.rule_params), before)
    backend.compute_gradients(x, y)  # settles the scale from the overflow first
    assert backend.loss_scale.scale == scale / 2
    assert np.all(np.isfinite(to_numpy(backend.rule_grads)))
    opt.step(backend.rule_grads)
    assert np.abs(to_numpy(backend.rule_params) - before).max() > 0


# ----------------------------------------------------------------------------- a resume onto the device
@pytest.mark.mpi
def test_a_host_checkpoint_resumes_onto_the_device(tmp_path):
    """A run trained off the device (numpy views on a CPU-only machine; CPU tensors on a
    GPU node) resumes with --device on the device and learns on from its checkpoint."""
    run_dir = tmp_path / "onto-device"
    first = run_mpi(
        1,
        [
            "-m",
            "nbdist",
            "train",
            "--model",
            str(ROOT / "examples" / "digits_mlp.py"),
            "--topology",
            "allreduce",
            "--runs-dir",
            str(tmp_path),
            "--run-name",
            run_dir.name,
            "--store",
            "off",
            "--quiet",
            "--epochs",
            "1",
            "--device",
            "cpu" if DEVICE == "cuda" else "auto",
        ],
    )
    assert first.returncode == 0, first.output
    before = json.loads((run_dir / "summary.json").read_text())["history"]
    second = run_mpi(
        1, ["-m", "nbdist", "train", "--resume", str(run_dir), "--epochs", "3", "--device", DEVICE, "--quiet"]
    )
    assert second.returncode == 0, second.output
    summary = json.loads((run_dir / "summary.json").read_text())
    history = summary["history"]
    assert [h["epoch"] for h in history] == [1, 2, 3]
    assert history[0] == before[0]  # epoch 1 was not trained again
    assert history[2]["train_loss"] < history[0]["train_loss"] / 2
    assert summary["final"]["val_acc"] > 0.85, summary["final"]
    assert json.loads((run_dir / "options.json").read_text())["device"] == DEVICE
