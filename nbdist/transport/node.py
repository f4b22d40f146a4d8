"""Where a process is: the launch's world communicator, and which rank of its node it is
(the launcher says so, or MPI works it out)."""

from __future__ import annotations

import os
from typing import Any

from mpi4py import MPI

__all__ = ["local_rank", "polling_suits_node", "ranks_fit_cores", "world"]

# Open MPI's mpiexec sets the first; srun the second.
LOCAL_RANK_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")
# How many ranks of the launch share this node: Open MPI's mpiexec says so.
LOCAL_SIZE_VARIABLE = "OMPI_COMM_WORLD_LOCAL_SIZE"
# A JupyterHub single-user server sets the first; a batch job (SLURM, PBS) one of the
# others: the node is then the job's allocation, not a login node shared with others.
JUPYTERHUB_VARIABLE = "JUPYTERHUB_USER"
BATCH_JOB_VARIABLES = ("SLURM_JOB_ID", "PBS_JOBID")


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


def ranks_fit_cores(threads: int = 1) -> bool:
    """Whether this node's ranks of the launch, `threads` busy threads each, fit the cores
    this process may run on: then a rank that polls without sleeping takes no core another
    rank needs. False when oversubscribed, and when the launcher does not say how many
    ranks share the node (srun, a singleton), since polling on a shared core would slow
    the rank that computes. A rank bound to fewer cores than its node's ranks counts as
    not fitting: without asking the others, it cannot tell whether they share its core."""
    local = os.environ.get(LOCAL_SIZE_VARIABLE, "")
    if not local.isdigit():
        return False
    return int(local) * max(threads, 1) <= len(os.sched_getaffinity(0))


def polling_suits_node(threads: int = 1) -> bool:
    """--busy-poll auto: whether this rank's waits may keep its core busy. Where the
    node's ranks fit its cores, except under JupyterHub outside a batch job: a notebook's
    engines on a login node share it with other people, whose cores look idle now."""
    if os.environ.get(JUPYTERHUB_VARIABLE) and not any(os.environ.get(v) for v in BATCH_JOB_VARIABLES):
        return False
    return ranks_fit_cores(threads)


def world() -> Any:
    """Every rank of the launch (COMM_WORLD): what a run or a study spans unless it is
    given a communicator."""
    return MPI.COMM_WORLD
