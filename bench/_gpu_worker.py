"""The MPI side of gpu.py; run under `mpiexec -n N` (not on its own).

--part allreduce  every rank: nbdist's allreduce hot path with the model on its device
                  (TorchBackend placed by --device), its buckets through the reducer
                  --allreduce-backend names (transport/reducers.py, as a run makes it: mpi
                  through the staging, CUDA-aware MPI directly or pinned host buffers; nccl,
                  or gloo on the CPU, on a torch.distributed group made from the ranks), samples/s.
--part staging    2 ranks: rank 1 is a worker whose flat buffer is on its device, rank 0 a
                  host master; rank 1 sends the buffer and takes a reply of the same size,
                  through Staging in each way this MPI offers (pinned always; direct where
                  MPI is CUDA-aware), round trips/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
from _common import MLPS, batch_indices, emit, mlp, synthetic
from mpi4py import MPI
from torch import nn

from nbdist.backends import DeviceRequest
from nbdist.backends.torch import TorchBackend
from nbdist.specs import parse_spec
from nbdist.transport.collectives import Collectives
from nbdist.transport.node import local_rank
from nbdist.transport.reducers import make_reducer
from nbdist.transport.staging import Staging, mpi_is_cuda_aware

DATA_SAMPLES = 4096
WAIT_SECONDS = 300.0  # the deadline of each wait on the other ranks


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allreduce(comm, sizes, args, request: DeviceRequest, precision: str) -> dict:
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.manual_seed(0)
    backend = TorchBackend(mlp(sizes), nn.CrossEntropyLoss(), precision=precision)
    backend.place(request)
    opt = backend.make_optimizer(parse_spec(f"sgd(lr={args.lr})"))
    reducer = make_reducer(
        args.allreduce_backend,
        comm,
        backend,
        max(1, int(args.bucket_mb * 2**20 / 4)),
        Collectives(lambda: WAIT_SECONDS),
        alone_reduces_nothing=False,  # on one GPU, the reducers themselves against DDP's
    )
    x_np, y_np = synthetic(DATA_SAMPLES, sizes[0], sizes[-1], seed=1 + rank)
    x_all, y_all = torch.from_numpy(x_np).to(backend.device), torch.from_numpy(y_np).to(backend.device)
    batches = [
        torch.from_numpy(b).to(backend.device)
        for b in batch_indices(DATA_SAMPLES, args.batch_size, 64, seed=100 + rank)
    ]
    trailer = np.zeros(4, np.float32)

    def step(k: int) -> None:
        idx = batches[k % 64]
        stats = backend.compute_gradients(x_all[idx], y_all[idx], scale=1.0 / size)
        trailer[:] = (stats.n, stats.loss_sum, stats.metric_sum, 0.0)
        reducer.finish(trailer)
        opt.step(backend.rule_grads)

    for k in range(args.warmup):
        step(k)
    rounds = []
    for _ in range(args.rounds):
        _synchronize(backend.device)
        comm.Barrier()
        t0 = time.perf_counter()
        for k in range(args.steps):
            step(k)
        _synchronize(backend.device)
        comm.Barrier()
        rounds.append(time.perf_counter() - t0)
    checksums = comm.allgather(float(backend.rule_params.double().sum()))
    if len(set(checksums)) != 1:
        raise RuntimeError(f"replicas diverged (checksums {checksums}): the reduction is broken")
    samples = args.steps * args.batch_size * size
    way = reducer.way
    reducer.close()
    return {"samples_per_s": samples / min(rounds), "way": way, "device": str(backend.device)}


def staging(comm, floats: int, args, request: DeviceRequest) -> list[dict]:
    """Round trips of a worker's flat device buffer to a host master and back."""
    from nbdist.backends.torch_device import CudaCopier, place

    rank = comm.Get_rank()
    device = place(request).device
    copier = CudaCopier(device) if device.type == "cuda" else None
    ways = [False] + ([True] if mpi_is_cuda_aware() else [])
    results = []
    for aware in ways:
        if rank == 0:  # the master: host buffers, as a CPU master holds them
            message, reply = np.empty(floats, np.float32), np.ones(floats, np.float32)
            for _ in range(args.warmup + args.steps):
                comm.Recv(message, source=1, tag=1)
                comm.Send(reply, dest=1, tag=2)
            continue
        out = Staging(torch.randn(floats, device=device), copier, cuda_aware=aware)
        back = Staging(torch.empty(floats, device=device), copier, cuda_aware=aware)
        trip = _round_trip(comm, out, back)
        for _ in range(args.warmup):
            trip()
        _synchronize(device)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            trip()
        _synchronize(device)
        seconds = (time.perf_counter() - t0) / args.steps
        results.append(
            {"floats": floats, "way": out.way, "ms_per_trip": seconds * 1e3, "gb_per_s": 2 * 4 * floats / seconds / 1e9}
        )
    return results


def _round_trip(comm, out: Staging, back: Staging) -> Callable[[], None]:
    """One message to the master and its reply, through the staging buffers."""

    def trip() -> None:
        comm.Send(out.to_host(), dest=0, tag=1)
        comm.Recv(back.host, source=0, tag=2)
        back.to_device()

    return trip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--part", choices=("allreduce", "staging"), required=True)
    p.add_argument("--plan", required=True, help="JSON: steps, warmup, rounds, models or floats")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--bucket-mb", type=float, default=2.0)
    p.add_argument("--allreduce-backend", default="mpi", choices=("mpi", "nccl", "gloo"))
    p.add_argument("--lr", type=float, default=0.01)
    args = p.parse_args()
    plan = json.loads(args.plan)
    run = argparse.Namespace(**vars(args), **plan)
    comm = MPI.COMM_WORLD
    request = DeviceRequest(args.device, local_rank(comm))
    if args.part == "allreduce":
        results = {
            f"{model}/{precision}": allreduce(comm, MLPS[model], run, request, precision)
            for model in plan["models"]
            for precision in plan["precisions"]
        }
    else:
        results = [r for floats in plan["floats"] for r in staging(comm, floats, run, request)]
    if comm.Get_rank() == (0 if args.part == "allreduce" else 1):
        emit({"ranks": comm.Get_size(), "cuda_aware": mpi_is_cuda_aware(), "results": results})


if __name__ == "__main__":
    main()
