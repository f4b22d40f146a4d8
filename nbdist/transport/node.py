"""Where a process is: the launch's world communicator, and which rank of its node it is
(the launcher says so, or MPI works it out)."""

from __future__ import annotations

import os
from typing import Any

from mpi4py import MPI

__all__ = ["local_rank", "world"]

# Open MPI's mpiexec sets the first; srun the second.
LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")


def local_rank(comm: Any) -> int:
    """This rank's index among the ranks of `comm` on its node. Collective over `comm`
    when no launcher variable is set (every rank of one launch sees the same variables,
    so either every rank splits or none does)."""
    for name in LOCAL_RANK_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank()
    finally:
        node.Free()


def world() -> Any:
    """Every rank of the launch (COMM_WORLD): what a run or a study spans unless it is
    given a communicator."""
    return MPI.COMM_WORLD
