"""How this process starts MPI: as one rank of a launched job, or on its own.

A process that no MPI launcher started (`python -m nbdist train` typed alone, a bad
option's error, a dataset made by one process) is a *singleton*: MPI_Init makes it a world
of one. Open MPI tries each of its transports at MPI_Init, and the libfabric one (btl ofi)
probes the network for about a second, though a singleton has nobody to reach. So a
singleton takes only self and shared memory, the transports nbdist's one-node jobs take
(launch.mpi_env), for its own MPI_Init; the processes it starts (a launch's mpiexec) get
the environment as it was. A setting of the user's (OMPI_MCA_btl) is kept.
"""

from __future__ import annotations

import os
import sys

__all__ = ["launched", "start_mpi", "world_rank"]

# Set in every rank by Open MPI's mpiexec, by a PMIx launcher (srun --mpi=pmix, prterun)
# or by a PMI-1/2 launcher (MPICH's hydra, srun --mpi=pmi2).
LAUNCHER_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE")
TRANSPORTS_VARIABLE = "OMPI_MCA_btl"
SINGLETON_TRANSPORTS = "self,sm"


def launched() -> bool:
    """Whether an MPI launcher started this process (else MPI makes it a world of one)."""
    return any(name in os.environ for name in LAUNCHER_VARIABLES)


def start_mpi() -> None:
    """Initialise MPI here (importing mpi4py.MPI does), at once when on its own."""
    if "mpi4py.MPI" in sys.modules or launched() or TRANSPORTS_VARIABLE in os.environ:
        from mpi4py import MPI  # noqa: F401 - the import initialises MPI

        return
    os.environ[TRANSPORTS_VARIABLE] = SINGLETON_TRANSPORTS
    try:
        from mpi4py import MPI  # noqa: F401,F811 - read by MPI_Init, here
    finally:
        del os.environ[TRANSPORTS_VARIABLE]


def world_rank() -> int:
    """This process's rank in its launch: a singleton is rank 0 without starting MPI."""
    if not launched() and "mpi4py.MPI" not in sys.modules:
        return 0
    try:
        from mpi4py import MPI

        return MPI.COMM_WORLD.Get_rank()
    except Exception:  # no MPI: a single process is rank 0
        return 0
