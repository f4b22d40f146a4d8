"""--device: where a PyTorch model's flat buffers live, how a rank finds its GPU, and the
transport's staging of those buffers on the host (the GPU ways need a GPU: bench/gpu.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from mpi4py import MPI
from torch import nn

from nbdist.backends import DeviceRequest, ModelError, backend_for
from nbdist.transport.collectives import Collectives
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
    # No numpy views on the device path: every host read goes through the staging.
    for flat in (backend.params, backend.grads, backend.state, backend.rule_params, backend.rule_grads):
        assert isinstance(flat, torch.Tensor)
    assert backend.rule_params is backend.params and backend.num_params == 47
    assert [torch.equal(p, w) for p, w in zip(model.parameters(), weights, strict=True)] == [True] * len(weights)
    assert len(backend.state) == 10  # BatchNorm's running mean and variance, flattened too
    backend.rule_params[...] = 0.5
    assert all(bool((p == 0.5).all()) for p in model.parameters())
    x, y = np.ones((3, 4), np.float32), np.array([0, 1, 0])
    backend.compute_gradients(x, y)
    assert float(backend.grads.abs().sum()) > 0
    staged = Staging(backend.grads)
    assert staged.way == "view" and shares_memory(staged.to_host(), backend.grads)
    # MPI is never handed a device buffer as if it were host memory.
    collectives = Collectives(timeout=lambda: 5.0)
    with pytest.raises(TypeError, match="MPI is given host memory: a Tensor goes through transport.staging"):
        collectives.allreduce(MPI.COMM_SELF, backend.grads, "a test")
    collectives.allreduce(MPI.COMM_SELF, staged, "a test")


@NO_GPU
def test_device_auto_without_a_gpu_is_the_numpy_host_path():
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


def test_a_device_array_without_a_copier_is_refused_with_one_message():
    """Off the host, staging copies through a pinned buffer, which only the backend's
    copier makes: without one, one ValueError (the GPU check first met an AttributeError)."""
    on_a_device = torch.zeros(4, device="meta")  # not host memory, as a GPU's is not
    with pytest.raises(ValueError, match="without a copier"):
        Staging(on_a_device, cuda_aware=False)
    with pytest.raises(ValueError, match="without a copier"):
        Staging.of_host(np.zeros(4, np.float32), like=on_a_device)


def test_staging_on_the_host_is_zero_copy_both_ways():
    tensor = torch.arange(6, dtype=torch.float32)
    staging = Staging(tensor)
    assert staging.way == "view" and shares_memory(staging.to_host(2, 4), tensor[2:])
    message = np.zeros(6, np.float32)
    outbound = Staging.of_host(message, like=tensor)
    outbound.device[...] = tensor  # what a rule writes lands in the message buffer
    assert isinstance(outbound.device, torch.Tensor) and np.array_equal(outbound.to_host(), tensor.numpy())
    assert Staging.of_host(message, like=message).device is not None


def test_ranks_sharing_a_gpu_are_found_by_the_gpus_identity():
    """NCCL refuses two ranks on one GPU: the ranks that share one, grouped by GPU (an
    identity is host and UUID, so two ranks that each call their own GPU cuda:0 differ)."""
    from nbdist.transport.torch_group import ranks_sharing_gpus

    assert ranks_sharing_gpus(["a:GPU-1", "a:GPU-2", "b:GPU-1"]) == []
    assert ranks_sharing_gpus(["a:GPU-1", "a:GPU-1", "a:GPU-2", "a:GPU-2", "b:GPU-3"]) == [[0, 1], [2, 3]]
    assert ranks_sharing_gpus(["a:GPU-1"]) == []


def test_auto_takes_mpi_and_says_why_where_ranks_share_a_gpu_and_nccl_named_is_refused(monkeypatch):
    """What every rank of the reduction gathered (world rank, GPU identity) decides: each its
    own GPU, nccl; two on one GPU, auto takes mpi with a note naming them, nccl is refused."""
    import nbdist.transport.torch_group as torch_group
    from nbdist.errors import OptionsError
    from nbdist.transport.torch_group import nccl_unless_sharing

    monkeypatch.setattr(torch_group, "gpu_identity", lambda device: "this rank's GPU")

    class Gathered:
        def __init__(self, rows):
            self.rows = rows

        def allgather(self, comm, value, what):
            assert value == [MPI.COMM_WORLD.Get_rank(), "this rank's GPU"]
            return self.rows

    own = Gathered([[0, "node1:GPU-a"], [1, "node1:GPU-b"], [2, "node2:GPU-a"]])
    assert nccl_unless_sharing("auto", None, torch.zeros(1), own) == ("nccl", "")
    assert nccl_unless_sharing("nccl", None, torch.zeros(1), own) == ("nccl", "")
    shared = Gathered([[4, "node1:GPU-a"], [5, "node1:GPU-a"], [6, "node1:GPU-b"]])
    chosen, note = nccl_unless_sharing("auto", None, torch.zeros(1), shared)
    assert chosen == "mpi"
    assert note.startswith("ranks 4, 5 share one GPU on node1: the allreduce goes through MPI")
    with pytest.raises(
        OptionsError, match="--allreduce-backend nccl takes one GPU per rank .* ranks 4, 5 share one GPU on node1"
    ):
        nccl_unless_sharing("nccl", None, torch.zeros(1), shared)


def test_a_checkpoints_host_copy_is_its_own_whatever_the_array():
    """host_copy: numpy arrays and CPU tensors (the --device cpu path) are copied, so the
    checkpoint keeps its values while training goes on; the copy equals the buffer."""
    from nbdist.algorithms.arrays import host_copy

    live_numpy = np.arange(6, dtype=np.float32)
    live_tensor = torch.arange(6, dtype=torch.float32)
    for live in (live_numpy, live_tensor):
        copied = host_copy(live)
        assert isinstance(copied, np.ndarray) and copied.dtype == np.float32
        np.testing.assert_array_equal(copied, np.arange(6, dtype=np.float32))
        live += 1  # the next update
        np.testing.assert_array_equal(copied, np.arange(6, dtype=np.float32))
