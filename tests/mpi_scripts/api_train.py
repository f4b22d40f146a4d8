"""`nbdist.train` (the Python API) on the small equivalence model and data.

Usage: mpiexec -n N python tests/mpi_scripts/api_train.py RUNS.json

RUNS.json is a list of keyword dicts for `nbdist.train` (runs_dir, run_name, algorithm,
...); the model, loss and data come from equivalence_common.py, so a test can rebuild
the same initial weights and batches in one process. A dict may say `"ranks": k`: that
run trains on the first k ranks only, through `nbdist.train(comm=...)` with a
sub-communicator (the other ranks wait), so runs of different sizes share one job; and
`"n_train": m` trains on the first m samples of the data (default 96); `"batchnorm": true`
trains build_batchnorm_model instead of build_model.
The runs go one after the other. Rank 0 prints `OK <run_dir>` per run; a failure aborts
the job so that no rank hangs.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import equivalence_common as common
from mpi4py import MPI
from rank_main import run_or_abort
from torch import nn

import nbdist


def main() -> None:
    run(MPI.COMM_WORLD, json.loads(Path(sys.argv[1]).read_text()))


def run(world: MPI.Intracomm, runs: list[dict]) -> None:
    """Train `runs` (keyword dicts, see above) one after the other on the ranks of `world`."""
    for options in runs:
        ranks = options.pop("ranks", world.Get_size())
        n_train = options.pop("n_train", 96)
        build = common.build_batchnorm_model if options.pop("batchnorm", False) else common.build_model
        inside = world.Get_rank() < ranks
        comm = world.Split(0 if inside else MPI.UNDEFINED, world.Get_rank())
        if inside:
            result = nbdist.train(
                build,
                data=functools.partial(common.make_data, n_train),
                loss=nn.CrossEntropyLoss(),
                comm=comm,
                **options,
            )
            # The run's leader (the master, or rank 0) gets the RunResult, the others None.
            if comm.Get_rank() == 0:
                assert result is not None, "rank 0 got no RunResult"
                print(f"OK {result.run_dir}", flush=True)
            else:
                assert result is None, "a rank other than the leader got a RunResult"
            comm.Free()
        world.Barrier()


if __name__ == "__main__":
    run_or_abort(main)
