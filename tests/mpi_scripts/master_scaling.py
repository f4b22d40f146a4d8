"""A master with many workers, for tests/test_master_scaling_mpi.py: one job (one start
of its N ranks) for five runs.

Usage: mpiexec -n N python tests/mpi_scripts/master_scaling.py RUNS_DIR

1. `records`: N - 1 asynchronous Downpour workers pushing every batch of 8 of the small
   digits MLP for 10 epochs (the master applies updates far faster than any
   per-interval record rate; the rates of records and of updates are those of a
   longer run: they hardly change with its length).
2. `w2` and `wN-1`, then `sync-w2` and `sync-wN-1`: the master's peak memory with 2
   workers (on the first 3 ranks, through `nbdist.train(comm=...)`) and with N - 1, on
   the same 2.6M-parameter MLP for one epoch, pushing every batch, asynchronous then
   synchronous, so that a buffer per worker would show. The master measures its peak
   resident memory per run: the kernel's high-water mark (VmHWM), reset before the run
   (/proc/self/clear_refs).
Rank 0 prints one JSON line at the end: {"2": MB, "N-1": MB, "sync 2": MB, "sync N-1": MB}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from mpi4py import MPI

ROOT = Path(__file__).resolve().parents[2]
from rank_main import run_or_abort  # noqa: E402
from torch import nn  # noqa: E402

import nbdist  # noqa: E402

HIDDEN = 35_000  # 64 * 35000 + 35000 + 35000 * 10 + 10 parameters: 2.6M


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(64, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 10))


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def main() -> None:
    world = MPI.COMM_WORLD
    nbdist.train(
        str(ROOT / "examples" / "digits_mlp.py"),
        epochs=10,
        batch_size=8,
        runs_dir=sys.argv[1],
        run_name="records",
        store="off",
        quiet=True,
    )
    peaks = {}
    for synchronous in (False, True):
        for workers in (2, world.Get_size() - 1):
            inside = world.Get_rank() <= workers
            comm = world.Split(0 if inside else MPI.UNDEFINED, world.Get_rank())
            key, run_name = (f"sync {workers}", f"sync-w{workers}") if synchronous else (str(workers), f"w{workers}")
            if inside:
                Path("/proc/self/clear_refs").write_text("5")  # resets the high-water mark
                nbdist.train(
                    build_model,
                    loss=nn.CrossEntropyLoss(),
                    comm=comm,
                    workers=workers,
                    epochs=1,
                    batch_size=16,
                    algorithm="downpour",
                    master_optimizer="sgd(lr=0.01)",
                    synchronous=synchronous,
                    runs_dir=sys.argv[1],
                    run_name=run_name,
                    store="off",
                    quiet=True,
                )
                if comm.Get_rank() == 0:
                    peaks[key] = peak_rss_mb()
                comm.Free()
            world.Barrier()
    if world.Get_rank() == 0:
        print(json.dumps(peaks), flush=True)


if __name__ == "__main__":
    run_or_abort(main)
