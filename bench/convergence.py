"""Does 8-worker training learn as well as 1 worker? (a script, not a test)

On Pythia 8 top-vs-QCD jet images (4,800 training and 1,200 validation jets, generated
once and cached), `examples/jet_cnn.py` is trained by every algorithm with its defaults,
batch 32 per worker, for 12 epochs, with 1 and with 8 workers, over several seeds. Per
algorithm the table gives:

- the best validation accuracy with 1 and with 8 workers (mean over seeds of each run's
  best) and the gap in points;
- the samples an 8-worker run needs to reach 98% of the 1-worker best, divided by what a
  1-worker run needs (means over seeds; a run that never gets there counts with all its
  samples and the ratio is shown as ">= x");
- the runs that collapsed: after having learned something (a validation accuracy of 0.6
  or more), a validation back at chance level (<= 0.51 on the balanced validation set:
  the model answers one class for every jet); a run that ended with an error counts too.

Samples are counted over all workers, so 8 workers at batch 32 see as many samples per
epoch as 1 worker does: the samples ratio is the price of parallelism in data, not time.

Then the digits table: asynchronous Downpour whose master runs momentum SGD, against GEM,
at 4, 8 and 16 workers (`examples/digits_cnn.py`, 20 epochs), the GEM paper's point:
asynchrony adds momentum of its own, and momentum on top of it diverges; with the
momentum as given and as nbdist corrects it by default (nbdist/train/asynchrony.py).

The same 1-vs-many table runs on the digits too with `--table-data digits`
(`examples/digits_mlp.py`, for a small run). Every row also gives the bytes the workers
handed to MPI per training sample at the many-worker count (the 'train' records'
`bytes_sent` over their samples): the rules that talk every H steps (diloco,
async_local_sgd; issue 29) should send about 1/H of what Downpour sends.
`diloco-sync` is diloco with --synchronous.

Usage: python bench/convergence.py [--quick] [--seeds 10] [--algorithms gem,adag]
       [--workers 16] [--no-single] [--no-digits] [--no-jets] [--table-data digits]
       [--extra '...']
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ROOT, header, table

from nbdist.metrics import read_log, samples_to_reach, staleness_entries, validation_curve

JET_MODEL = str(ROOT / "examples" / "jet_cnn.py")
DIGITS_MODEL = str(ROOT / "examples" / "digits_cnn.py")
DIGITS_MLP = str(ROOT / "examples" / "digits_mlp.py")
JETS = {"signal": "top", "events": 6000, "files": 6}
ALGORITHMS = ["downpour", "easgd", "gem", "adag", "allreduce"]
# Issue 29's rules; a name here may stand for a rule with options (VARIANTS).
NEW_ALGORITHMS = ["diloco", "diloco-sync", "async_local_sgd", "eamsgd"]
ALGORITHMS += NEW_ALGORITHMS
VARIANTS = {"diloco-sync": ["--algorithm", "diloco", "--synchronous"]}
OTHER_ALGORITHMS = ["dynsgd"]  # not in the table; --algorithms dynsgd runs it
COLLAPSED_AT = 0.51  # validation accuracy of a constant answer on balanced classes is 0.5
LEARNED_AT = 0.6  # a curve above this has learned something it can lose
REACH = 0.98  # of the 1-worker best
GAP_AIM, SAMPLES_AIM = 1.0, 1.5
RUN_DEADLINE = 900.0


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

    @property
    def bytes_per_sample(self) -> float:
        return self.bytes_sent / self.trained if self.trained else float("nan")

    @property
    def best(self) -> float:
        return max((acc for _, acc in self.curve), default=float("nan"))

    @property
    def samples(self) -> int:
        return self.curve[-1][0] if self.curve else 0

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


def jet_sample(cache: Path) -> tuple[str, str]:
    """The training and validation file globs, generated on first use."""
    out = cache / f"jets-{JETS['signal']}-{JETS['events']}-{JETS['files']}"
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
    elif algorithm in VARIANTS:
        ranks, rule = workers + 1, VARIANTS[algorithm]
    else:
        ranks, rule = workers + 1, ["--algorithm", algorithm]
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


def staleness_text(counts: Counter) -> str:
    """The staleness of a run's updates in a few numbers: mean, the share at 0, the 99th
    percentile and the maximum."""
    total = sum(counts.values())
    if not total:
        return ""
    mean = sum(s * n for s, n in counts.items()) / total
    seen, p99 = 0, 0
    for s in sorted(counts):
        seen += counts[s]
        if seen >= 0.99 * total:
            p99 = s
            break
    return f"; staleness mean {mean:.2f}, {counts[0] / total:.0%} at 0, p99 {p99}, max {max(counts)}"


def say(run: Run, seconds: float) -> None:
    state = f"error: {run.error}" if run.error else f"best {run.best:.3f}" + (" COLLAPSED" if run.collapsed else "")
    state += staleness_text(run.staleness)
    if run.trained:
        state += f"; {run.bytes_per_sample:.0f} bytes sent / sample"
    print(f"   {run.algorithm:9s} {run.workers:2d} workers seed {run.seed}: {state} ({seconds:.0f} s)", flush=True)
    if run.collapsed and run.curve:  # where it fell, whether it came back, and how (the loss)
        print(
            "      val acc/loss by samples: "
            + " ".join(f"{n // 1000}k:{acc:.2f}/{run.losses.get(n, float('nan')):.2f}" for n, acc in run.curve),
            flush=True,
        )


# ----------------------------------------------------------------------------- jets
def jets(args: argparse.Namespace, runs_dir: Path) -> bool:
    if args.table_data == "digits":
        data = ["--model", DIGITS_MLP]
    else:
        train_glob, val_glob = jet_sample(Path(args.cache).expanduser())
        data = ["--model", JET_MODEL, "--train", train_glob, "--val", val_glob]
    extra = [
        *data,
        "--epochs",
        str(args.epochs),
        "--batch-size",
        "32",
        *args.extra,
    ]
    if args.validate_every_samples:
        extra += ["--validate-every-samples", str(args.validate_every_samples)]
    seeds = range(args.seeds)
    rows, met = [], True
    for algorithm in args.algorithms:
        runs: dict[int, list[Run]] = {}
        runs[1] = []
        for workers in (args.workers,) if args.no_single else (1, args.workers):
            runs[workers] = []
            for seed in seeds:
                t0 = time.perf_counter()
                runs[workers].append(train(algorithm, workers, seed, extra, runs_dir))
                say(runs[workers][-1], time.perf_counter() - t0)
        row, ok = summarise(algorithm, runs[1], runs[args.workers])
        rows.append(row)
        met &= ok
    print()
    print(
        f"== {args.table_data}: best val acc and samples to {REACH:.0%} of the 1-worker best, 1 vs {args.workers} "
        f"workers, "
        f"{args.seeds} seeds, {args.epochs} epochs, batch 32 per worker"
    )
    table(
        rows,
        [
            "algorithm",
            "best, 1 w",
            f"best, {args.workers} w",
            "gap (points)",
            f"samples to {REACH:.0%}, {args.workers} w / 1 w",
            f"collapsed ({args.workers} w)",
            "collapsed (1 w)",
            f"bytes sent / sample ({args.workers} w)",
        ],
    )
    if not args.no_single:
        print(f"aim gap <= {GAP_AIM:g} point, samples <= {SAMPLES_AIM:g}x, no collapse: {'met' if met else 'not met'}")
    return met


def summarise(algorithm: str, single: list[Run], many: list[Run]) -> tuple[list, bool]:
    best1 = statistics.fmean(r.best for r in single if r.curve) if any(r.curve for r in single) else float("nan")
    best_n = statistics.fmean(r.best for r in many if r.curve) if any(r.curve for r in many) else float("nan")
    gap = 100.0 * (best1 - best_n)
    goal = REACH * best1
    ratio_text, ratio = "n/a", float("inf")
    reached1 = [r.samples_to(goal) for r in single]
    reached_n = [r.samples_to(goal) for r in many]
    if all(s is not None for s in reached1) and reached1:
        lower_bound = any(s is None for s in reached_n)
        mean_n = statistics.fmean(s if s is not None else r.samples for s, r in zip(reached_n, many, strict=True))
        ratio = mean_n / statistics.fmean(reached1)
        ratio_text = f"{'>= ' if lower_bound else ''}{ratio:.2f}x"
        if lower_bound:
            ratio = max(ratio, SAMPLES_AIM + 1e-9)
    collapsed_n = sum(r.collapsed for r in many)
    collapsed_1 = sum(r.collapsed for r in single)
    ok = gap <= GAP_AIM and ratio <= SAMPLES_AIM and collapsed_n == 0
    sent = [r.bytes_per_sample for r in many if r.trained]
    per_sample = f"{statistics.fmean(sent):.0f}" if sent else "n/a"
    return [algorithm, best1, best_n, round(gap, 1), ratio_text, collapsed_n, collapsed_1, per_sample], ok


# ----------------------------------------------------------------------------- digits
def digits(args: argparse.Namespace, runs_dir: Path) -> None:
    momentum = ["--master-optimizer", "sgd(lr=0.05, momentum=0.9)"]
    setups = {
        "downpour, master momentum 0.9 as given (--momentum-correction off)": [
            "downpour",
            *momentum,
            "--momentum-correction",
            "off",
        ],
        "downpour, master momentum 0.9 corrected (the default)": ["downpour", *momentum],
        "gem (defaults)": ["gem"],
    }
    counts = [4, 8, 16]
    rows = []
    for label, (algorithm, *options) in setups.items():
        row: list = [label]
        for workers in counts:
            finals = []
            for seed in range(args.digits_seeds):
                t0 = time.perf_counter()
                run = train(
                    algorithm,
                    workers,
                    seed,
                    ["--model", DIGITS_MODEL, "--epochs", "20", *options, *args.extra],
                    runs_dir,
                )
                say(run, time.perf_counter() - t0)
                finals.append(run.curve[-1][1] if run.curve else float("nan"))
            row.append(statistics.fmean(finals))
        rows.append(row)
    print()
    print(f"== digits: final val acc after 20 epochs, asynchronous, {args.digits_seeds} seed(s)")
    table(rows, ["set-up"] + [f"{n} workers" for n in counts])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 seeds instead of 10")
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    parser.add_argument(
        "--validate-every-samples",
        type=int,
        default=1200,
        help="validate every N samples as well as each epoch (finer samples-to-accuracy; 0: per epoch only)",
    )
    parser.add_argument("--digits-seeds", type=int, default=None)
    parser.add_argument("--no-jets", action="store_true")
    parser.add_argument("--no-digits", action="store_true")
    parser.add_argument(
        "--no-single",
        action="store_true",
        help="skip the 1-worker runs (collapses at --workers only; no gap or samples ratio)",
    )
    parser.add_argument("--cache", default="~/.cache/nbdist/bench", help="where the jet sample is kept")
    parser.add_argument(
        "--table-data",
        choices=["jets", "digits"],
        default="jets",
        help="the data of the 1-vs-many table: the jet images, or the digits (digits_mlp.py, a small run)",
    )
    parser.add_argument("--extra", default="", help="more train options for every run, e.g. '--lr-scaling sqrt'")
    args = parser.parse_args()
    args.seeds = args.seeds or (3 if args.quick else 10)
    args.digits_seeds = args.digits_seeds or (1 if args.quick else 3)
    args.algorithms = [a for a in args.algorithms.split(",") if a]
    args.extra = shlex.split(args.extra)  # quoted values keep their spaces: "sgd(lr=0.05, momentum=0.5)"
    unknown = sorted(set(args.algorithms) - set(ALGORITHMS + OTHER_ALGORITHMS))
    if unknown:
        parser.error(
            f"unknown algorithm(s) {', '.join(unknown)}; choose from {', '.join(ALGORITHMS + OTHER_ALGORITHMS)}"
        )
    header("convergence: 1 worker against many, samples to accuracy, collapses")
    print(f"   {time.strftime('%Y-%m-%d')}", flush=True)
    with tempfile.TemporaryDirectory(prefix="nbdist-convergence-") as tmp:
        runs_dir = Path(tmp)
        if not args.no_jets:
            jets(args, runs_dir)
        if not args.no_digits:
            digits(args, runs_dir)


if __name__ == "__main__":
    main()
