"""bench/convergence.py's runs, one (rule, workers, seed) unit at a time (not a benchmark).

Issue 29's study is hundreds of runs, hours of a shared 2-core machine: more than one
session. Each finished unit is appended as one JSON line to a data file under
bench/results/; a unit already there (for the same protocol: data, epochs, batch,
validation interval, extra options) is skipped, so the study accumulates across sessions,
and `bench/convergence.py --report` aggregates whatever is there (_convergence_report.py).

A record carries what the tables need (the validation curve by samples, best and final
accuracy, the collapse flag, staleness, bytes sent per sample) and what a reader needs to
judge it: wall time, the load average around the run, the scheduling it ran under (a
background unit runs at idle priority beside other work, which changes how stale an
asynchronous rule's updates are), the commit and the date.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import cache
from importlib import metadata
from pathlib import Path

from nbdist.metrics import read_log, samples_to_reach, staleness_entries, validation_curve

JETS = {"signal": "top", "events": 6000, "files": 6}
RUN_DEADLINE = 900.0

# The study's rules, in the order units run. "downpour-warm" is Downpour after a
# synchronous first phase (--warm-start-epochs 2, Dean et al.'s warm start), and
# "diloco-sync" DiLoCo's synchronous rounds, "diloco-avg" and "diloco-avg-linear" those
# of plain averaging; VARIANTS says how each is launched.
STUDY_RULES = [
    "downpour",
    "downpour-warm",
    "easgd",
    "gem",
    "adag",
    "dynsgd",
    "diloco",
    "diloco-sync",
    "async_local_sgd",
    "eamsgd",
    "allreduce",
    "diloco-avg",
    "diloco-avg-linear",
]
# Synchronous rounds of 4 local steps, plain averaging (outer lr 1, no momentum), the
# workers' AdamW lr scaled by sqrt(W) or W: averaging W windows shrinks the step of their
# uncorrelated parts (2026-11-28-convergence-diloco-probes.md).
AVERAGING = ["--algorithm", "diloco(inner_steps=4, outer_lr=1.0, outer_momentum=0.0)", "--synchronous"]
VARIANTS = {
    "diloco-sync": ["--algorithm", "diloco", "--synchronous"],
    "downpour-warm": ["--algorithm", "downpour", "--warm-start-epochs", "2"],
    "diloco-avg": [*AVERAGING, "--lr-scaling", "sqrt"],
    "diloco-avg-linear": [*AVERAGING, "--lr-scaling", "linear"],
}


def rule_options(rule: str) -> list[str]:
    """The train options that launch a master/worker rule of the study, a variant's included."""
    return VARIANTS.get(rule, ["--algorithm", rule])


def nominal_window(rule: str) -> int:
    """A master/worker rule's local steps between exchanges, as its options set them: its
    own (DiLoCo's inner_steps), else its default."""
    from nbdist.algorithms import make_algorithm
    from nbdist.specs import parse_spec

    options = rule_options(rule)
    algorithm = make_algorithm(parse_spec(options[options.index("--algorithm") + 1]))
    return algorithm.sync_window() or algorithm.default_sync_every


# The order the units run in: the 1-worker references of every rule for 3 seeds, then
# half of the seeds at 8 and at 16 workers (every rule gets a first look), then the rest.
# (Run beside other work at idle priority, a 1-worker unit can take minutes: all ten
# seeds of them first would leave the many-worker tables empty for a whole session.)
PHASES = [(1, range(3)), (8, range(5)), (16, range(5)), (1, range(3, 10)), (8, range(5, 10)), (16, range(5, 10))]
SEEDS = 10
COLLAPSED_AT = 0.51  # validation accuracy of a constant answer on balanced classes is 0.5
LEARNED_AT = 0.6  # a curve above this has learned something it can lose
TIMEOUT_PREFIX = "no end within"  # a unit cut by its deadline: the machine's load, not the rule's


