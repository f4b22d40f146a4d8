"""Running one case of bench/faults.py for real (its fault injected, its job watched to
its end with a deadline) and the synchronous runs in a row, and what became of them."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil
from _common import ROOT
from _fault_cases import Case
from _resume_anywhere import HANG_AFTER, MLP

from nbdist.launch import mpi_env, mpiexec_command

TRAIN_MANY = str(ROOT / "tests" / "mpi_scripts" / "train_many.py")
ERROR_WITHIN = 10.0


@dataclass
class Outcome:
    completed: bool = False
    clear_error: bool = False
    hung: bool = False
    samples_lost: int = 0
    epochs_redone: int = 0
    seconds_to_end: float = 0.0
    resumed: bool | None = None  # resumed on the original size and went on from its last epoch
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
    if not case.disk_mb:
        return _run_case(case, workdir, workdir)
    disk = workdir / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={case.disk_mb}m,mode=0700", "tmpfs", str(disk)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        return Outcome(notes=[f"not run: mounting a tmpfs failed ({mounted.stderr.strip()}); run as root"])
    try:
        return _run_case(case, workdir, disk)
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def _fill(runs_dir: Path, run: Path) -> None:
    """Another job fills the disk once the run committed a checkpoint: a quarter of one is left."""
    latest = run / "checkpoints" / "LATEST.json"
    deadline = time.monotonic() + HANG_AFTER
    while not latest.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    label = json.loads(latest.read_text())["label"]
    files = json.loads((run / "checkpoints" / label / "meta.json").read_text())["files"]
    leave = sum(f["bytes"] for f in files.values()) // 4
    filler = runs_dir / "filler"
    with open(filler, "wb", buffering=0) as fh:
        try:
            fh.write(b"\0" * max(0, shutil.disk_usage(runs_dir).free - leave))
        except OSError:
            pass  # the run filled it meanwhile: cut back below
    free = shutil.disk_usage(runs_dir).free
    if free < leave:
        os.truncate(filler, max(0, filler.stat().st_size - (leave - free)))


def _run_case(case: Case, workdir: Path, runs_dir: Path) -> Outcome:
    run = runs_dir / "run"
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
        str(runs_dir),
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
        elif case.fault == "fill":
            _fill(runs_dir, run)
            faulted = time.monotonic()
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
        # A run stopped by SIGTERM ends as one (exit 0, a final checkpoint) and says so.
        out.completed = data["stop_reason"].startswith("completed") or (
            case.fault == "term" and data["stop_reason"] == "stopped by SIGTERM"
        )
        if case.fault == "term" and not out.completed:
            out.notes.append(f"stop_reason {data['stop_reason']!r}")
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
    if case.resume and out.completed:
        out.resumed = _resume_on(run, case.ranks, out.notes)
    errors = [line for line in text.splitlines() if line.startswith("nbdist: error:")]
    out.clear_error = (
        job.returncode != 0 and len(errors) == 1 and "Traceback" not in text and out.seconds_to_end <= ERROR_WITHIN
    )
    if case.fault == "fill" and out.clear_error:
        # A full disk's line must say where to go on from: the checkpoint and the --resume.
        out.clear_error = "the last intact checkpoint is epoch-" in errors[0] and f"--resume {run}" in errors[0]
    if job.returncode != 0 and not out.clear_error:
        out.notes.append(text[-400:])
    return out


def _resume_on(run: Path, ranks: int, notes: list[str]) -> bool:
    """`--resume` on `ranks` ranks for 2 more epochs: whether it started from the run's last
    epoch and the run's history went on without a gap."""
    done = json.loads((run / "summary.json").read_text())["epochs_run"]
    argv = [sys.executable, "-m", "nbdist", "launch", "-n", str(ranks), "train"]
    argv += ["--resume", str(run), "--epochs", str(done + 2), "--no-quiet"]
    try:
        again = subprocess.run(argv, cwd=ROOT, env=mpi_env(), capture_output=True, text=True, timeout=HANG_AFTER)
    except subprocess.TimeoutExpired:
        notes.append("the resume hung")
        return False
    history = json.loads((run / "summary.json").read_text())["history"]
    ok = (
        again.returncode == 0
        and f"checkpoints/epoch-{done:04d} at epoch {done + 1}" in again.stdout
        and [h["epoch"] for h in history] == list(range(1, done + 3))
    )
    if not ok:
        notes.append((again.stdout + again.stderr)[-400:])
    return ok


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
