"""The bucketed gradient allreduce of the allreduce topology, over MPI or torch.distributed.

A reducer sums a flat gradient over the ranks of a communicator while backward still
runs: the backend calls back as soon as a contiguous bucket is final (`bucket_hooks`),
and that bucket's reduction starts at once; `finish(trailer)` adds a small float32
trailer (samples, loss, metric, stop requests) and waits for everything, with the run's
deadline and failure naming.

- mpi: one in-place `Iallreduce` per bucket through the transport's staging (the host
  buffer itself, the device buffer where Open MPI is CUDA-aware, else a pinned host copy).
- nccl: the buckets of a CUDA gradient on a torch.distributed NCCL group made from the
  communicator (torch_group.py), reduced on the GPU without a host copy.
- gloo: the same group over gloo, for a gradient in host memory: the way the test suite
  runs the torch.distributed path on a machine without a GPU.

`--allreduce-backend auto` takes nccl where the gradient is on a GPU and torch has NCCL,
else mpi. The name is looked up once (`choose`), here at the edge, in REDUCERS.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable

import array_api_compat
import numpy as np
from mpi4py import MPI

from nbdist.errors import OptionsError
from nbdist.transport.staging import Staging
from nbdist.transport.torch_group import TorchGroup, all_completed, keep_until_done
from nbdist.transport.waiting import wait_all, wait_for

__all__ = ["Reducer", "MpiReducer", "TorchReducer", "REDUCERS", "choose", "make_reducer"]

WHAT = "the gradient allreduce"


class Reducer(ABC):
    """Sums a flat gradient (the backend's `rule_grads`) over the ranks of a communicator,
    bucket by bucket from inside backward."""

    way: str  # how the buckets travel, for benchmarks and messages

    def _bucket_ready(self, index: int) -> None:
        start, stop = self.buckets[index]
        self.start(start, stop)

    @abstractmethod
    def start(self, start: int, stop: int) -> None:
        """Start summing the gradient's [start:stop], which backward no longer writes."""

    @abstractmethod
    def finish(self, trailer: np.ndarray) -> None:
        """Sum `trailer` too, and return once the gradient and the trailer hold the sums."""

    def close(self) -> None:
        """Release what the reducer holds, after a run that ended well."""


class MpiReducer(Reducer):
    """Starts one in-place Iallreduce per gradient bucket from inside backward.

    The gradient goes through the transport's staging: on the host MPI reduces the
    backend's own memory; on a GPU, the device buffer itself (CUDA-aware MPI) or a pinned
    host copy of each bucket, copied back once the reductions are done.

    `finish_wait(requests)` waits for the last ones (default: waiting.wait_all; a run
    passes its polled collectives' wait, with the run's deadline and failure naming)."""

    __slots__ = ("comm", "staging", "buckets", "requests", "finish_wait")

    def __init__(self, comm: MPI.Intracomm, backend: Any, bucket_floats: int, finish_wait: Callable | None = None):
        self.comm = comm
        self.staging = Staging(backend.rule_grads, backend.copier)
        self.requests: list[MPI.Request] = []
        self.finish_wait = finish_wait or wait_all
        self.buckets = backend.bucket_hooks(bucket_floats, self._bucket_ready)

    @property
    def way(self) -> str:
        return f"mpi ({self.staging.way})"

    def start(self, start: int, stop: int) -> None:
        self.requests.append(self.comm.Iallreduce(MPI.IN_PLACE, self.staging.to_host(start, stop), op=MPI.SUM))
        MPI.Request.Testall(self.requests)  # progress the earlier buckets

    def finish(self, trailer: np.ndarray) -> None:
        self.requests.append(self.comm.Iallreduce(MPI.IN_PLACE, trailer, op=MPI.SUM))
        try:
            self.finish_wait(self.requests)
        finally:
            self.requests.clear()
        self.staging.to_device()


class TorchReducer(Reducer):
    """One in-place allreduce per bucket on a torch.distributed group (NCCL on the GPU
    where the gradient is, gloo for a gradient in host memory), and the trailer with them.

    `finish_wait(done)` polls `done()` (default: waiting.wait_for without a deadline; a
    run passes its collectives' `wait_for`, with the run's deadline and failure naming)."""

    __slots__ = ("group", "grads", "trailer", "buckets", "works", "finish_wait")

    def __init__(self, group: TorchGroup, backend: Any, bucket_floats: int, finish_wait: Callable | None = None):
        import torch

        self.group = group
        grads = backend.rule_grads
        # On the host path the gradient is a numpy view: the tensor shares its memory.
        self.grads = torch.from_numpy(grads) if isinstance(grads, np.ndarray) else grads
        self.trailer = torch.zeros(4, dtype=torch.float32, device=self.grads.device)
        self.works: list[Any] = []
        self.finish_wait = finish_wait or wait_for
        self.buckets = backend.bucket_hooks(bucket_floats, self._bucket_ready)

    @property
    def way(self) -> str:
        return self.group.kind

    def start(self, start: int, stop: int) -> None:
        self.works.append(self.group.allreduce(self.grads[start:stop]))

    def finish(self, trailer: np.ndarray) -> None:
        import torch

        self.trailer.copy_(torch.from_numpy(trailer))
        self.works.append(self.group.allreduce(self.trailer))
        works = list(self.works)
        try:
            self.finish_wait(lambda: all_completed(works))
        except BaseException:
            keep_until_done(self.group, works)  # the others may never join them
            raise
        finally:
            self.works.clear()
        trailer[:] = self.trailer.cpu().numpy()

    def close(self) -> None:
        self.group.close()


REDUCERS: dict[str, type[Reducer]] = {"mpi": MpiReducer, "nccl": TorchReducer, "gloo": TorchReducer}


def choose(name: str, grads: Any) -> str:
    """The reducer `--allreduce-backend name` means for a gradient held in `grads`, or one
    OptionsError saying why it cannot reduce it (the same on every rank of a run)."""
    if name != "auto" and name not in REDUCERS:
        raise OptionsError(f"--allreduce-backend {name!r}: choose one of auto, {', '.join(REDUCERS)}")
    where = str(array_api_compat.device(grads))
    on_gpu = where.startswith("cuda")
    if name == "auto":
        return "nccl" if on_gpu and _torch_has("nccl") else "mpi"
    if name == "nccl" and not on_gpu:
        raise OptionsError(f"--allreduce-backend nccl reduces gradients on GPUs; this model's are on {where} (no GPU, "
                           f"or --device cpu): use --allreduce-backend mpi or gloo, or --device cuda on a GPU node")
    if name == "gloo" and on_gpu:
        raise OptionsError(f"--allreduce-backend gloo reduces gradients in host memory; this model's are on {where}: "
                           f"use --allreduce-backend nccl or mpi")
    if name != "mpi" and not _torch_has(name):
        raise OptionsError(f"--allreduce-backend {name}: this torch has no {name} (torch.distributed."
                           f"is_backend_available({name!r}) is False): use --allreduce-backend mpi")
    return name


def _torch_has(name: str) -> bool:
    """Whether this torch has the torch.distributed backend `name` (nccl, gloo)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available() and dist.is_backend_available(name)


def make_reducer(name: str, comm: Any, backend: Any, bucket_floats: int, collectives: Any,
                 what: str = WHAT) -> Reducer:
    """Collective over `comm`: the reducer `--allreduce-backend name` means for this
    backend's gradient, its waits polled by the run's `collectives`."""
    kind = choose(name, backend.rule_grads)
    if REDUCERS[kind] is MpiReducer:
        return MpiReducer(comm, backend, bucket_floats, lambda requests: collectives.wait_all(comm, requests, what))
    device = array_api_compat.device(backend.rule_grads)
    group = TorchGroup(comm, kind, collectives, device=device if kind == "nccl" else None)
    return TorchReducer(group, backend, bucket_floats, lambda done: collectives.wait_for(comm, done, what))
