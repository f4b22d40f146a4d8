"""Pipeline stages' gradients and pipeline replicas' runs on real ranks, for tests/test_pipeline_mpi.py.

    mpiexec -n 4 python pipeline_gradients.py OUT_DIR

Runs one batch through a 4-stage pipeline (all four ranks) and through two 2-stage
pipelines (ranks 0-1 and 2-3), with each schedule, and writes the whole model's flat
gradient as the stages' leader gathers it (the worker's message to a master) to
OUT_DIR/<stages>-<schedule>-<pipeline>.npy. The test compares them with the unsplit
model's gradient in one process.

Then, in the same job, the digits runs of REPLICA_RUNS (name -> `nbdist train` argv, all
four ranks: 2 pipeline replicas of 2 stages under --topology allreduce, one of them
stopped and resumed) and, on each pair of ranks, 2 allreduce ranks with the unsplit model
(`allreduce-<pair>`), written under OUT_DIR/runs; rank 0 prints `run NAME rc=RC`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI
from rank_main import run_or_abort
from torch import nn

import nbdist
from nbdist.backends.stages import TorchStage
from nbdist.cli import main as nbdist_main
from nbdist.roles.pipeline import StageRunner, stage_layout
from nbdist.transport.collectives import Collectives
from nbdist.transport.pipeline import StageLinks, StageParts

SEED, ROWS, MICRO = 3, 10, 3  # 10 rows in 3 micro-batches: parts of 3, 4 and 3 rows
DIGITS = str(Path(__file__).resolve().parents[2] / "examples" / "digits_pipeline.py")
# A few steps (two epochs of 12 batches of 2 x 64) to compare with 2 unsplit allreduce ranks.
FEW_STEPS = {"epochs": 2, "batch_size": 64}
REPLICAS = ["--model", DIGITS, "--topology", "allreduce", "--procs-per-worker", "2", "--worker-parallel", "pipeline"]
REPLICA_RUNS = {
    "replicas-few-steps": [
        *REPLICAS,
        "--epochs",
        str(FEW_STEPS["epochs"]),
        "--batch-size",
        str(FEW_STEPS["batch_size"]),
    ],
    "replicas-learn": [*REPLICAS, "--epochs", "12", "--pipeline-schedule", "gpipe"],
    # Each stage's reducer through top-k (with error feedback).
    "replicas-topk": [*REPLICAS, "--epochs", "12", "--pipeline-schedule", "gpipe", "--compression", "topk(0.1)"],
    # Stopped after one epoch, then resumed to two: the same run as replicas-few-steps.
    "replicas-resumed": [*REPLICAS, "--epochs", "1", "--batch-size", str(FEW_STEPS["batch_size"])],
}
LAYERS = [(10, 16), (16, 12), (12, 8), (8, 3)]


def build_stages(count: int) -> list[nn.Module]:
    """Four Linear+Tanh blocks (the last without Tanh), grouped into `count` stages."""
    torch.manual_seed(SEED)
    blocks = [nn.Sequential(nn.Linear(a, b), nn.Tanh()) for a, b in LAYERS[:-1]] + [nn.Linear(*LAYERS[-1])]
    per = len(blocks) // count
    return [nn.Sequential(*blocks[i * per : (i + 1) * per]) for i in range(count)]


def batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(ROWS, LAYERS[0][0])).astype(np.float32), rng.integers(0, 3, ROWS).astype(np.int64)


def whole_gradient(comm, schedule: str) -> np.ndarray | None:
    stage, count = comm.Get_rank(), comm.Get_size()
    collectives = Collectives(lambda: 60.0)
    backend = TorchStage(build_stages(count)[stage], stage, count)
    runner = StageRunner(backend, StageLinks(comm, collectives, stage, count), schedule, MICRO)
    x, y = batch()
    runner.gradients(x if stage == 0 else None, y)
    sizes = [int(s) for s in comm.allgather(backend.num_params)]
    offsets, _ = stage_layout(sizes, [0] * count)
    whole = np.empty(sum(sizes), np.float32) if stage == 0 else None
    StageParts(comm, collectives, sizes, offsets).gather(backend.grads, whole, "the test's gradient")
    return whole


def train_runs(out: Path, world, pair) -> None:
    runs = out / "runs"
    every = {
        name: [*argv, "--runs-dir", str(runs), "--run-name", name, "--quiet"] for name, argv in REPLICA_RUNS.items()
    }
    every["replicas-resumed (resume)"] = [
        "--resume",
        str(runs / "replicas-resumed"),
        "--epochs",
        str(FEW_STEPS["epochs"]),
        "--quiet",
    ]
    for name, argv in every.items():
        rc = nbdist_main(["train", *argv])
        if world.Get_rank() == 0:
            print(f"run {name} rc={rc}", flush=True)
    name = f"allreduce-{world.Get_rank() // 2}"
    nbdist.train(DIGITS, comm=pair, topology="allreduce", runs_dir=str(runs), run_name=name, quiet=True, **FEW_STEPS)
    world.Barrier()
    if world.Get_rank() == 0:
        print("run allreduce rc=0", flush=True)


def main() -> None:
    out = Path(sys.argv[1])
    world = MPI.COMM_WORLD
    pair = world.Split(world.Get_rank() // 2, world.Get_rank())
    for schedule in ("gpipe", "1f1b"):
        for stages, comm in ((4, world), (2, pair)):
            whole = whole_gradient(comm, schedule)
            if whole is not None:
                np.save(out / f"{stages}-{schedule}-{world.Get_rank() // 2 if stages == 2 else 0}.npy", whole)
    print(f"OK rank {world.Get_rank()}", flush=True)
    train_runs(out, world, pair)


if __name__ == "__main__":
    run_or_abort(main)
