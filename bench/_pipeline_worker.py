"""The MPI side of pipeline.py; run under `mpiexec -n P` (not on its own).

Every rank is one stage of the MLP of --model (its Linear+ReLU blocks cut into P
contiguous stages of about equal parameters), run by nbdist's StageRunner: a batch cut
into --micro-batches, --schedule's order, activations and gradients sent between stage
ranks, then a flat SGD step on the stage. With -n 1 and --micro-batches 0 it is the
unsplit model in one process (TorchBackend, one backward per batch), the reference.

Each rank prints its samples/s over the timed rounds (best round), the CPU seconds it
used in that round, and its measured bubble: the time it spent waiting for other stages
over its step time.
"""

from __future__ import annotations

import argparse
import sys
import time
from itertools import combinations
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from _common import MLPS, batch_indices, emit, mlp, synthetic
from mpi4py import MPI
from torch import nn

from nbdist.backends.stages import TorchStage
from nbdist.backends.torch import TorchBackend
from nbdist.roles.pipeline import StageRunner
from nbdist.specs import parse_spec
from nbdist.transport.collectives import Collectives
from nbdist.transport.pipeline import StageLinks

DATA_SAMPLES = 2048


def cut(model: nn.Sequential, count: int) -> list[nn.Module]:
    """`count` contiguous stages, each Linear with the ReLU after it, the largest stage
    as small as the blocks allow (every split tried: a few dozen for 9 blocks)."""
    blocks: list[list[nn.Module]] = []
    for layer in model:
        if isinstance(layer, nn.Linear) or not blocks:
            blocks.append([layer])
        else:
            blocks[-1].append(layer)
    sizes = [sum(p.numel() for m in block for p in m.parameters()) for block in blocks]

    def bounds(cuts: tuple[int, ...]) -> list[tuple[int, int]]:
        return list(zip((0, *cuts), (*cuts, len(blocks)), strict=True))

    best = min(
        combinations(range(1, len(blocks)), count - 1), key=lambda cuts: max(sum(sizes[a:b]) for a, b in bounds(cuts))
    )
    return [nn.Sequential(*(m for block in blocks[a:b] for m in block)) for a, b in bounds(best)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="large")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    stage, count = comm.Get_rank(), comm.Get_size()
    sizes = MLPS[args.model]
    torch.manual_seed(0)
    model = mlp(sizes)
    x_all, y_all = synthetic(DATA_SAMPLES, sizes[0], sizes[-1], seed=1)
    batches = batch_indices(DATA_SAMPLES, args.batch_size, 16, seed=2)
    sgd = parse_spec("sgd(lr=0.01)")
    if args.micro_batches == 0:
        backend = TorchBackend(model)

        def gradients(x, y):
            backend.compute_gradients(x, y)

        runner = None
    else:
        backend = TorchStage(cut(model, count)[stage], stage, count)
        runner = StageRunner(
            backend, StageLinks(comm, Collectives(lambda: 300.0), stage, count), args.schedule, args.micro_batches
        )

        def gradients(x, y):
            runner.gradients(x if stage == 0 else None, y)

    opt = backend.make_optimizer(sgd)

    def step(k: int) -> None:
        idx = batches[k % len(batches)]
        gradients(x_all[idx], y_all[idx])
        opt.step(backend.rule_grads)

    for k in range(args.warmup):
        step(k)
    best, idle_of_best, cpu_of_best = float("inf"), 0.0, 0.0
    for _ in range(args.rounds):
        comm.Barrier()
        idle0 = runner.idle_s if runner else 0.0
        busy0 = runner.busy_s if runner else 0.0
        t0, cpu0 = time.perf_counter(), time.process_time()
        for k in range(args.steps):
            step(k)
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        comm.Barrier()
        if elapsed < best:
            best, cpu_of_best = elapsed, cpu
            if runner:
                idle, busy = runner.idle_s - idle0, runner.busy_s - busy0
                idle_of_best = idle / (idle + busy)
    emit(
        {
            "stage": stage,
            "stages": count,
            "params": backend.num_params,
            "samples_per_s": args.steps * args.batch_size / best,
            "bubble": idle_of_best,
            "samples": args.steps * args.batch_size,
            "cpu_s": cpu_of_best,
        }
    )


if __name__ == "__main__":
    main()
