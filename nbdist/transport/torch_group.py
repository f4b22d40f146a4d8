"""A torch.distributed process group made from an MPI communicator (rendezvous over MPI).

NCCL reduces tensors where they live, on the GPUs; gloo does the same for CPU tensors
(the way the test suite checks this path). Neither needs torch's launcher: MPI already
knows the ranks, so rank 0 of the communicator opens a TCPStore on a free port, the port
and a fresh secret go to the others with the polled broadcast, and every rank builds the
group from that store with a timeout.

Each group is an object of its own (the backend class itself, never torch's default
group) on a store of its own: the trials a study runs one after another in one process,
and a restart on fewer ranks, each get a fresh group and do not meet the old one's keys.

Where it listens, and who may use it. On one host the store and gloo's pairs listen on
127.0.0.1 only; across hosts, on this host's address on the job's interface (`launch
--interface`, which Open MPI hands every rank as OMPI_MCA_btl_tcp_if_include), else on
the address of the host's name, as MPI's own TCP transport does. Loopback is not private
on a shared node (every user reaches it) and torch's store checks no one, so the group
talks through a SealedStore (sealed_store.py): keys hidden and values encrypted and
authenticated under a 32-byte secret that rank 0 draws and sends to the others over MPI,
the job's own channel. A stranger who connects to the store reads nothing (not gloo's
addresses, not NCCL's unique id), and a value it writes fails the check: the group is
not made, with one error. What stays open: gloo's pair sockets themselves authenticate
nothing; a stranger who finds their ports (by scanning, since the store does not tell)
can break the group's connections (the run stops, naming the rendezvous or a lost rank),
not join it unnoticed, since each pair's connection is expected from one peer only. On a
node shared with others, --allreduce-backend mpi (shared memory, no port at all) is the
choice for CPU gradients.

Every wait on the group is polled with the transport's deadline (`Collectives.wait_for`):
a work that fails (a peer's process died, its sockets closed) raises WorkFailed, which the
collectives turn into a RankLost naming the dead rank; a work that does not complete
within the peer timeout becomes a roll call naming the frozen rank.
"""

from __future__ import annotations

import datetime
import secrets
import socket
from collections.abc import Sequence
from typing import Any

import numpy as np

from nbdist.errors import OptionsError, TrainingError, UserError
from nbdist.transport.interfaces import interface_address, job_interface
from nbdist.transport.waiting import CommFailure

__all__ = [
    "TorchGroup",
    "WorkFailed",
    "all_completed",
    "gpu_identity",
    "keep_until_done",
    "nccl_unless_sharing",
    "ranks_sharing_gpus",
    "LOOPBACK",
]

LOOPBACK = "127.0.0.1"
RENDEZVOUS = "the torch.distributed rendezvous"
# Each work's own deadline: twice the run's wait and its roll call's grace, so that the
# polled wait (which names the rank) always ends first, and a work left behind by a failed
# run ends by itself (a group is destroyed only once its works ended: see keep_until_done).
WORK_DEADLINE_FACTOR, WORK_DEADLINE_SLACK = 2.0, 30.0

# Groups with works that a failed run left behind (a peer gave up on them): destroying a
# group waits for its works, which would stall the run that goes on, so they are kept
# here until those works ended (they fail at their own deadline, or when the peer exits).
_left_behind: list[tuple[TorchGroup, list]] = []


def gpu_identity(device: Any) -> str:
    """What tells one GPU from another across processes: its UUID (a rank that sees only
    its own GPU, as under SLURM's --gpus-per-task, calls it cuda:0 as its neighbour does)."""
    import torch

    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
    return f"{socket.gethostname()}:{uuid if uuid is not None else device}"


def ranks_sharing_gpus(identities: Sequence[str]) -> list[list[int]]:
    """The ranks (indices into `identities`, one GPU identity per rank) that share a GPU
    with another rank, grouped by GPU; empty when every rank has one of its own."""
    by_gpu: dict[str, list[int]] = {}
    for rank, identity in enumerate(identities):
        by_gpu.setdefault(identity, []).append(rank)
    return [ranks for ranks in by_gpu.values() if len(ranks) > 1]


def nccl_unless_sharing(name: str, comm: Any, grads: Any, collectives: Any) -> tuple[str, str]:
    """nccl where each rank of `comm` has a GPU of its own; NCCL refuses two ranks on one
    GPU ("invalid usage"), so where some share one (more ranks on a node than it has GPUs)
    auto takes mpi, with a note saying why, and nccl named is one OptionsError naming
    them. Returns (the reducer's name, the note). Collective over comm."""
    import array_api_compat
    from mpi4py import MPI

    where = array_api_compat.device(grads)
    rows = collectives.allgather(comm, [MPI.COMM_WORLD.Get_rank(), gpu_identity(where)], "the GPUs' identities")
    shared = ranks_sharing_gpus([identity for _, identity in rows])
    if not shared:
        return "nccl", ""
    ranks = ", ".join(str(rows[i][0]) for i in shared[0])
    host = rows[shared[0][0]][1].split(":")[0]
    sharing = f"ranks {ranks} share one GPU on {host}"
    if name == "auto":
        return "mpi", (
            f"{sharing}: the allreduce goes through MPI (NCCL takes one GPU per rank); for NCCL, start as many "
            f"ranks per node as it has GPUs"
        )
    raise OptionsError(
        f"--allreduce-backend nccl takes one GPU per rank (NCCL refuses two ranks on one GPU), and {sharing}: "
        f"use --allreduce-backend mpi (auto picks it where ranks share GPUs), or start as many ranks per node "
        f"as it has GPUs"
    )


