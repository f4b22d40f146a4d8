"""The cases of bench/faults.py: a run, the fault done to one of its ranks, and the
ending expected of it."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ROOT
from _resume_anywhere import MLP

BIG = str(ROOT / "tests" / "models" / "big_mlp.py")
WIDE = str(ROOT / "tests" / "models" / "wide_mlp.py")


@dataclass
class Case:
    name: str
    ranks: int
    args: list[str]
    fault: str  # "kill", "stop", "term", "none", or "fill" (the disk under the run)
    rank: int = 2  # the rank the fault hits
    expect: str = "complete"  # "complete" or "error"
    after_epochs: int = 3
    disk_mb: int = 0  # "fill": the run on a tmpfs of this size, filled after a checkpoint
    resume: bool = False  # then --resume on the job's original size, 2 epochs more


CASES = [
    Case(
        "asynchronous worker, kill -9 (EASGD, 1 master + 3 workers)",
        4,
        ["--model", MLP, "--algorithm", "easgd", "--epochs", "400", "--batch-size", "16", "--peer-timeout", "3"],
        "kill",
    ),
    Case(
        "asynchronous worker, kill -STOP (Downpour, 1 master + 3 workers)",
        4,
        ["--model", MLP, "--algorithm", "downpour", "--epochs", "400", "--batch-size", "16", "--peer-timeout", "3"],
        "stop",
    ),
    Case(
        "worker under a sub-master, kill -9 (GEM, 2 masters x 2 workers)",
        6,
        [
            "--model",
            MLP,
            "--algorithm",
            "gem",
            "--masters",
            "2",
            "--epochs",
            "300",
            "--batch-size",
            "16",
            "--peer-timeout",
            "3",
        ],
        "kill",
        rank=4,
        resume=True,
    ),
    Case(
        "allreduce rank, kill -9, --max-restarts 1",
        4,
        [
            "--model",
            MLP,
            "--topology",
            "allreduce",
            "--epochs",
            "150",
            "--batch-size",
            "8",
            "--max-restarts",
            "1",
            "--peer-timeout",
            "5",
        ],
        "kill",
        resume=True,
    ),
    Case(
        "synchronous worker, kill -9, --max-restarts 1 (EASGD)",
        4,
        [
            "--model",
            MLP,
            "--algorithm",
            "easgd",
            "--synchronous",
            "--epochs",
            "150",
            "--batch-size",
            "8",
            "--max-restarts",
            "1",
            "--peer-timeout",
            "5",
        ],
        "kill",
        resume=True,
    ),
    Case(
        "master, kill -9, --max-restarts 1 (asynchronous Downpour)",
        4,
        [
            "--model",
            MLP,
            "--algorithm",
            "downpour",
            "--epochs",
            "300",
            "--batch-size",
            "16",
            "--max-restarts",
            "1",
            "--peer-timeout",
            "5",
        ],
        "kill",
        rank=0,
        resume=True,
    ),
    Case(
        "sub-master, kill -9, --max-restarts 1 (GEM, 2 masters x 2 workers)",
        6,
        ["--model", MLP, *"--algorithm gem --masters 2 --epochs 150 --batch-size 16".split()]
        + "--max-restarts 1 --peer-timeout 5".split(),
        "kill",
        rank=3,
        resume=True,
    ),
    Case(
        "allreduce rank, kill -9, no restarts",
        4,
        ["--model", MLP, "--topology", "allreduce", "--epochs", "300", "--batch-size", "8", "--peer-timeout", "5"],
        "kill",
        expect="error",
    ),
    Case(
        "allreduce rank, kill -STOP, no restarts",
        4,
        ["--model", MLP, "--topology", "allreduce", "--epochs", "300", "--batch-size", "8", "--peer-timeout", "3"],
        "stop",
        expect="error",
    ),
    Case(
        "SIGTERM to the job, 10.2M-parameter MLP (1 master + 2 workers)",
        3,
        ["--model", BIG, "--algorithm", "easgd", "--epochs", "100"],
        "term",
        after_epochs=1,
    ),
    Case(
        "disk full: the tmpfs under the run filled after a checkpoint (EASGD, 1 master + 2 workers)",
        3,
        ["--model", WIDE, "--algorithm", "easgd", "--epochs", "100000", "--batch-size", "64"],
        "fill",
        expect="error",
        after_epochs=1,
        disk_mb=64,
    ),
    Case(
        "bad worker optimiser sgd(lr=-1.0)",
        4,
        ["--model", MLP, "--algorithm", "easgd", "--worker-optimizer", "sgd(lr=-1.0)"],
        "none",
        expect="error",
        after_epochs=0,
    ),
]
QUICK = (0, 1, 3, 4, 6, 7, 9, 10)  # with the restarts resumed on their original size, and disk full
