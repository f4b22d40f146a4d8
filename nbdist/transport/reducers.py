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
else mpi. The name is looked up once (`choose`), here at the edge, in REDUCERS, the
registry every reducer class registers on (nbdist.registry). This module imports MPI and
torch only when a reducer is made, so that the options can list the reducers.

--compression (compression.py, reduction.py) runs on the MPI reducer only: its codecs
are numpy, so the buckets go through host memory anyway; `auto` then takes mpi, and
nccl or gloo named with a compression is one error.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

import array_api_compat
import numpy as np

from nbdist.errors import OptionsError
from nbdist.registry import Registry
from nbdist.specs import Spec
from nbdist.transport.interfaces import WORLD_SIZE_VARIABLE

if TYPE_CHECKING:
    from mpi4py import MPI

    from nbdist.transport.torch_group import TorchGroup

__all__ = [
    "Reducer",
    "AloneReducer",
    "MpiReducer",
    "TorchReducer",
    "NcclReducer",
    "GlooReducer",
    "REDUCERS",
    "choose",
    "make_reducer",
    "LIBNBC_IALLREDUCE",
    "LIBNBC_ALGORITHM",
    "libnbc_note",
]

WHAT = "the gradient allreduce"

# Open MPI's setting of its nonblocking allreduce's algorithm, and what nbdist's MPI
# environment sets it to (launch.mpi_env). Left to its own choice, Open MPI's libnbc
# reduces every in-place allreduce (the buckets) by a binomial tree: the whole bucket
# through one rank while the others wait (bench/results/2026-11-28-allreduce_vs_ddp-libnbc.md).
LIBNBC_IALLREDUCE = "OMPI_MCA_coll_libnbc_iallreduce_algorithm"
LIBNBC_ALGORITHM = "rabenseifner"


class Reducer(ABC):
    """Sums a flat gradient (the backend's `rule_grads`) over the ranks of a communicator,
    bucket by bucket from inside backward.

    What `--allreduce-backend` chooses (`make_reducer`): `MpiReducer` (MPI's
    `Iallreduce`, with `--compression` through a codec) or `TorchReducer` (a
    torch.distributed NCCL or gloo group made from the MPI ranks); on one rank without
    compression, `AloneReducer`, which has nothing to reduce. The backend calls
    `start(index)` as each bucket becomes final during backward; the role calls
    `finish(trailer)` once per step. Every rank ends the step with the same sums, so the
    replicas stay bit-identical.

    Example:
        On one rank (`MPI.COMM_SELF`) the sum is the gradient itself; under
        `mpiexec -n N` the same code sums over N ranks:

        >>> import numpy as np, torch
        >>> from mpi4py import MPI
        >>> from nbdist.backends.torch import TorchBackend
        >>> from nbdist.transport.reducers import MpiReducer
        >>> backend = TorchBackend(torch.nn.Linear(4, 2))
        >>> reducer = MpiReducer(MPI.COMM_SELF, backend, bucket_floats=2**20)
        >>> x, y = np.ones((3, 4), np.float32), np.array([0, 1, 0])
        >>> stats = backend.compute_gradients(x, y)   # backward starts the buckets
        >>> trailer = np.array([3.0], np.float32)     # e.g. the step's samples
        >>> reducer.finish(trailer)                   # waits for the sums
        >>> reducer.buckets, trailer
        ([(0, 10)], array([3.], dtype=float32))
    """

    name: ClassVar[str]  # what --allreduce-backend calls it
    buckets: list[tuple[int, int]]  # [start, stop) of each bucket of the flat gradient
    # Why `auto` took this reducer where the user might expect another, for the run's
    # leader to say (make_reducer sets it); empty: nothing to say.
    note: str = ""

    @property
    @abstractmethod
    def way(self) -> str:
        """How the buckets travel, for benchmarks and messages."""

    @property
    @abstractmethod
    def bytes_sent(self) -> int:
        """The gradient bytes this rank handed over to be reduced, over the run."""

    @abstractmethod
    def start(self, index: int) -> None:
        """Start summing bucket `index` of the gradient, which backward no longer writes
        (the backend's bucket hook)."""

    @abstractmethod
    def finish(self, trailer: np.ndarray) -> None:
        """Sum `trailer` too, and return once the gradient and the trailer hold the sums."""

    def close(self) -> None:  # noqa: B027
        """Release what the reducer holds, after a run that ended well; by default nothing."""

    def state_arrays(self) -> dict[str, np.ndarray]:
        """What the reducer carries from step to step (a compression's residuals), for checkpoints."""
        return {}

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:  # noqa: B027
        """Take back what state_arrays gave (a resume); by default there is nothing."""


