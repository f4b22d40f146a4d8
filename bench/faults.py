"""Failures, injected for real, and what became of each run (a script, not a test).

Each case starts `python -m nbdist launch -n N train ...` (mpiexec with MPI fault
tolerance), waits until it has trained a few epochs, then does to one process what a
user, a node or a batch system would: SIGKILL, SIGSTOP (and SIGCONT once the run went on
without it), SIGTERM. It then waits for the job to end, with a deadline: a job still
running then counts as hung (and is killed). Bad input is one case too, and so are
synchronous runs one after the other in one job, where any hang would show.

The table says, per case: runs, how many completed their epochs, how many ended with one
clear error (one `nbdist: error:` line, no traceback) within 10 s of the fault, how many
hung, the samples lost (not trained in their epoch, asynchronous drops) and the epochs
trained again after a restart (at most the checkpoint interval). Then the aim line.

Usage: python bench/faults.py [--runs 3] [--quick] [--sync-runs 50]
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil
from _common import ROOT, header, table

from nbdist.launch import mpi_env, mpiexec_command

MLP = str(ROOT / "examples" / "digits_mlp.py")
BIG = str(ROOT / "tests" / "models" / "big_mlp.py")
TRAIN_MANY = str(ROOT / "tests" / "mpi_scripts" / "train_many.py")
ERROR_WITHIN = 10.0
HANG_AFTER = 240.0


@dataclass
class Case:
    name: str
    ranks: int
    args: list[str]
    fault: str  # "kill", "stop", "term", "none"
    rank: int = 2  # the rank the fault hits
    expect: str = "complete"  # "complete" or "error"
    after_epochs: int = 3


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
        "bad worker optimiser sgd(lr=-1.0)",
        4,
        ["--model", MLP, "--algorithm", "easgd", "--worker-optimizer", "sgd(lr=-1.0)"],
        "none",
        expect="error",
        after_epochs=0,
    ),
]
QUICK = (0, 1, 3, 6, 9)


@dataclass
class Outcome:
    completed: bool = False
    clear_error: bool = False
    hung: bool = False
    samples_lost: int = 0
    epochs_redone: int = 0
    seconds_to_end: float = 0.0
    notes: list[str] = field(default_factory=list)


def _rank_process(root: psutil.Process, rank: int) -> psutil.Process | None:
    for child in root.children(recursive=True):
        try:
            if child.environ().get("OMPI_COMM_WORLD_RANK") == str(rank) and "nbdist" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    return None


def _epochs(run: Path) -> int:
    path = run / "metrics" / "rank-00000.jsonl"
    return path.read_text(errors="replace").count('"kind":"epoch"') if path.exists() else 0


def run_case(case: Case, workdir: Path) -> Outcome:
    run = workdir / "run"
    log = open(workdir / "output.txt", "w+")
    argv = [
        sys.executable,
        "-m",
        "nbdist",
        "launch",
        "-n",
        str(case.ranks),
        "train",
        *case.args,
        "--runs-dir",
        str(workdir),
        "--run-name",
        "run",
        "--quiet",
    ]
    job = subprocess.Popen(argv, cwd=ROOT, env=mpi_env(), stdout=log, stderr=subprocess.STDOUT)
    root = psutil.Process(job.pid)
    out = Outcome()
    started = time.monotonic()
    faulted = started
    try:
        while case.after_epochs and _epochs(run) < case.after_epochs and job.poll() is None:
            if time.monotonic() - started > HANG_AFTER:
                break
            time.sleep(0.1)
        victim = _rank_process(root, case.rank) if case.fault in ("kill", "stop") else None
        faulted = time.monotonic()
        if case.fault == "kill" and victim is not None:
            victim.kill()
        elif case.fault == "stop" and victim is not None:
            victim.suspend()
        elif case.fault == "term":
            job.send_signal(signal.SIGTERM)
        while job.poll() is None and time.monotonic() - faulted < HANG_AFTER:
            if (
                case.fault == "stop"
                and victim is not None
                and "rank 2 " in _read(workdir)
                and "goes on" in _read(workdir)
            ):
                _resume(victim)
            time.sleep(0.1)
        if case.fault == "stop" and victim is not None:
            _resume(victim)
        if job.poll() is None:
            out.hung = True
            for child in root.children(recursive=True):
                child.kill()
            job.kill()
            job.wait()
    finally:
        log.close()
    out.seconds_to_end = time.monotonic() - faulted
    text = _read(workdir)
    summary = run / "summary.json"
    if job.returncode == 0 and summary.exists():
        data = json.loads(summary.read_text())
        out.completed = data["stop_reason"].startswith("completed") or case.fault == "term"
        out.samples_lost = int(data.get("samples_lost", 0))
        restarts = [
            json.loads(line)["values"]
            for line in (run / "metrics" / "rank-00000.jsonl").open()
            if '"kind":"restart"' in line
        ]
        if restarts and restarts[0].get("checkpoint"):
            failed_at = max(
                json.loads(line)["epoch"]
                for line in (run / "metrics" / "rank-00000.jsonl").open()
                if '"kind":"epoch"' in line and json.loads(line)["time"] < _restart_time(run)
            )
            # Epochs the run had ended before the failure that its checkpoint did not hold
            # (an asynchronous master's last epoch record may trail its snapshot: at least 0).
            out.epochs_redone = max(0, failed_at - int(restarts[0]["checkpoint"].split("-")[1]))
    errors = [line for line in text.splitlines() if line.startswith("nbdist: error:")]
    out.clear_error = (
        job.returncode != 0 and len(errors) == 1 and "Traceback" not in text and out.seconds_to_end <= ERROR_WITHIN
    )
    if job.returncode != 0 and not out.clear_error:
        out.notes.append(text[-400:])
    return out


def _restart_time(run: Path) -> float:
    for line in (run / "metrics" / "rank-00000.jsonl").open():
        if '"kind":"restart"' in line:
            return json.loads(line)["time"]
    return float("inf")


def _resume(process: psutil.Process) -> None:
    try:
        process.resume()
    except psutil.Error:
        pass


def _read(workdir: Path) -> str:
    return (workdir / "output.txt").read_text(errors="replace")


def synchronous_in_a_row(runs: int, workdir: Path) -> tuple[int, int, bool, float]:
    """`runs` synchronous runs one after the other in ONE mpiexec job: (completed, runs,
    hung, seconds)."""
    spec = workdir / "sync.json"
    spec.write_text(
        json.dumps(
            [
                [
                    "--model",
                    MLP,
                    "--algorithm",
                    "easgd",
                    "--synchronous",
                    "--epochs",
                    "2",
                    "--runs-dir",
                    str(workdir),
                    "--run-name",
                    f"sync-{i}",
                    "--quiet",
                ]
                for i in range(runs)
            ]
        )
    )
    started = time.monotonic()
    try:
        done = subprocess.run(
            mpiexec_command(3, [TRAIN_MANY, str(spec)]),
            cwd=ROOT,
            env=mpi_env(),
            capture_output=True,
            text=True,
            timeout=HANG_AFTER + 30 * runs,
        )
    except subprocess.TimeoutExpired:
        return 0, runs, True, time.monotonic() - started
    codes = re.findall(r"nbdist-test: run \d+ rc=(-?\d+)", done.stdout)
    return sum(c == "0" for c in codes), runs, False, time.monotonic() - started


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="runs per case (default 3)")
    p.add_argument("--sync-runs", type=int, default=50, help="synchronous runs in a row (default 50)")
    p.add_argument("--quick", action="store_true", help="one run of five cases, 10 synchronous runs")
    args = p.parse_args()
    cases = [CASES[i] for i in QUICK] if args.quick else CASES
    runs = 1 if args.quick else args.runs
    sync_runs = 10 if args.quick else args.sync_runs
    header("faults: kill, stop and signal cases under python -m nbdist launch")
    rows, hangs, async_deaths, async_completed, lost_beyond = [], 0, 0, 0, 0
    for case in cases:
        outcomes = []
        for i in range(runs):
            with tempfile.TemporaryDirectory(prefix="nbdist-faults-") as tmp:
                outcomes.append(run_case(case, Path(tmp)))
            print(
                f"  {case.name} #{i + 1}: "
                + (
                    "hung"
                    if outcomes[-1].hung
                    else "completed"
                    if outcomes[-1].completed
                    else "clear error"
                    if outcomes[-1].clear_error
                    else "other"
                )
                + f" ({outcomes[-1].seconds_to_end:.1f} s after the fault)"
                + "".join(f"\n    {n!r}" for n in outcomes[-1].notes),
                flush=True,
            )
        hangs += sum(o.hung for o in outcomes)
        if case.fault in ("kill", "stop") and case.expect == "complete" and "--max-restarts" not in case.args:
            async_deaths += len(outcomes)
            async_completed += sum(o.completed for o in outcomes)
        lost_beyond += sum(o.epochs_redone > 1 for o in outcomes)  # --checkpoint-every 1 (the default)
        rows.append(
            [
                case.name,
                str(len(outcomes)),
                str(sum(o.completed for o in outcomes)),
                str(sum(o.clear_error for o in outcomes)),
                str(sum(o.hung for o in outcomes)),
                ", ".join(str(o.samples_lost) for o in outcomes),
                ", ".join(str(o.epochs_redone) for o in outcomes) if "--max-restarts" in case.args else "-",
            ]
        )
    with tempfile.TemporaryDirectory(prefix="nbdist-faults-") as tmp:
        completed, total, hung, seconds = synchronous_in_a_row(sync_runs, Path(tmp))
    hangs += int(hung)
    rows.append(
        [
            f"synchronous EASGD runs in a row, one job of 3 ranks ({seconds:.0f} s)",
            str(total),
            str(completed),
            "0",
            str(total - completed if hung else 0),
            "-",
            "-",
        ]
    )
    table(
        rows,
        [
            "case",
            "runs",
            "completed",
            f"clear error within {ERROR_WITHIN:.0f} s",
            "hung",
            "samples lost (per run)",
            "epochs redone",
        ],
    )
    met = hangs == 0 and lost_beyond == 0 and async_completed == async_deaths
    print(
        f"\naim: 0 hangs ({hangs}), nothing lost beyond the checkpoint interval (runs that redid more than one "
        f"epoch: {lost_beyond}), every asynchronous worker death completed ({async_completed} of {async_deaths}): "
        f"{'met' if met else 'not met'}"
    )


if __name__ == "__main__":
    main()
