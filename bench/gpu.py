"""nbdist on GPUs: run on a GPU node (one rank per GPU); fails clearly where torch sees none.

1. allreduce: nbdist's allreduce hot path with each rank's model on its GPU (--device
   cuda: TorchBackend's flat buffers on the GPU), its buckets reduced two ways, as
   --allreduce-backend does in a run: nccl (a torch.distributed NCCL group made from the
   MPI ranks, reduced on the GPU) and mpi (the transport's staging: CUDA-aware MPI handed
   the device buffer where Open MPI is CUDA-aware, else each bucket through a pinned host
   buffer on a CUDA stream); against PyTorch DistributedDataParallel on NCCL, same MLPs,
   batch and SGD; samples/s and the ratios.
2. master/worker: a worker's flat device buffer sent to a host master and the reply of
   the same size taken back, through the staging object, pinned host buffer vs
   device-direct (the latter only where MPI is CUDA-aware); ms per round trip.

Part 1 runs in each precision (--precision fp32, bf16, fp16: AMP off and on), DDP under
torch.autocast with a GradScaler for fp16, so each ratio compares like with like.

Usage: python bench/gpu.py [--quick] [--models small,large]   (--cpu-dry-run: every part on the CPU, gloo for
DDP and for nbdist's torch.distributed reducer, to check the script on a machine without
a GPU; its numbers say nothing of GPUs)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import MLPS, batch_indices, count_params, header, mlp, run_mpi, synthetic, table

DATA_SAMPLES = 4096  # as in _gpu_worker.py
WORKER = str(Path(__file__).with_name("_gpu_worker.py"))


def _ddp_rank(rank: int, world: int, port: int, plan: dict, cfg: dict, queue) -> None:
    import torch

    autocast_dtypes = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    on_gpu = cfg["device"] == "cuda"
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("nccl" if on_gpu else "gloo", rank=rank, world_size=world)
    results = {}
    try:
        for model, precision in [(m, pr) for m in plan["models"] for pr in plan["precisions"]]:
            sizes = MLPS[model]
            torch.manual_seed(0)
            net = DDP(mlp(sizes).to(device), device_ids=[rank] if on_gpu else None)
            opt = torch.optim.SGD(net.parameters(), lr=cfg["lr"])
            loss_fn = nn.CrossEntropyLoss()
            dtype = autocast_dtypes[precision]
            scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
            x_np, y_np = synthetic(DATA_SAMPLES, sizes[0], sizes[-1], seed=1 + rank)
            x_all, y_all = torch.from_numpy(x_np).to(device), torch.from_numpy(y_np).to(device)
            batches = [
                torch.from_numpy(b).to(device)
                for b in batch_indices(DATA_SAMPLES, cfg["batch_size"], 64, seed=100 + rank)
            ]
            step = _ddp_step(net, opt, loss_fn, scaler, dtype, device, x_all, y_all, batches)
            for k in range(plan["warmup"]):
                step(k)
            rounds = []
            for _ in range(plan["rounds"]):
                if on_gpu:
                    torch.cuda.synchronize(device)
                dist.barrier()
                t0 = time.perf_counter()
                for k in range(plan["steps"]):
                    step(k)
                if on_gpu:
                    torch.cuda.synchronize(device)
                dist.barrier()
                rounds.append(time.perf_counter() - t0)
            results[f"{model}/{precision}"] = plan["steps"] * cfg["batch_size"] * world / min(rounds)
        if rank == 0:
            queue.put(results)
    finally:
        dist.destroy_process_group()


def _ddp_step(net, opt, loss_fn, scaler, dtype, device, x_all, y_all, batches) -> Callable[[int], None]:
    """Step k of DDP training under autocast at `dtype` (None: fp32), with loss scaling."""
    import torch

    def step(k: int) -> None:
        idx = batches[k % 64]
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = loss_fn(net(x_all[idx]), y_all[idx])
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    return step


def run_ddp(world: int, plan: dict, cfg: dict) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_ddp_rank, args=(world, port, plan, cfg, queue), nprocs=world, join=True)
    return queue.get()


def gpus_or_exit(dry_run: bool) -> int:
    import torch

    if dry_run:
        return 2
    if not torch.cuda.is_available():
        raise SystemExit(
            f"bench/gpu.py needs a GPU: torch {torch.__version__} (CUDA build: "
            f"{torch.version.cuda or 'none'}) sees none on {socket.gethostname()}; run it on a GPU node "
            f"with a CUDA build of torch (or --cpu-dry-run to check the script)"
        )
    return torch.cuda.device_count()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer steps")
    p.add_argument("--batch-size", type=int, default=64, help="samples per rank per step (default 64)")
    p.add_argument("--cpu-dry-run", action="store_true", help="run every part on the CPU to check the script")
    p.add_argument("--models", default="small,large", help=f"MLPs of part 1, comma-separated (of {', '.join(MLPS)})")
    p.add_argument("--json", help="also write the figures to this JSON file")
    args = p.parse_args()
    gpus = gpus_or_exit(args.cpu_dry_run)
    device = "cpu" if args.cpu_dry_run else "cuda"
    q = args.quick
    header(f"nbdist on {'the CPU (dry run)' if args.cpu_dry_run else f'{gpus} GPU(s)'}, batch {args.batch_size}/rank")
    plan = dict(
        models=args.models.split(","),
        precisions=["fp32", "bf16", "fp16"],
        steps=50 if q else 200,
        warmup=10 if q else 20,
        rounds=2 if q else 3,
    )
    cfg = dict(batch_size=args.batch_size, lr=0.01, device=device)
    common = ["--device", device, "--batch-size", str(args.batch_size)]

    torch_way = "gloo" if args.cpu_dry_run else "nccl"
    nb = {
        way: run_mpi(
            gpus,
            [WORKER, "--part", "allreduce", "--plan", json.dumps(plan), "--allreduce-backend", way, *common],
            timeout=600,
        )[0]
        for way in (torch_way, "mpi")
    }
    ddp = run_ddp(gpus, plan, cfg)
    rows = []
    for model in plan["models"]:
        n = count_params(MLPS[model])
        for precision in plan["precisions"]:
            key = f"{model}/{precision}"
            ours, mpi = nb[torch_way]["results"][key], nb["mpi"]["results"][key]
            rows.append(
                [
                    f"{model} ({n:,} params)",
                    precision,
                    ours["samples_per_s"],
                    mpi["way"],
                    mpi["samples_per_s"],
                    ddp[key],
                    ours["samples_per_s"] / ddp[key],
                    mpi["samples_per_s"] / ddp[key],
                ]
            )
    print(
        f"1. allreduce over {gpus} rank(s), nbdist ({torch_way}; MPI, "
        f"{'CUDA-aware' if nb['mpi']['cuda_aware'] else 'not CUDA-aware'}) vs DDP ({torch_way}):"
    )
    table(
        rows,
        [
            "model",
            "precision",
            f"nbdist {torch_way} samples/s",
            "nbdist mpi staging",
            "nbdist mpi samples/s",
            "DDP samples/s",
            f"{torch_way}/DDP",
            "mpi/DDP",
        ],
    )

    trips = dict(steps=20 if q else 100, warmup=5, floats=[2**20, 10 * 2**20])
    st = run_mpi(2, [WORKER, "--part", "staging", "--plan", json.dumps(trips), *common], timeout=600)[0]
    print("2. a worker's flat buffer to a host master and back (1 master + 1 worker, 2 ranks):")
    table(
        [[f"{r['floats'] / 2**20:.0f}M floats", r["way"], r["ms_per_trip"], r["gb_per_s"]] for r in st["results"]],
        ["buffer", "staging", "ms per round trip", "GB/s"],
    )
    if not st["cuda_aware"]:
        print("   device-direct not measured: this MPI is not CUDA-aware (MPIX_Query_cuda_support() is 0)")
    if args.json:
        columns = ["model", "precision", "nbdist_torch", "mpi_way", "nbdist_mpi", "ddp", "torch_vs_ddp", "mpi_vs_ddp"]
        figures = {
            "ranks": gpus,
            "torch_backend": torch_way,
            "cuda_aware": nb["mpi"]["cuda_aware"],
            "allreduce": [dict(zip(columns, row, strict=True)) for row in rows],
            "staging": st["results"],
        }
        Path(args.json).write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