@dataclass
class Run:
    algorithm: str
    workers: int
    seed: int
    # (cumulative training samples, validation accuracy), in the order validated
    curve: list[tuple[int, float]] = field(default_factory=list)
    # cumulative training samples -> validation loss: a dip to chance with a loss near
    # ln 2 is an undecided model, one with a loss far above it a diverged one
    losses: dict[int, float] = field(default_factory=dict)
    error: str = ""
    # staleness -> updates the master applied with it (asynchronous rules)
    staleness: Counter = field(default_factory=Counter)
    # what the workers handed to MPI, and the training samples behind it ('train' records)
    bytes_sent: int = 0
    trained: int = 0
    wall: float = 0.0  # seconds the run took, launch included

    @property
    def bytes_per_sample(self) -> float:
        return self.bytes_sent / self.trained if self.trained else float("nan")

    @property
    def best(self) -> float:
        return max((acc for _, acc in self.curve), default=float("nan"))

    @property
    def final(self) -> float:
        return self.curve[-1][1] if self.curve else float("nan")

    @property
    def samples(self) -> int:
        return self.curve[-1][0] if self.curve else 0

    @property
    def timed_out(self) -> bool:
        return self.error.startswith(TIMEOUT_PREFIX)

    @property
    def collapsed(self) -> bool:
        if self.error:
            return True
        learned = False
        for _, acc in self.curve:
            if learned and acc <= COLLAPSED_AT:
                return True
            learned = learned or acc >= LEARNED_AT
        return False

    def samples_to(self, accuracy: float) -> int | None:
        return samples_to_reach(self.curve, accuracy)


def staleness_stats(counts: Counter) -> dict:
    """Mean, share at 0, 99th percentile and maximum of a run's update staleness."""
    total = sum(counts.values())
    if not total:
        return {}
    seen, p99 = 0, 0
    for s in sorted(counts):
        seen += counts[s]
        if seen >= 0.99 * total:
            p99 = s
            break
    return {
        "updates": total,
        "mean": sum(s * n for s, n in counts.items()) / total,
        "at_zero": counts[0] / total,
        "p99": p99,
        "max": max(counts),
    }


# ----------------------------------------------------------------------------- runs
def jet_label() -> str:
    return f"jets-{JETS['signal']}-{JETS['events']}-{JETS['files']}"


def jet_sample(cache: Path) -> tuple[str, str]:
    """The training and validation file globs, generated on first use."""
    out = cache / jet_label()
    if not (out / "done").exists():
        print(f"   generating the jet sample in {out} (once; a few minutes)", flush=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "nbdist",
                "datasets",
                "jet-images",
                "--out",
                str(out),
                "--signal",
                JETS["signal"],
                "--events",
                str(JETS["events"]),
                "--files",
                str(JETS["files"]),
                "--overwrite",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        (out / "done").write_text("ok\n")
    return str(out / "train_*.h5"), str(out / "val_*.h5")


def train(algorithm: str, workers: int, seed: int, extra: list[str], runs_dir: Path) -> Run:
    """One run through nbdist's launcher; its validation curve from its metric log."""
    run = Run(algorithm, workers, seed)
    name = f"{algorithm}-{workers}w-s{seed}-{len(list(runs_dir.iterdir()))}"
    if algorithm == "allreduce":
        ranks, rule = workers, ["--topology", "allreduce"]
    else:
        ranks, rule = workers + 1, rule_options(algorithm)
    argv = [
        sys.executable,
        "-m",
        "nbdist",
        "launch",
        "-n",
        str(ranks),
        "train",
        *rule,
        "--seed",
        str(seed),
        "--runs-dir",
        str(runs_dir),
        "--run-name",
        name,
        "--quiet",
        "--checkpoint-every",
        "0",
        *extra,
    ]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=RUN_DEADLINE)
    except subprocess.TimeoutExpired:
        run.error = f"no end within {RUN_DEADLINE:.0f} s"
        return run
    if done.returncode != 0:
        lines = [ln for ln in done.stderr.splitlines() if "error" in ln.lower()] or done.stderr.splitlines()[-1:]
        run.error = lines[0] if lines else f"exit {done.returncode}"
    if (runs_dir / name / "metrics").is_dir():
        run.curve = validation_curve(runs_dir / name, "val_acc")
        run.losses = dict(validation_curve(runs_dir / name, "val_loss"))
        for record in read_log(runs_dir / name, "updates"):
            for _, staleness, updates in staleness_entries(record):
                run.staleness[staleness] += updates
        for record in read_log(runs_dir / name, "train"):
            run.bytes_sent += int(record["values"].get("bytes_sent", 0))
            run.trained += int(record["values"].get("samples", 0))
    return run


# ----------------------------------------------------------------------------- records
def protocol(data: str, epochs: int, batch: int, validate_every: int, extra: list[str]) -> dict:
    """What makes two units comparable: a record counts only under an equal protocol."""
    return {"data": data, "epochs": epochs, "batch": batch, "validate_every_samples": validate_every, "extra": extra}


