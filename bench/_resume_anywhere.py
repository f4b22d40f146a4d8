"""The resume-anywhere parts of bench/faults.py (a helper of that script, not a benchmark).

Every run goes through one job of 6 ranks (tests/mpi_scripts/resize_runs.py runs each run
on the first N ranks of it): asynchronous runs of each rule, whose last checkpoint must be
their last epoch and which must resume exactly there; and runs resumed on more and on
fewer ranks (master/worker, sub-masters, allreduce, pipelines), whose epochs must go on.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

from _common import ROOT

from nbdist.launch import mpi_env, mpiexec_command

MLP = str(ROOT / "examples" / "digits_mlp.py")
PIPELINE = str(ROOT / "examples" / "digits_pipeline.py")
RESIZE_RUNS = str(ROOT / "tests" / "mpi_scripts" / "resize_runs.py")
HANG_AFTER = 240.0  # a job (bench/faults.py's cases too) still running this long counts as hung


# Asynchronous runs of each rule: kind -> (name, ranks, options); each trains LAST_EPOCHS
# epochs, then resumes for one more.
LAST_EPOCHS = 5
ASYNCHRONOUS = {
    "easgd": ("EASGD, 1 master + 4 workers", 5, ["--algorithm", "easgd"]),
    "downpour": ("Downpour, 1 master + 3 workers", 4, ["--algorithm", "downpour"]),
    "adag": ("ADAG, 1 master + 3 workers", 4, ["--algorithm", "adag"]),
    "gem": ("GEM, 1 master + 3 workers", 4, ["--algorithm", "gem"]),
    "masters": ("Downpour, 2 masters x (1 + 2 workers)", 6, ["--masters", "2"]),
}
# Runs resumed on other sizes: (name, ranks, options, the sizes of its resumes, 2 epochs each).
PIPE = ["--worker-parallel", "pipeline", "--procs-per-worker", "2"]
RESIZED = [
    ("master/worker (EASGD)", 3, ["--model", MLP, "--algorithm", "easgd"], [5, 2, 3]),
    ("sub-masters (Downpour)", 6, ["--model", MLP, "--masters", "2"], [5, 4, 6]),
    ("allreduce", 2, ["--model", MLP, "--topology", "allreduce"], [4, 3, 2]),
    ("pipeline workers (EASGD)", 5, ["--model", PIPELINE, *PIPE, "--algorithm", "easgd"], [3, 5]),
    ("pipeline replicas (allreduce)", 4, ["--model", PIPELINE, *PIPE, "--topology", "allreduce"], [6, 2]),
]


def _resize_job(runs: list[tuple[int, list[str]]], workdir: Path) -> tuple[list[int], bool, str]:
    """`runs` (ranks, argv) in one job of 6 ranks: (each run's exit status, hung, output)."""
    spec = workdir / "resize.json"
    spec.write_text(json.dumps([[ranks, [*argv, "--runs-dir", str(workdir)]] for ranks, argv in runs]))
    try:
        done = subprocess.run(
            mpiexec_command(6, [RESIZE_RUNS, str(spec)]),
            cwd=ROOT,
            env=mpi_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=HANG_AFTER + 10 * len(runs),
        )
    except subprocess.TimeoutExpired:
        return [], True, ""
    codes = {int(i): int(rc) for i, rc in re.findall(r"nbdist-test: run (\d+) rc=(-?\d+)", done.stdout)}
    return [codes.get(i, -1) for i in range(len(runs))], False, done.stdout


def _epoch_records(run: Path) -> list[int]:
    path = run / "metrics" / "rank-00000.jsonl"
    return [json.loads(line)["epoch"] for line in path.open() if '"kind":"epoch"' in line] if path.exists() else []


def last_epochs(repeats: int, kinds: list[str], workdir: Path) -> tuple[list[list[str]], int, int, bool]:
    """Each asynchronous kind `repeats` times, one job per kind: LAST_EPOCHS epochs, then a
    resume for one more. (rows, runs, runs that ended at and resumed exactly from their
    last epoch, hung)."""
    rows, good, any_hung = [], 0, False
    for kind in kinds:
        label, ranks, argv = ASYNCHRONOUS[kind]
        runs, names = [], [f"last-{kind}-{i}" for i in range(repeats)]
        for name in names:
            runs.append((ranks, ["--model", MLP, *argv, "--epochs", str(LAST_EPOCHS), "--run-name", name, "--quiet"]))
            runs.append((ranks, ["--resume", str(workdir / name), "--epochs", str(LAST_EPOCHS + 1), "--no-quiet"]))
        started = time.monotonic()
        codes, hung, output = _resize_job(runs, workdir)
        ended = exact = 0
        for j, name in enumerate(names):
            run = workdir / name
            if hung or codes[2 * j] != 0:
                continue
            at_last = f"{run}/checkpoints/epoch-{LAST_EPOCHS:04d} at epoch {LAST_EPOCHS + 1}," in output
            went_on = codes[2 * j + 1] == 0 and _epoch_records(run) == list(range(1, LAST_EPOCHS + 2))
            ended, exact, good = ended + at_last, exact + went_on, good + (at_last and went_on)
        seconds = time.monotonic() - started
        rows.append(
            [f"{label}, {LAST_EPOCHS} epochs, then 1 more ({seconds:.0f} s)", str(repeats), str(ended), str(exact)]
        )
        any_hung = any_hung or hung
    return rows, repeats * len(kinds), good, any_hung


def resized(workdir: Path) -> tuple[list[list[str]], int, int, bool]:
    """Each of RESIZED: 3 epochs, then resumed on each of its sizes for 2 more. (rows,
    resumes, resumes that went on from their checkpoint's epoch with a note, hung)."""
    runs, where = [], []
    for k, (_, ranks, argv, sizes) in enumerate(RESIZED):
        name = f"resized-{k}"
        runs.append((ranks, [*argv, "--epochs", "3", "--run-name", name, "--quiet"]))
        for j, size in enumerate(sizes):
            where.append((k, len(runs), 3 + 2 * j))
            runs.append((size, ["--resume", str(workdir / name), "--epochs", str(5 + 2 * j), "--no-quiet"]))
    codes, hung, output = _resize_job(runs, workdir)
    went_on = {k: 0 for k in range(len(RESIZED))}
    for k, index, epoch in where:
        run = workdir / f"resized-{k}"
        went_on[k] += (
            not hung
            and codes[index] == 0
            and f"{run}/checkpoints/epoch-{epoch:04d} at epoch {epoch + 1}" in output
            and f"every worker starts epoch {epoch + 1} from its first batch" in output
        )
    rows = []
    for k, (kind, ranks, _, sizes) in enumerate(RESIZED):
        history = json.loads((workdir / f"resized-{k}" / "summary.json").read_text())["history"] if not hung else []
        last = f"{history[-1]['val_acc']:.3f}" if history else "-"
        path = " -> ".join(str(n) for n in [ranks, *sizes])
        rows.append([f"{kind}: {path} ranks", str(len(sizes)), str(went_on[k]), last])
    return rows, sum(len(r[3]) for r in RESIZED), sum(went_on.values()), hung
