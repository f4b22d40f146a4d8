"""Failures, injected for real, and what became of each run (a script, not a test).

Each case starts `python -m nbdist launch -n N train ...` (mpiexec with MPI fault
tolerance), waits until it has trained a few epochs, then does to one process what a
user, a node or a batch system would: SIGKILL, SIGSTOP (and SIGCONT once the run went on
without it), SIGTERM; or, in the disk-full case, fills the small file system (a tmpfs
mounted for it, so root only) that holds the run, as another job fills a shared scratch.
It then waits for the job to end, with a deadline: a job still running then counts as
hung (and is killed). Bad input is one case too, and so are
synchronous runs one after the other in one job, where any hang would show.

The table says, per case: runs, how many completed their epochs, how many ended with one
clear error (one `nbdist: error:` line, no traceback) within 10 s of the fault, how many
hung, the samples lost (not trained in their epoch, asynchronous drops), the epochs
trained again after a restart (at most the checkpoint interval) and, for a run restarted
on the ranks left or one that went on without a worker under a sub-master, whether
`--resume` on the job's original size then went on from its last epoch.

Resume anywhere (bench/_resume_anywhere.py), in one job of 6 ranks per part: asynchronous
runs of each rule, whose last checkpoint must be their last epoch and which must resume
exactly there; and runs resumed on more and on fewer ranks (master/worker, sub-masters,
allreduce, pipelines), whose epochs must go on. Then the aim line.

Usage: python bench/faults.py [--runs 3] [--quick] [--sync-runs 50] [--last-runs 20]
       [--only faults|restarts|last-epochs|resized] [--kinds easgd,masters,...]

`--only` runs one part (restarts: the cases that lose a rank and go on, restarted by
--max-restarts or without the dropped worker, each then resumed on its original size); the
aim line then counts that part only. `--kinds` picks the asynchronous runs of the
last-epochs part (each kind is one job of its own).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
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
from _resume_anywhere import ASYNCHRONOUS, HANG_AFTER, MLP, last_epochs, resized

from nbdist.launch import mpi_env, mpiexec_command

BIG = str(ROOT / "tests" / "models" / "big_mlp.py")
WIDE = str(ROOT / "tests" / "models" / "wide_mlp.py")
TRAIN_MANY = str(ROOT / "tests" / "mpi_scripts" / "train_many.py")
ERROR_WITHIN = 10.0


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


PARTS = ("faults", "restarts", "last-epochs", "resized")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="runs per case (default 3)")
    p.add_argument("--sync-runs", type=int, default=50, help="synchronous runs in a row (default 50)")
    p.add_argument("--last-runs", type=int, default=20, help="asynchronous runs of each kind (default 20)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="one run of eight cases (disk full too), 10 synchronous runs, 4 of each kind",
    )
    p.add_argument("--only", choices=PARTS, help="one part: " + ", ".join(PARTS) + " (default: all)")
    p.add_argument("--kinds", default=",".join(ASYNCHRONOUS), help="asynchronous kinds for last-epochs")
    p.add_argument(
        "--case",
        metavar="TEXT",
        action="append",
        help="only the fault cases whose name holds TEXT (repeat it for more; e.g. 'disk full'), no synchronous runs",
    )
    args = p.parse_args()
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = [k for k in kinds if k not in ASYNCHRONOUS]
    if unknown:
        p.error(f"--kinds: no kind {', '.join(unknown)}; choose from {', '.join(ASYNCHRONOUS)}")
    parts = [args.only] if args.only else list(PARTS)
    if args.only == "restarts":
        cases = [case for case in CASES if case.resume]
    elif "faults" in parts:
        cases = [CASES[i] for i in QUICK] if args.quick else CASES
    else:
        cases = []
    if args.case:
        cases = [case for case in CASES if any(text in case.name for text in args.case)]
    runs = 1 if args.quick else args.runs
    last_runs = 4 if args.quick else args.last_runs
    header("faults: kill, stop and signal cases under python -m nbdist launch")
    aim = Aim()
    if cases:
        fault_cases(cases, runs, aim)
    if "faults" in parts and not args.case:
        sync_row(10 if args.quick else args.sync_runs, aim)
    if aim.rows:
        table(
            aim.rows,
            [
                "case",
                "runs",
                "completed",
                f"clear error within {ERROR_WITHIN:.0f} s",
                "hung",
                "samples lost (per run)",
                "epochs redone",
                "then resumed on the original size",
            ],
        )
    if "last-epochs" in parts:
        with tempfile.TemporaryDirectory(prefix="nbdist-faults-") as tmp:
            last_rows, aim.last_total, aim.last_good, last_hung = last_epochs(last_runs, kinds, Path(tmp))
        print()
        table(last_rows, ["asynchronous run", "runs", "last checkpoint = last epoch", "resumed exactly there"])
        aim.hangs += int(last_hung)
    if "resized" in parts:
        with tempfile.TemporaryDirectory(prefix="nbdist-faults-") as tmp:
            size_rows, aim.size_total, aim.size_good, size_hung = resized(Path(tmp))
        print()
        table(size_rows, ["resumed on other ranks", "resumes", "went on from their epoch", "val_acc at the end"])
        aim.hangs += int(size_hung)
    print(aim.line())


@dataclass
class Aim:
    """The counts the aim line is made of (a part that did not run counts 0 of 0)."""

    rows: list[list[str]] = field(default_factory=list)
    hangs: int = 0
    async_deaths: int = 0
    async_completed: int = 0
    lost_beyond: int = 0
    restarted: int = 0
    resumed: int = 0
    last_total: int = 0
    last_good: int = 0
    size_total: int = 0
    size_good: int = 0
    errors_expected: int = 0
    errors_clear: int = 0

    def line(self) -> str:
        met = (
            self.hangs == 0
            and self.lost_beyond == 0
            and self.async_completed == self.async_deaths
            and self.resumed == self.restarted
            and self.last_good == self.last_total
            and self.size_good == self.size_total
            and self.errors_clear == self.errors_expected
        )
        return (
            f"\naim: 0 hangs ({self.hangs}), nothing lost beyond the checkpoint interval (runs that redid more "
            f"than one epoch: {self.lost_beyond}), every asynchronous worker death completed "
            f"({self.async_completed} of {self.async_deaths}), every run that lost a rank resumed on its original "
            f"size ({self.resumed} of {self.restarted}), every asynchronous run ended at its last epoch "
            f"and resumed there ({self.last_good} of {self.last_total}), every resume on other ranks went on from "
            f"its epoch ({self.size_good} of {self.size_total}), every run that cannot go on ended with one clear "
            f"line ({self.errors_clear} of {self.errors_expected}): {'met' if met else 'not met'}"
        )


def _ending(out: Outcome) -> str:
    if out.hung:
        return "hung"
    return "completed" if out.completed else "clear error" if out.clear_error else "other"


def fault_cases(cases: list[Case], runs: int, aim: Aim) -> None:
    """Each case `runs` times: a row of the table each, and the aim's counts."""
    for case in cases:
        outcomes = []
        for i in range(runs):
            with tempfile.TemporaryDirectory(prefix="nbdist-faults-") as tmp:
                outcomes.append(run_case(case, Path(tmp)))
            last = outcomes[-1]
            notes = "".join(f"\n    {n!r}" for n in last.notes)
            print(
                f"  {case.name} #{i + 1}: {_ending(last)} ({last.seconds_to_end:.1f} s after the fault){notes}",
                flush=True,
            )
        aim.hangs += sum(o.hung for o in outcomes)
        if case.fault in ("kill", "stop") and case.expect == "complete" and "--max-restarts" not in case.args:
            aim.async_deaths += len(outcomes)
            aim.async_completed += sum(o.completed for o in outcomes)
        if case.expect == "error":
            aim.errors_expected += len(outcomes)
            aim.errors_clear += sum(o.clear_error for o in outcomes)
        aim.lost_beyond += sum(o.epochs_redone > 1 for o in outcomes)  # --checkpoint-every 1 (the default)
        aim.restarted += sum(o.resumed is not None for o in outcomes) + sum(
            case.resume and not o.completed for o in outcomes
        )
        aim.resumed += sum(bool(o.resumed) for o in outcomes)
        aim.rows.append(
            [
                case.name,
                str(len(outcomes)),
                str(sum(o.completed for o in outcomes)),
                str(sum(o.clear_error for o in outcomes)),
                str(sum(o.hung for o in outcomes)),
                ", ".join(str(o.samples_lost) for o in outcomes),
                ", ".join(str(o.epochs_redone) for o in outcomes) if "--max-restarts" in case.args else "-",
                f"{sum(bool(o.resumed) for o in outcomes)} of {len(outcomes)}" if case.resume else "-",
            ]
        )


def sync_row(sync_runs: int, aim: Aim) -> None:
    with tempfile.TemporaryDirectory(prefix="nbdist-faults-") as tmp:
        completed, total, hung, seconds = synchronous_in_a_row(sync_runs, Path(tmp))
    aim.hangs += int(hung)
    aim.rows.append(
        [
            f"synchronous EASGD runs in a row, one job of 3 ranks ({seconds:.0f} s)",
            str(total),
            str(completed),
            "0",
            str(total - completed if hung else 0),
            "-",
            "-",
            "-",
        ]
    )


if __name__ == "__main__":
    main()
