"""nbdist's allreduce topology against PyTorch DistributedDataParallel (gloo), same run.

Both sides train the same MLP (same seed) with the same per-rank batch size and plain SGD
on 2 ranks, one torch thread per rank, on synthetic data fancy-indexed per step:

  nbdist   `mpiexec -n 2 python bench/_allreduce_worker.py`: the hot path of run_allreduce
           (TorchBackend + MpiReducer, one Iallreduce per bucket started from inside
           backward, flat SGD step), and nbdist.train(topology="allreduce") itself, with
           a checkpoint at the end only (as the DDP loop, which writes none) and with one
           every epoch (nbdist's default: an epoch here is a few steps, so this row shows
           what writing the weights each time costs);
  DDP      torch.multiprocessing spawn, gloo on 127.0.0.1, DistributedDataParallel with its
           defaults (25 MB buckets), torch.optim.SGD.

Warm-up steps are excluded; each side keeps its best timed round, over alternating
launches (nbdist, DDP, nbdist, DDP: load that comes and goes hits both). Prints samples/s
(summed over ranks) and the ratio nbdist/DDP for a small (~22k parameters,
latency-bound) and a large (~7.9M, bandwidth-bound) MLP, then a bucket-size sweep on the
large one (a bucket never splits a tensor, so caps below the largest tensor, 4 MB here,
all give one bucket per layer). --busy-poll (default auto) is nbdist's option, for runs
beside other work. Usage: python bench/allreduce_vs_ddp.py [--quick] [--busy-poll MODE]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import MLPS, aim, batch_indices, count_params, header, mlp, run_mpi, synthetic, table

DATA_SAMPLES = 4096  # as in _allreduce_worker.py
RANKS = 2
DEFAULT_BUCKET_MB = 2.0
# The worker's nbdist.train measurements and how the table names them.
TRAIN_ROWS = {
    "train": "nbdist.train, checkpoint at the end",
    "train_every_epoch": "nbdist.train, checkpoint every epoch",
}


# ----------------------------------------------------------------------------- DDP side
def _ddp_rank(rank: int, world: int, port: int, plan: dict, cfg: dict, queue) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        for model, p in plan.items():
            sizes = MLPS[model]
            torch.manual_seed(0)
            net = DDP(mlp(sizes))
            opt = torch.optim.SGD(net.parameters(), lr=cfg["lr"])
            loss_fn = nn.CrossEntropyLoss()
            x_all, y_all = synthetic(DATA_SAMPLES, sizes[0], sizes[-1], seed=1 + rank)
            batches = batch_indices(DATA_SAMPLES, cfg["batch_size"], 64, seed=100 + rank)
            step = _ddp_step(net, opt, loss_fn, x_all, y_all, batches)
            for k in range(p["warmup"]):
                step(k)
            rounds = []
            for _ in range(p["rounds"]):
                dist.barrier()
                t0 = time.perf_counter()
                for k in range(p["steps"]):
                    step(k)
                dist.barrier()
                rounds.append(time.perf_counter() - t0)
            samples = p["steps"] * cfg["batch_size"] * world
            results[model] = {
                "samples_per_s": samples / min(rounds),
                "median_samples_per_s": samples / float(np.median(rounds)),
            }
            del net, opt, step
        if rank == 0:
            queue.put(results)
    finally:
        dist.destroy_process_group()


def _ddp_step(net, opt, loss_fn, x_all, y_all, batches) -> Callable[[int], None]:
    """Step k of DDP training on batch k % 64 (fancy-indexed, as on the nbdist side)."""
    import torch

    def step(k: int) -> None:
        idx = batches[k % 64]
        x, y = torch.from_numpy(x_all[idx]), torch.from_numpy(y_all[idx])
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()

    return step


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ddp(plan: dict, cfg: dict) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_ddp_rank, args=(RANKS, _free_port(), plan, cfg, queue), nprocs=RANKS, join=True)
    return queue.get()


# ----------------------------------------------------------------------------- nbdist side
def run_nbdist(plan: dict, cfg: dict, train_epochs: int) -> dict:
    argv = [
        str(Path(__file__).with_name("_allreduce_worker.py")),
        "--busy-poll",
        cfg["busy_poll"],
        "--plan",
        json.dumps(plan),
        "--batch-size",
        str(cfg["batch_size"]),
        "--lr",
        str(cfg["lr"]),
        "--train-epochs",
        str(train_epochs),
    ]
    with tempfile.TemporaryDirectory(prefix="nbdist-bench-") as runs:
        return run_mpi(RANKS, argv + ["--runs-dir", runs])[0]["models"]


def _better(a: dict | None, b: dict) -> dict:
    return b if a is None or b["samples_per_s"] > a["samples_per_s"] else a


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps, bucket sizes and launches (about 40 s)")
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank per step (default 32)")
    p.add_argument(
        "--buckets",
        type=float,
        nargs="+",
        default=None,
        help="bucket sizes (MB) for the large model's sweep (default 0.5 2 8 32)",
    )
    p.add_argument(
        "--launches", type=int, default=None, help="alternating nbdist/DDP launches, best kept (default 2, quick 1)"
    )
    p.add_argument(
        "--busy-poll", default="auto", choices=("auto", "on", "off"), help="nbdist's --busy-poll (default auto)"
    )
    args = p.parse_args()

    header(f"nbdist allreduce vs PyTorch DDP (gloo), {RANKS} ranks, SGD, batch {args.batch_size}/rank")
    q = args.quick
    sweep = args.buckets or ([2.0, 32.0] if q else [0.5, 2.0, 8.0, 32.0])
    if DEFAULT_BUCKET_MB not in sweep:
        sweep = [DEFAULT_BUCKET_MB, *sweep]
    plan = {
        "small": dict(
            steps=200 if q else 500,
            warmup=30 if q else 50,
            rounds=3 if q else 5,
            buckets=[DEFAULT_BUCKET_MB],
            train_steps=100 if q else 200,
        ),
        "large": dict(
            steps=5 if q else 8, warmup=2 if q else 3, rounds=2 if q else 3, buckets=sweep, train_steps=8 if q else 10
        ),
    }
    cfg = dict(batch_size=args.batch_size, lr=0.01, busy_poll=args.busy_poll)
    launches = args.launches or (1 if q else 2)
    print(
        f"   models: small {MLPS['small']} = {count_params(MLPS['small']):,} parameters, "
        f"large {MLPS['large']} = {count_params(MLPS['large']):,} parameters"
    )
    print(f"   {launches} alternating launch(es) per side; each keeps its best round after warm-up")

    nb: dict = {m: {"loops": {}, "train": None, "train_every_epoch": None} for m in plan}
    ddp: dict = {m: None for m in plan}
    t0 = time.time()
    for _ in range(launches):
        for model, r in run_nbdist(plan, cfg, train_epochs=3 if q else 4).items():
            for loop in r["loops"]:
                nb[model]["loops"][loop["bucket_mb"]] = _better(nb[model]["loops"].get(loop["bucket_mb"]), loop)
            for kind in ("train", "train_every_epoch"):
                if r[kind]:
                    nb[model][kind] = _better(nb[model][kind], r[kind])
        for model, r in run_ddp(plan, cfg).items():
            ddp[model] = _better(ddp[model], r)
    print(f"   measured in {time.time() - t0:.0f} s")
    print()

    rows, ratios, sweep_rows, train_ratios = [], {}, [], {}
    for model in plan:
        d = ddp[model]["samples_per_s"]
        default = nb[model]["loops"][DEFAULT_BUCKET_MB]["samples_per_s"]
        ratios[model] = default / d
        n = count_params(MLPS[model])
        label = f"{model} ({n / 1e3:.0f}k params)" if n < 1e6 else f"{model} ({n / 1e6:.1f}M params)"
        rows.append([label, "hot loop, 2 MB buckets", default, d, default / d])
        for kind, measured_as in TRAIN_ROWS.items():
            if nb[model][kind]:
                t = nb[model][kind]["samples_per_s"]
                rows.append([label, measured_as, t, d, t / d])
                train_ratios[model, kind] = t / d
    for mb, r in sorted(nb["large"]["loops"].items()):
        sweep_rows.append(
            [
                mb,
                r["buckets"],
                r["samples_per_s"],
                r["median_samples_per_s"],
                r["samples_per_s"] / ddp["large"]["samples_per_s"],
            ]
        )
    table(rows, ["model", "nbdist measured as", "nbdist samples/s", "DDP samples/s", "ratio"])
    print("large MLP, bucket sizes (nbdist hot loop; a bucket never splits a tensor; DDP: its default 25 MB):")
    table(sweep_rows, ["bucket MB", "buckets", "best samples/s", "median samples/s", "vs DDP"])
    aim("small MLP, nbdist/DDP samples/s", 2.0, ratios["small"])
    aim("large MLP, nbdist/DDP samples/s", 1.2, ratios["large"])
    if ("small", "train") in train_ratios:
        # What nbdist.train reached at 2cf577e (issue 25), checkpoints as the DDP loop's.
        aim("small MLP, nbdist.train/DDP samples/s", 2.7, train_ratios["small", "train"])
        aim("large MLP, nbdist.train/DDP samples/s", 1.5, train_ratios["large", "train"])


if __name__ == "__main__":
    main()
