"""Run `python -m nbdist train ...` command lines, each on its own number of ranks, in ONE job.

Usage: mpiexec -n N python tests/mpi_scripts/resize_runs.py RUNS.json

RUNS.json holds a list of [ranks, argv]: run I trains on the first `ranks` ranks of the
job (a communicator of its own, as a `-n ranks` job would have), through `nbdist.cli.main`
(the very function behind `python -m nbdist`), while the job's other ranks wait. A run and
its resumes on more or fewer ranks then cost one start of Python, torch and MPI, not one
per size (train_many.py does the same for runs of one size).

After each run, rank 0 prints `nbdist-test: run I rc=RC` to stdout AND to stderr, so a test
can cut either stream into the runs' parts. The job exits with the largest exit status.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mpi4py import MPI  # noqa: E402
from train_many import say_done  # noqa: E402

import nbdist.roles.runner as runner  # noqa: E402
from nbdist.cli import main as nbdist_main  # noqa: E402


def run_all(path: str) -> int:
    runs = json.loads(Path(path).read_text())
    world = MPI.COMM_WORLD
    rank, worst = world.Get_rank(), 0
    for i, (ranks, argv) in enumerate(runs):
        sub = world.Split(0 if rank < ranks else MPI.UNDEFINED, rank)
        rc = 0
        if sub != MPI.COMM_NULL:
            runner.world = lambda sub=sub: sub  # what a run spans when not told (run_rank)
            rc = nbdist_main(["train", *argv])
            sub.Free()
        codes = world.gather(rc, root=0)
        if rank == 0:
            worst = max(worst, *codes)
            say_done(i, max(codes))
    return worst


if __name__ == "__main__":
    sys.exit(run_all(sys.argv[1]))
