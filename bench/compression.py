"""--compression against no compression, same job: bytes on the wire, samples/s, accuracy.

4 ranks of the allreduce topology (`mpiexec -n 4 python bench/_compression_worker.py`)
train the large MLP of _common.MLPS (~7.4M parameters with digits' 64 inputs: the
allreduce is bandwidth-bound) on digits with Adam (lr 1e-3), once per compression, one
after the other in the same processes. Prints, per compression, the gradient bytes each
rank hands to MPI per step, samples/s of the epochs after the first, the final validation
accuracy, and each as a ratio against `none`. Rank order and data are the same for every
run (same seed), so the accuracies differ by what the compression changed.

Usage: python bench/compression.py [--quick] [--epochs N]   (default 20 epochs; --quick: 3)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import header, run_mpi, table

RANKS = 4
COMPRESSIONS = ["none", "fp16", "bf16", "topk(0.01)", "powersgd(4)"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="3 epochs per compression instead of --epochs")
    p.add_argument(
        "--epochs",
        type=int,
        default=20,
        help="epochs per compression (default 20: 240 steps, enough for the MLP to learn digits)",
    )
    args = p.parse_args()
    epochs = 3 if args.quick else args.epochs
    header(f"--compression on {RANKS} allreduce ranks, large MLP on digits, {epochs} epochs each")
    argv = [
        str(Path(__file__).with_name("_compression_worker.py")),
        "--plan",
        json.dumps(COMPRESSIONS),
        "--epochs",
        str(epochs),
    ]
    with tempfile.TemporaryDirectory(prefix="nbdist-bench-") as runs:
        runs_out = run_mpi(RANKS, argv + ["--runs-dir", runs], timeout=3000)[0]["runs"]
    base = runs_out[0]
    print(f"{base['params']:,} parameters: {4 * base['params'] / 1e6:.1f} MB of fp32 gradient per step")
    rows = [
        [
            r["compression"],
            r["bytes_per_step"] / 1e6,
            base["bytes_per_step"] / r["bytes_per_step"],
            r["samples_per_s"],
            r["samples_per_s"] / base["samples_per_s"],
            r["val_acc"],
            r["val_acc"] - base["val_acc"],
        ]
        for r in runs_out
    ]
    table(
        rows,
        ["compression", "MB sent/rank/step", "x less than none", "samples/s", "x none", "final val_acc", "vs none"],
    )


if __name__ == "__main__":
    main()
