"""What --sync-batchnorm costs: allreduce training throughput with synchronised BatchNorm
against plain (per-rank) BatchNorm, same model, data, seed and ranks.

examples/digits_cnn.py (one BatchNorm2d of 16 channels: two allreduces of 33 floats per
step, one in the forward pass and one in the backward) on `--ranks` allreduce ranks,
batch 32 per rank; plain and synchronised runs alternate in ONE mpiexec job, so load
that comes and goes hits both. samples/s is taken over the middle epochs (not the first,
warm-up, nor the last, final validation); each side keeps its best round. No aim is
set: the figure says what the two reductions per layer and step cost.

Usage: python bench/sync_batchnorm.py [--quick] [--ranks N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import header, run_mpi, table

HERE = Path(__file__).resolve().parent


def middle_rate(history: list[dict]) -> float:
    middle = history[1:-1] or history
    return statistics.mean(epoch["samples_per_s"] for epoch in middle)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer epochs and rounds")
    p.add_argument("--ranks", type=int, default=4)
    args = p.parse_args()
    epochs, rounds = (4, 2) if args.quick else (8, 3)

    header(f"synchronised BatchNorm: digits CNN, allreduce on {args.ranks} ranks, {rounds} rounds of {epochs} epochs")
    with tempfile.TemporaryDirectory() as runs_dir:
        results = run_mpi(
            args.ranks,
            [
                str(HERE / "_sync_batchnorm_worker.py"),
                "--epochs",
                str(epochs),
                "--rounds",
                str(rounds),
                "--runs-dir",
                runs_dir,
            ],
            timeout=900,
        )
    rates = {False: [], True: []}
    for result in results:
        rates[result["synchronised"]].append(middle_rate(result["history"]))
    rows = [
        [f"round {k + 1}", plain, synced, synced / plain]
        for k, (plain, synced) in enumerate(zip(rates[False], rates[True], strict=True))
    ]
    best_plain, best_synced = max(rates[False]), max(rates[True])
    rows.append(["best", best_plain, best_synced, best_synced / best_plain])
    table(rows, ["", "plain samples/s", "synchronised samples/s", "ratio"])
    print(f"synchronised / plain BatchNorm (best rounds): {best_synced / best_plain:.2f}x (no aim set)")


if __name__ == "__main__":
    main()
