"""The one job of tests/test_equivalence_mpi.py: allreduce_equivalence.py's phases on the
first 4 ranks (the 5th waits), then api_train.py's runs on all 5.

Usage: mpiexec -n 5 python tests/mpi_scripts/equivalence_job.py OUT_DIR STEPS RUNS.json

Starting Python, torch and MPI costs seconds per rank on a small box, more than both
scripts' work: one start of 5 ranks serves both. Their outputs are theirs (see each
script): `OK ...` lines on rank 0's stdout, OUT_DIR's files, the runs' directories.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import allreduce_equivalence
import api_train
import torch
from mpi4py import MPI
from rank_main import run_or_abort

from nbdist.transport.probe import free, idle_barrier, split

ALLREDUCE_RANKS = 4
WAIT_SECONDS = 300


def main() -> None:
    out_dir, steps, spec = Path(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    first = split(world, world.Get_rank() < ALLREDUCE_RANKS, world.Get_rank())
    if first != MPI.COMM_NULL:
        allreduce_equivalence.run(first, out_dir, steps)
    free(first)
    idle_barrier(world, WAIT_SECONDS)  # the 5th rank sleeps meanwhile, leaving the cores to the 4
    api_train.run(world, json.loads(spec.read_text()))


if __name__ == "__main__":
    run_or_abort(main)
    allreduce_equivalence.finish()  # (gloo's teardown: see there)