def scheduling() -> str:
    """How this process is scheduled: background units run at idle priority (bg-run)."""
    policy = os.sched_getscheduler(0) if hasattr(os, "sched_getscheduler") else None
    idle = policy is not None and policy == getattr(os, "SCHED_IDLE", -1)
    return f"{'SCHED_IDLE' if idle else 'normal'}, nice {os.nice(0)}"


@cache  # one process records one unit; the tests record many
def commit(root: Path) -> str:
    """The checkout's commit, marked "+changes" when nbdist/, examples/ or bench/'s code
    differ from it (the data file the units go to is not code)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "nbdist", "examples", "bench/*.py"],
            cwd=root,
            capture_output=True,
            text=True,
        )
    except OSError:
        return "unknown"
    return head.stdout.strip() + (" +changes" if dirty.stdout.strip() else "")


def to_record(run: Run, proto: dict, *, wall: float, load: tuple[float, float], root: Path) -> dict:
    return {
        "rule": run.algorithm,
        "workers": run.workers,
        "seed": run.seed,
        "protocol": proto,
        "curve": [[n, acc] for n, acc in run.curve],
        "losses": [[n, loss] for n, loss in sorted(run.losses.items())],
        "best": run.best if run.curve else None,
        "final": run.final if run.curve else None,
        "collapsed": run.collapsed,
        "error": run.error,
        "staleness": {str(s): n for s, n in sorted(run.staleness.items())},
        "staleness_stats": staleness_stats(run.staleness),
        "bytes_sent": run.bytes_sent,
        "trained": run.trained,
        "bytes_per_sample": run.bytes_per_sample if run.trained else None,
        "wall_s": round(wall, 1),
        "load": [round(x, 2) for x in load],  # 1-minute load average at the start and the end
        "scheduling": scheduling(),
        "commit": commit(root),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": f"{platform.node()}, {os.cpu_count()} cores, python {platform.python_version()}, "
        f"torch {_version('torch')}",
    }


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"


def from_record(record: dict) -> Run:
    return Run(
        record["rule"],
        int(record["workers"]),
        int(record["seed"]),
        curve=[(int(n), float(acc)) for n, acc in record["curve"]],
        losses={int(n): float(loss) for n, loss in record["losses"]},
        error=record["error"],
        staleness=Counter({int(s): int(n) for s, n in record["staleness"].items()}),
        bytes_sent=int(record["bytes_sent"]),
        trained=int(record["trained"]),
        wall=float(record["wall_s"]),
    )


def append(path: Path, record: dict) -> None:
    """One line per unit, appended and flushed whole (a unit cut short writes nothing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(record, sort_keys=True) + "\n")


def read(path: Path) -> Iterator[dict]:
    if not path.exists():
        return
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as exc:
                    raise SystemExit(
                        f"{path}:{number}: not a JSON record ({exc.msg}); remove or repair that line"
                    ) from None


Key = tuple[str, int, int]


def recorded(records: Iterable[dict], proto: dict) -> dict[Key, dict]:
    """The newest record of every unit under `proto`."""
    units: dict[Key, dict] = {}
    for record in records:
        if record["protocol"] == proto:
            units[(record["rule"], int(record["workers"]), int(record["seed"]))] = record
    return units


def is_done(record: dict | None, retry_timeouts: bool) -> bool:
    return record is not None and not (retry_timeouts and from_record(record).timed_out)


def study_units(rules: list[str]) -> Iterator[Key]:
    """Every unit of the study, in the order they run (PHASES; rules within a seed)."""
    for workers, seeds in PHASES:
        for seed in seeds:
            for rule in rules:
                yield rule, workers, seed


def next_unit(units: dict[Key, dict], rules: list[str], *, retry_timeouts: bool = False) -> Key | None:
    return next((k for k in study_units(rules) if not is_done(units.get(k), retry_timeouts)), None)


def missing(units: dict[Key, dict], rules: list[str]) -> dict[tuple[str, int], list[int]]:
    """(rule, workers) -> the seeds not recorded yet (a timed-out unit counts as missing)."""
    gaps: dict[tuple[str, int], list[int]] = {}
    for key in study_units(rules):
        if not is_done(units.get(key), retry_timeouts=True):
            gaps.setdefault(key[:2], []).append(key[2])
    return gaps
