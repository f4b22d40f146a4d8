"""Run several `python -m nbdist train ...` command lines, one after the other, in ONE job.

Usage: mpiexec -n N python tests/mpi_scripts/train_many.py RUNS.json

RUNS.json holds a list of argv lists (what follows `python -m nbdist train`, or a whole
command line of another command: `study ...`, `slurm-script ...`). Each is handed to
`nbdist.cli.main`, the very function behind `python -m nbdist`, so the runs go through
the real option parsing, layout, topologies and files. Starting Python, torch and MPI
costs seconds per rank on a small box while a digits run trains in well under a
second, so one job for a batch of runs keeps the integration tests affordable.

After each run, rank 0 prints `nbdist-test: run I rc=RC` to stdout AND to stderr, so a
test can cut either stream into the runs' parts (the CLI prints its one-line errors on
rank 0's stderr). The job exits with the largest exit status. A failure inside a run
that is not the user's input aborts the whole job (the CLI calls MPI Abort), so no rank
hangs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from mpi4py import MPI

from nbdist.cli import COMMANDS
from nbdist.cli import main as nbdist_main


def run_all(path: str) -> int:
    runs = json.loads(Path(path).read_text())
    world = MPI.COMM_WORLD
    worst = 0
    for i, argv in enumerate(runs):
        rc = nbdist_main(argv if argv[:1] and argv[0] in COMMANDS else ["train", *argv])
        worst = max(worst, rc)
        world.Barrier()
        if world.Get_rank() == 0:
            say_done(i, rc)
    return worst


def say_done(i: int, rc: int) -> None:
    """Rank 0: run i ended with exit status rc, on both streams (see above)."""
    marker = f"nbdist-test: run {i} rc={rc}"
    print(marker, flush=True)
    print(marker, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(run_all(sys.argv[1]))
