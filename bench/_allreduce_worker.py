"""The nbdist side of allreduce_vs_ddp.py; run under `mpiexec -n N` (not on its own).

For each model of --plan, these measurements, all with the same batch size and SGD:

loop   the per-step hot path of `run_allreduce`, step for step: fancy-index a batch,
       TorchBackend.compute_gradients (the MpiReducer starts one Iallreduce per bucket
       from inside backward), reduce the four-float trailer with the gradient, check the
       loss, step the flat SGD; waits as --busy-poll makes them. Repeated for each bucket
       size asked for (a fresh model per size). Warm-up steps are excluded; the best and
       the median of `rounds` timed rounds are reported.
train  `nbdist.train(topology="allreduce")` itself on synthetic data: samples/s of the
       middle epochs as nbdist reports them (the first has the warm-up, the last the
       validation), twice: with a checkpoint at the end only (`checkpoint_every=0`: like
       the DDP loop, which writes none, and like nbdist's default before 2e7f709), and
       with one every epoch (the default since: each one written while the next epoch
       trains).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch
from _common import MLPS, batch_indices, emit, mlp, synthetic
from mpi4py import MPI
from torch import nn

from nbdist.backends.torch import TorchBackend
from nbdist.specs import parse_spec
from nbdist.transport.node import polling_suits_node
from nbdist.transport.reducers import MpiReducer
from nbdist.transport.waiting import poll_without_sleeping

DATA_SAMPLES = 4096


def hot_loop(comm, sizes, args, bucket_mb: float) -> dict:
    rank, size = comm.Get_rank(), comm.Get_size()
    # The waits as a run's with this --busy-poll (nbdist.train sets it at set-up; set here
    # too, so that the loops measured before and after a train wait alike).
    auto = args.busy_poll == "auto"
    poll_without_sleeping(args.busy_poll == "on" or (auto and polling_suits_node()), while_core_free=auto)
    torch.manual_seed(0)
    backend = TorchBackend(mlp(sizes), nn.CrossEntropyLoss())
    opt = backend.make_optimizer(parse_spec(f"sgd(lr={args.lr})"))
    reducer = MpiReducer(comm, backend, max(1, int(bucket_mb * 2**20 / 4)))
    comm.Bcast(backend.params, root=0)
    x_all, y_all = synthetic(DATA_SAMPLES, sizes[0], sizes[-1], seed=1 + rank)
    batches = batch_indices(DATA_SAMPLES, args.batch_size, 64, seed=100 + rank)
    share = 1.0 / size  # equal batch sizes: every rank's share of the step's samples
    trailer = np.zeros(4, np.float32)
    grads = backend.grads

    def step(k: int) -> None:
        x, y = x_all[batches[k % 64]], y_all[batches[k % 64]]
        stats = backend.compute_gradients(x, y, scale=share)
        trailer[:] = (stats.n, stats.loss_sum, stats.metric_sum, 0.0)
        reducer.finish(trailer)
        if not np.isfinite(trailer[1]):
            raise RuntimeError("loss became NaN")
        opt.step(grads)

    for k in range(args.warmup):
        step(k)
    rounds = []
    for _ in range(args.rounds):
        comm.Barrier()
        t0 = time.perf_counter()
        for k in range(args.steps):
            step(k)
        comm.Barrier()
        rounds.append(time.perf_counter() - t0)
    # The replicas must still be identical: proof that every step really reduced the gradient.
    checksums = comm.allgather(float(np.sum(backend.params, dtype=np.float64)))
    if len(set(checksums)) != 1:
        raise RuntimeError(f"replicas diverged (checksums {checksums}): the reduction is broken")
    samples = args.steps * args.batch_size * size
    return {
        "bucket_mb": bucket_mb,
        "buckets": len(reducer.buckets),
        "samples_per_s": samples / min(rounds),
        "median_samples_per_s": samples / float(np.median(rounds)),
    }


def via_train(comm, sizes, args, checkpoint_every: int) -> dict | None:
    import nbdist
    from nbdist.data import ArrayData

    size = comm.Get_size()
    steps = args.train_steps
    n_train = size * args.batch_size * steps
    x, y = synthetic(n_train, sizes[0], sizes[-1], seed=7)
    xv, yv = synthetic(64, sizes[0], sizes[-1], seed=8)
    data = ArrayData(x, y, xv, yv, name="synthetic")
    runs = args.runs_dir or tempfile.mkdtemp(prefix="nbdist-bench-")
    result = nbdist.train(
        lambda: mlp(sizes),
        data=data,
        comm=comm,
        topology="allreduce",
        epochs=args.train_epochs,
        batch_size=args.batch_size,
        worker_optimizer=f"sgd(lr={args.lr})",
        runs_dir=runs,
        quiet=True,
        validate_every=10**6,
        checkpoint_every=checkpoint_every,
        busy_poll=args.busy_poll,
    )  # nbdist's default bucket size
    if result is None:
        return None
    middle = result.history[1:-1] or result.history[-1:]
    samples = sum(h["samples"] for h in middle)
    seconds = sum(h["seconds"] for h in middle)
    return {"samples_per_s": samples / seconds, "epochs_used": len(middle)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--plan",
        required=True,
        help='JSON: {"small": {"steps":..,"warmup":..,"rounds":..,"buckets":[..],"train_steps":..}, ...}',
    )
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--train-epochs", type=int, default=0, help="also run nbdist.train (0: skip)")
    p.add_argument("--runs-dir", default=None)
    p.add_argument("--busy-poll", default="auto", choices=("auto", "on", "off"))
    args = p.parse_args()

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    results = {}
    for model, plan in json.loads(args.plan).items():
        run = argparse.Namespace(**vars(args), **plan)
        sizes = MLPS[model]
        loops = [hot_loop(comm, sizes, run, mb) for mb in plan["buckets"]]
        train = via_train(comm, sizes, run, checkpoint_every=0) if args.train_epochs else None
        every_epoch = via_train(comm, sizes, run, checkpoint_every=1) if args.train_epochs else None
        results[model] = {"loops": loops, "train": train, "train_every_epoch": every_epoch}
    if comm.Get_rank() == 0:
        emit({"ranks": comm.Get_size(), "models": results})


if __name__ == "__main__":
    main()