class AloneReducer(Reducer):
    """The reducer of a communicator of one rank: the sum over one rank is its own
    gradient, so nothing is started or waited for (no bucket hooks, no group, no copies
    through host memory) and a 1-rank run steps as a plain training loop does. Not a
    choice of --allreduce-backend: make_reducer's for any of them on one rank."""

    name = "alone"

    def __init__(self, chosen: str, num_params: int):
        self.chosen = chosen
        self.buckets = [(0, num_params)]

    @property
    def way(self) -> str:
        return f"{self.chosen} (one rank: nothing to reduce)"

    @property
    def bytes_sent(self) -> int:
        return 0

    def start(self, index: int) -> None:
        """Never called: no bucket hooks are installed."""

    def finish(self, trailer: np.ndarray) -> None:
        """The gradient and the trailer are already the sums over this one rank."""


REDUCERS: Registry[Reducer] = Registry(
    "allreduce backend", supplied=("comm", "group", "backend", "bucket_floats", "finish_wait", "compression")
)


@REDUCERS.register
class MpiReducer(Reducer):
    """One in-place MPI Iallreduce per gradient bucket, started from inside backward; the
    only one that takes --compression.

    The gradient goes through the transport's staging: on the host MPI reduces the
    backend's own memory; on a GPU, the device buffer itself (CUDA-aware MPI) or a pinned
    host copy of each bucket, copied back once the reductions are done.

    `finish_wait(requests)` waits for the last ones (default: waiting.wait_all; a run
    passes its polled collectives' wait, with the run's deadline and failure naming).

    With a `compression` (--compression), the buckets go through its codec instead
    (reduction.py). Making one sets the process's malloc to keep freed memory (heap.py)."""

    name = "mpi"

    def __init__(
        self,
        comm: MPI.Intracomm,
        backend: Any,
        bucket_floats: int,
        finish_wait: Callable | None = None,
        compression: Spec | None = None,
    ):
        from mpi4py import MPI

        from nbdist.transport.heap import keep_freed_memory
        from nbdist.transport.reduction import compressed_reduction
        from nbdist.transport.staging import Staging
        from nbdist.transport.waiting import keep_pending, wait_all

        self._mpi = MPI
        self._keep_pending = keep_pending
        self.comm = comm
        # The codecs are numpy: a compressed gradient goes through host memory even where
        # MPI could read the device (cuda_aware=False: pinned host copies).
        self.staging = Staging(backend.rule_grads, backend.copier, cuda_aware=False if compression else None)
        self.requests: list[MPI.Request] = []
        self.finish_wait = finish_wait or wait_all
        self.buckets = backend.bucket_hooks(bucket_floats, self.start)
        self.compressed = (
            None
            if compression is None
            else compressed_reduction(comm, compression, backend.num_params, self.buckets, backend.param_blocks())
        )
        self.plain_bytes = 0
        # Open MPI allocates and frees a temporary per bucket's Iallreduce every step: the
        # heap keeps those pages rather than the kernel zero-filling new ones (heap.py).
        keep_freed_memory(4 * backend.num_params)

    def __del__(self) -> None:
        # A run that ended in the middle of a step: the buckets' reductions may still
        # complete into the staging buffers (waiting.keep_pending).
        if hasattr(self, "requests"):
            self._keep_pending(self.requests)

    @property
    def bytes_sent(self) -> int:
        return self.plain_bytes + (self.compressed.bytes_sent if self.compressed is not None else 0)

    def start(self, index: int) -> None:
        start, stop = self.buckets[index]
        host = self.staging.to_host(start, stop)
        mpi = self._mpi
        if self.compressed is None:
            self.requests.append(self.comm.Iallreduce(mpi.IN_PLACE, host, op=mpi.SUM))
            self.plain_bytes += host.nbytes
        else:
            self.requests += self.compressed.start(index, host)
        mpi.Request.Testall(self.requests)  # progress the earlier buckets

    @property
    def way(self) -> str:
        return f"mpi ({self.staging.way})"

    def finish(self, trailer: np.ndarray) -> None:
        self.requests.append(self.comm.Iallreduce(self._mpi.IN_PLACE, trailer, op=self._mpi.SUM))
        try:
            self.finish_wait(self.requests)
        finally:
            self.requests.clear()
        if self.compressed is not None:
            self.compressed.finish(self.staging.to_host, self.finish_wait)
        self.staging.to_device()

    def state_arrays(self) -> dict[str, np.ndarray]:
        return self.compressed.state_arrays() if self.compressed is not None else {}

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        if self.compressed is not None:
            self.compressed.load_state_arrays(arrays)


