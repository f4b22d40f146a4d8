"""The nbdist side of compression.py; run under `mpiexec -n N` (not on its own).

For each --compression of --plan, `nbdist.train(topology="allreduce", compression=...)`
trains the large MLP of _common.MLPS (its input layer fitted to digits' 64 pixels) on
digits; rank 0 reports samples/s of the epochs after the first (the warm-up), the final
validation accuracy, and the bytes each rank handed to MPI per step (its 'train' records).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from _common import MLPS, emit, mlp
from mpi4py import MPI

import nbdist
from nbdist.datasets import digits
from nbdist.metrics import read_log


def one_run(comm, compression: str, args) -> dict | None:
    sizes = (64, *MLPS["large"][1:])
    runs = args.runs_dir or tempfile.mkdtemp(prefix="nbdist-bench-")
    result = nbdist.train(
        lambda: mlp(sizes),
        data=digits(),
        comm=comm,
        topology="allreduce",
        epochs=args.epochs,
        batch_size=args.batch_size,
        compression=compression,
        worker_optimizer=f"adam(lr={args.lr})",
        runs_dir=runs,
        run_name=f"compression-{compression}",
        quiet=True,
        seed=0,
    )
    if result is None:
        return None
    later = result.history[1:] or result.history
    samples = sum(h["samples"] for h in later)
    seconds = sum(h["seconds"] for h in later)
    steps = len(result.history) * math.ceil(result.history[0]["samples"] / (args.batch_size * comm.Get_size()))
    sent = sum(r["values"].get("bytes_sent", 0) for r in read_log(result.run_dir, "train") if r["rank"] == 0)
    return {
        "compression": compression,
        "samples_per_s": samples / seconds,
        "val_acc": result.final["val_acc"],
        "bytes_per_step": sent / steps,
        "params": sum(p.numel() for p in mlp(sizes).parameters()),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--plan", required=True, help="JSON list of --compression values")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--runs-dir", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    results = [one_run(comm, compression, args) for compression in json.loads(args.plan)]
    if comm.Get_rank() == 0:
        emit({"ranks": comm.Get_size(), "runs": results})


if __name__ == "__main__":
    main()
