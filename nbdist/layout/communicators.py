"""The MPI side of a layout: the sub-communicators of each rank, made by Split. mpi4py
is imported only here, when they are made, so layouts are built and printed without MPI."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nbdist.layout.roles import Role

if TYPE_CHECKING:  # pragma: no cover
    from mpi4py import MPI

    from nbdist.layout.core import Layout

__all__ = ["Communicators", "split_communicators"]


def split_communicators(layout: Layout, comm: MPI.Intracomm) -> Communicators:
    """Layout.split's communicators for this rank of `comm` (its size checked there)."""
    from mpi4py import MPI

    role = layout.role(comm.Get_rank())
    undefined = MPI.UNDEFINED
    in_run = role.kind != "coordinator"
    group, fold = role.run if in_run else (undefined, undefined)
    run_index = (group * layout.folds + fold) if in_run else undefined

    def split(color: int, key: int = 0) -> MPI.Intracomm:
        # key defaults to 0 so members keep world-rank order (MPI breaks key ties by rank).
        return comm.Split(color, key)  # type: ignore[return-value]  # mpi4py's stubs: Comm

    comms = Communicators(world=comm, role=role)
    comms.run = split(run_index)
    comms.group = split(group)
    if layout.topology == "master-worker":
        if role.kind == "master":
            comms.block = split(run_index * layout.masters + role.master_index, 0)
        elif role.is_leader:
            comms.block = split(run_index * layout.masters + role.master_index, role.worker_index + 1)
        else:
            comms.block = split(undefined)
        is_master = role.kind == "master"
        comms.masters = split(run_index if is_master else undefined, role.master or 0)
    # A worker's leader rank is unique in the world: a ready-made colour for its processes.
    leader = role.rank - (role.proc or 0)
    comms.worker = split(leader if role.kind == "worker" else undefined, role.proc or 0)
    if layout.topology == "allreduce":
        comms.leaders = split(run_index if role.is_leader else undefined, role.worker or 0)
        if layout.procs_per_worker > 1:
            is_worker = role.kind == "worker"
            comms.stage = split(
                run_index * layout.procs_per_worker + role.proc_index if is_worker else undefined, role.worker or 0
            )
    return comms


def _null() -> Any:
    from mpi4py import MPI

    return MPI.COMM_NULL


@dataclass(slots=True)
class Communicators:
    """The calling rank's communicators; `MPI.COMM_NULL` where it is not a member.

    run      all ranks of this rank's fold (one training run), in world-rank order
    group    all ranks of this rank's group
    block    master-worker: master m (rank 0) + the leader of each of its workers (w + 1)
    masters  master-worker: the masters of the fold, top master = rank 0
    worker   the processes of this rank's worker, leader = rank 0
    leaders  allreduce: the leaders of all workers of the fold, worker w = rank w
    stage    allreduce with several processes per worker: process p of every worker of the
             fold, worker w = rank w (pipeline replicas reduce stage p's gradient over it)
    """

    world: Any
    role: Role
    run: Any = field(default_factory=_null)
    group: Any = field(default_factory=_null)
    block: Any = field(default_factory=_null)
    masters: Any = field(default_factory=_null)
    worker: Any = field(default_factory=_null)
    leaders: Any = field(default_factory=_null)
    stage: Any = field(default_factory=_null)

    def free(self) -> None:
        """Free the sub-communicators `split` made (never `world`); safe to call twice."""
        from mpi4py import MPI

        for name in ("run", "group", "block", "masters", "worker", "leaders", "stage"):
            comm = getattr(self, name)
            if comm != MPI.COMM_NULL:
                comm.Free()
            setattr(self, name, MPI.COMM_NULL)

    def __enter__(self) -> Communicators:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()