class TorchReducer(Reducer):
    """One in-place allreduce per bucket on a torch.distributed group (NCCL on the GPU
    where the gradient is, gloo for a gradient in host memory), and the trailer with them.

    `finish_wait(done)` polls `done()` (default: waiting.wait_for without a deadline; a
    run passes its collectives' `wait_for`, with the run's deadline and failure naming)."""

    def __init__(self, group: TorchGroup, backend: Any, bucket_floats: int, finish_wait: Callable | None = None):
        import torch

        from nbdist.transport.waiting import wait_for

        self.group = group
        grads = backend.rule_grads
        # On the host path the gradient is a numpy view: the tensor shares its memory.
        self.grads = torch.from_numpy(grads) if isinstance(grads, np.ndarray) else grads
        self.trailer = torch.zeros(4, dtype=torch.float32, device=self.grads.device)
        self.works: list[Any] = []
        self._bytes_sent = 0
        self.finish_wait = finish_wait or wait_for
        self.buckets = backend.bucket_hooks(bucket_floats, self.start)

    @property
    def way(self) -> str:
        return self.group.kind

    @property
    def bytes_sent(self) -> int:
        return self._bytes_sent

    def start(self, index: int) -> None:
        start, stop = self.buckets[index]
        self.works.append(self.group.allreduce(self.grads[start:stop]))
        self._bytes_sent += 4 * (stop - start)

    def finish(self, trailer: np.ndarray) -> None:
        import torch

        from nbdist.transport.torch_group import all_completed, keep_until_done

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


@REDUCERS.register
class NcclReducer(TorchReducer):
    """The buckets of a gradient on GPUs, reduced there by NCCL (a torch.distributed group
    made from the MPI ranks)."""

    name = "nccl"


@REDUCERS.register
class GlooReducer(TorchReducer):
    """The same over gloo, for a gradient in host memory (how the test suite runs the
    torch.distributed path without a GPU)."""

    name = "gloo"


