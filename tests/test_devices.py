"""--device: where a PyTorch model's flat buffers live, how a rank finds its GPU, and the
transport's staging of those buffers on the host (the GPU ways need a GPU: bench/gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI
from torch import nn

from nbdist.backends import DeviceRequest, ModelError, backend_for
from nbdist.transport.node import local_rank
from nbdist.transport.staging import Staging

NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.Linear(5, 2))


def shares_memory(array: np.ndarray, tensor: torch.Tensor) -> bool:
    return array.__array_interface__["data"][0] == tensor.data_ptr()


def test_device_cpu_gives_tensors_over_the_models_own_memory():
    model = make_model()
    weights = [p.detach().clone() for p in model.parameters()]
    backend = backend_for(model, device=DeviceRequest("cpu"))
    assert isinstance(backend.rule_params, torch.Tensor) and isinstance(backend.rule_grads, torch.Tensor)
    # The numpy views (checkpoints, the host side of MPI) are the same memory as the tensors.
    assert shares_memory(backend.params, backend.rule_params) and shares_memory(backend.grads, backend.rule_grads)
    assert [torch.equal(p, w) for p, w in zip(model.parameters(), weights)] == [True] * len(weights)
    assert backend.state.size == 10  # BatchNorm's running mean and variance, flattened too
    backend.rule_params[...] = 0.5
    assert all(bool((p == 0.5).all()) for p in model.parameters())
    x, y = np.ones((3, 4), np.float32), np.array([0, 1, 0])
    backend.compute_gradients(x, y)
    assert np.array_equal(backend.grads, backend.rule_grads.numpy()) and np.abs(backend.grads).sum() > 0


def test_device_auto_is_the_numpy_host_path():
    backend = backend_for(make_model(), device=DeviceRequest("auto", local_rank=3))
    assert isinstance(backend.rule_params, np.ndarray) and backend.rule_params is backend.params
    assert backend.copier is None


@NO_GPU
def test_device_cuda_without_a_gpu_is_one_clear_error():
    with pytest.raises(ModelError, match=r"--device cuda: torch sees no GPU on .*use --device auto or cpu"):
        backend_for(make_model(), device=DeviceRequest("cuda"))


def test_local_rank_from_the_launcher_or_from_mpi(monkeypatch):
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "3")
    assert local_rank(MPI.COMM_SELF) == 3
    monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_RANK")
    monkeypatch.setenv("SLURM_LOCALID", "2")
    assert local_rank(MPI.COMM_SELF) == 2
    monkeypatch.delenv("SLURM_LOCALID")
    assert local_rank(MPI.COMM_SELF) == 0  # MPI's shared-memory split: alone on its node


def test_staging_on_the_host_is_zero_copy_both_ways():
    tensor = torch.arange(6, dtype=torch.float32)
    staging = Staging(tensor)
    assert staging.way == "view" and shares_memory(staging.to_host(2, 4), tensor[2:])
    message = np.zeros(6, np.float32)
    outbound = Staging.of_host(message, like=tensor)
    outbound.device[...] = tensor  # what a rule writes lands in the message buffer
    assert isinstance(outbound.device, torch.Tensor) and np.array_equal(outbound.to_host(), tensor.numpy())
    assert Staging.of_host(message, like=message).device is not None