class WorkFailed(CommFailure):
    """A torch.distributed work completed with an error (its peer's connection broke)."""

    def __init__(self, message: str):
        Exception.__init__(self, message)
        self.error_class = None


class TorchGroup:
    """The ranks of `comm` as one torch.distributed group (`kind`: nccl or gloo)."""

    __slots__ = ("kind", "group", "store", "sealed", "rank", "size", "wait_seconds")

    def __init__(self, comm: Any, kind: str, collectives: Any, device: Any = None):
        import torch.distributed as dist

        from nbdist.transport.sealed_store import SECRET_BYTES, SealedStore  # torch: only when a group is made

        _left_behind[:] = [(group, works) for group, works in _left_behind if not all_ended(works)]
        self.kind = kind
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.wait_seconds = collectives.timeout  # the run's current deadline for a wait
        timeout = datetime.timedelta(seconds=collectives.timeout())
        rows = collectives.allgather(comm, [socket.gethostname(), *_job_address()], RENDEZVOUS)
        problem = next((error for _, _, error in rows if error), None)
        if problem:  # every rank knows it: all raise it
            raise TrainingError(f"{RENDEZVOUS}: {problem}")
        # One host: loopback only. Several: each rank on its address on the job's network.
        one_host = len({host for host, _, _ in rows}) == 1
        address = LOOPBACK if one_host else rows[0][1]
        mine = LOOPBACK if one_host else rows[self.rank][1]
        # The store's port and the group's secret, from rank 0 over MPI (never through the store).
        ticket = np.zeros(8 + SECRET_BYTES, np.uint8)
        if self.rank == 0:
            ticket[:8] = np.frombuffer(np.int64(self._open_store(address, timeout)).tobytes(), np.uint8)
            ticket[8:] = np.frombuffer(secrets.token_bytes(SECRET_BYTES), np.uint8)
        collectives.bcast(comm, ticket, RENDEZVOUS)
        port = int(ticket[:8].view(np.int64)[0])
        if port < 0:
            raise TrainingError(f"{RENDEZVOUS}: rank 0 could not open a store on {address}")
        if self.rank != 0:
            self.store = dist.TCPStore(address, port, is_master=False, timeout=timeout)
        self.sealed = SealedStore(self.store, ticket[8:].tobytes())
        try:
            self.group = _make_group(kind, self.sealed, self.rank, self.size, timeout, mine, device)
        except RuntimeError as exc:  # torch's DistStoreError, or a sealed value that failed its check
            raise TrainingError(f"{RENDEZVOUS} failed: {str(exc).strip().splitlines()[0]}") from None

    def _open_store(self, address: str, timeout: datetime.timedelta) -> int:
        """Rank 0: the store's server on a free port of `address`; its port, or -1."""
        import torch.distributed as dist

        try:
            listener = socket.create_server((address, 0))
            port = listener.getsockname()[1]
            # The store takes over the listening socket: no other process can take the
            # port between choosing it and listening on it.
            self.store = dist.TCPStore(
                address,
                port,
                is_master=True,
                timeout=timeout,
                wait_for_workers=False,
                master_listen_fd=listener.detach(),
            )
        except (OSError, RuntimeError) as exc:
            print(f"nbdist: {RENDEZVOUS}: cannot open a store on {address}: {exc}", flush=True)
            return -1
        return port

    def allreduce(self, tensor: Any) -> Any:
        """Start summing `tensor` in place over the group; returns the pending work."""
        import torch.distributed as dist

        options = dist.AllreduceOptions()
        options.timeout = datetime.timedelta(seconds=WORK_DEADLINE_FACTOR * self.wait_seconds() + WORK_DEADLINE_SLACK)
        return self.group.allreduce([tensor], options)

    def close(self) -> None:
        """Release the group after a run that ended well."""
        shutdown = getattr(self.group, "shutdown", None)
        if shutdown is not None:
            shutdown()


def _job_address() -> tuple[str, str | None]:
    """(the address this rank listens on between hosts, None), or ("", why there is none):
    on the job's interface where it has one, else the host's name."""
    interface = job_interface()
    if interface is None:
        return socket.gethostname(), None
    try:
        return interface_address(interface), None
    except UserError as exc:
        return "", f"the job's interface {interface} ({exc})"


def _make_group(
    kind: str, store: Any, rank: int, size: int, timeout: datetime.timedelta, address: str, device: Any
) -> Any:
    import torch.distributed as dist

    if kind == "gloo":
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private in torch's stubs
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        return dist.ProcessGroupGloo(store, rank, size, options)
    from torch.distributed import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    options._timeout = timeout
    group = ProcessGroupNCCL(store, rank, size, options)
    if device is not None and hasattr(group, "eager_connect_single_device"):
        group.eager_connect_single_device(device)  # connect now, inside set-up's deadline
    return group


def keep_until_done(group: TorchGroup, works: list) -> None:
    """Keep `group` alive until `works` (left pending by a failed wait) ended."""
    if not all_ended(works):
        _left_behind.append((group, works))


def all_ended(works: Sequence[Any]) -> bool:
    return all(work.is_completed() for work in works)


def all_completed(works: Sequence[Any]) -> bool:
    """Whether every work finished; WorkFailed when one finished with an error."""
    if not all_ended(works):
        return False
    for work in works:
        try:
            work.wait()  # done already: raises its error, and on a GPU orders the stream after it
        except Exception as exc:  # torch raises RuntimeError or DistBackendError
            raise WorkFailed(f"{type(exc).__name__}: {exc}") from None
    return True