def choose(name: str, grads: Any, compressed: bool = False) -> str:
    """The reducer `--allreduce-backend name` means for a gradient held in `grads` (and
    `compressed` by --compression), or one OptionsError saying why it cannot reduce it (the
    same on every rank of a run)."""
    if name != "auto" and name not in REDUCERS:
        raise OptionsError(f"--allreduce-backend {name!r}: choose one of auto, {', '.join(REDUCERS.names())}")
    where = str(array_api_compat.device(grads))
    on_gpu = where.startswith("cuda")
    if name == "auto":
        return "nccl" if on_gpu and _torch_has("nccl") and not compressed else "mpi"
    if compressed and name != "mpi":
        raise OptionsError(
            f"--compression runs on the MPI reducer (its codecs are numpy, in host memory), not on "
            f"--allreduce-backend {name}: use --allreduce-backend mpi or auto, or drop --compression"
        )
    if name == "nccl" and not on_gpu:
        raise OptionsError(
            f"--allreduce-backend nccl reduces gradients on GPUs; this model's are on {where} (no GPU, "
            f"or --device cpu): use --allreduce-backend mpi or gloo, or --device cuda on a GPU node"
        )
    if name == "gloo" and on_gpu:
        raise OptionsError(
            f"--allreduce-backend gloo reduces gradients in host memory; this model's are on {where}: "
            f"use --allreduce-backend nccl or mpi"
        )
    if name != "mpi" and not _torch_has(name):
        raise OptionsError(
            f"--allreduce-backend {name}: this torch has no {name} (torch.distributed."
            f"is_backend_available({name!r}) is False): use --allreduce-backend mpi"
        )
    return name


def _torch_has(name: str) -> bool:
    """Whether this torch has the torch.distributed backend `name` (nccl, gloo)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available() and dist.is_backend_available(name)


def make_reducer(
    name: str,
    comm: Any,
    backend: Any,
    bucket_floats: int,
    collectives: Any,
    what: str = WHAT,
    compression: Spec | None = None,
    *,
    alone_reduces_nothing: bool = True,
) -> Reducer:
    """Collective over `comm`: the reducer `--allreduce-backend name` means for this
    backend's gradient (through `compression`'s codec, if any), its waits polled by the
    run's `collectives`. On a communicator of one rank without compression, the sum is the
    gradient itself: `AloneReducer` (a benchmark of the reducers themselves passes
    alone_reduces_nothing=False)."""
    chosen = choose(name, backend.rule_grads, compressed=compression is not None)
    if alone_reduces_nothing and comm.Get_size() == 1 and compression is None:
        return AloneReducer(chosen, backend.num_params)
    note = ""
    if chosen == "nccl" and comm.Get_size() > 1:
        from nbdist.transport.torch_group import nccl_unless_sharing

        chosen, note = nccl_unless_sharing(name, comm, backend.rule_grads, collectives)
    kind = REDUCERS.get(chosen)
    if issubclass(kind, MpiReducer):
        reducer = kind(
            comm, backend, bucket_floats, lambda requests: collectives.wait_all(comm, requests, what), compression
        )
        reducer.note = note
        return reducer
    if not issubclass(kind, TorchReducer):
        raise TypeError(f"{kind!r}: make_reducer knows MPI and torch.distributed reducers")
    from nbdist.transport.torch_group import TorchGroup

    device = array_api_compat.device(backend.rule_grads)
    group = TorchGroup(comm, kind.name, collectives, device=device if kind.name == "nccl" else None)
    return kind(group, backend, bucket_floats, lambda done: collectives.wait_for(comm, done, what))


def libnbc_note(reducer: str, ranks: int, environ: Mapping[str, str] = os.environ) -> str:
    """What a run that reduces its buckets over Open MPI is told when Open MPI's algorithm
    for them was left to its own choice (the job was not started through launch.mpi_env:
    a hand-written mpiexec, another launcher); empty when there is nothing to say. Open
    MPI's mpiexec is known by the variables it gives its ranks (no MPI call: the set-up's
    checks make none)."""
    started_by_open_mpi = WORLD_SIZE_VARIABLE in environ
    if reducer != MpiReducer.name or ranks < 2 or not started_by_open_mpi or LIBNBC_IALLREDUCE in environ:
        return ""
    return (
        f"Open MPI picks its own algorithm for the allreduce buckets ({LIBNBC_IALLREDUCE} is not set: "
        f"the job was not started by `python -m nbdist launch`), a binomial tree that sends each whole "
        f"bucket through one rank, slow for large gradients; start it with `python -m nbdist launch`, "
        f"or export {LIBNBC_IALLREDUCE}={LIBNBC_ALGORITHM}"
    )
