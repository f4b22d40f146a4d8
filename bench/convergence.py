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
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _convergence_units as units
from _common import ROOT, header, table
from _convergence_report import report
from _convergence_units import Run, jet_sample, staleness_stats, train

JET_MODEL = str(ROOT / "examples" / "jet_cnn.py")
DIGITS_MODEL = str(ROOT / "examples" / "digits_cnn.py")
DIGITS_MLP = str(ROOT / "examples" / "digits_mlp.py")
ALGORITHMS = ["downpour", "easgd", "gem", "adag", "allreduce"]
# Issue 29's rules; a name here may stand for a rule with options (VARIANTS).
NEW_ALGORITHMS = ["diloco", "diloco-sync", "async_local_sgd", "eamsgd"]
ALGORITHMS += NEW_ALGORITHMS
# The study's (--unit/--next) besides; --algorithms runs them.
OTHER_ALGORITHMS = ["dynsgd", "downpour-warm", "diloco-avg", "diloco-avg-linear"]
REACH = 0.98  # of the 1-worker best
GAP_AIM, SAMPLES_AIM = 1.0, 1.5


def staleness_text(counts: Counter) -> str:
    """The staleness of a run's updates in a few numbers: mean, the share at 0, the 99th
    percentile and the maximum."""
    st = staleness_stats(counts)
    if not st:
        return ""
    return f"; staleness mean {st['mean']:.2f}, {st['at_zero']:.0%} at 0, p99 {st['p99']}, max {st['max']}"


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
def train_options(args: argparse.Namespace) -> list[str]:
    """The train options every run of the table takes (the jet sample made on first use)."""
    if args.table_data == "digits":
        data = ["--model", DIGITS_MLP]
    else:
        train_glob, val_glob = jet_sample(Path(args.cache).expanduser())
        data = ["--model", JET_MODEL, "--train", train_glob, "--val", val_glob]
    extra = [*data, "--epochs", str(args.epochs), "--batch-size", "32", *args.extra]
    if args.validate_every_samples:
        extra += ["--validate-every-samples", str(args.validate_every_samples)]
    return extra


def jets(args: argparse.Namespace, runs_dir: Path) -> bool:
    extra = train_options(args)
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


# ----------------------------------------------------------------------------- the study, unit by unit
DATA = ROOT / "bench" / "results" / "convergence-units.jsonl"
CONTINUE = (
    "while PYTHONPATH=. python bench/convergence.py --next; do :; done; "
    "PYTHONPATH=. python bench/convergence.py --report"
)


def study(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """--unit, --next or --report: one unit of issue 29's study run and recorded, or the
    tables of those recorded (_convergence_units.py, _convergence_report.py)."""
    label = "digits_mlp" if args.table_data == "digits" else units.jet_label()
    proto = units.protocol(label, args.epochs, 32, args.validate_every_samples, args.extra)
    path = Path(args.data)
    done = units.recorded(units.read(path), proto)
    if args.report:
        out = Path(
            args.report_out or ROOT / "bench" / "results" / f"{time.strftime('%Y-%m-%d', time.gmtime())}-convergence.md"
        )
        text = report(done, units.STUDY_RULES, proto, intro=study_intro(proto, path), continue_with=CONTINUE)
        out.write_text(text, encoding="utf-8")
        print(f"wrote {out} from {len(done)} recorded unit(s)")
        return 0
    if args.unit:
        key = parse_unit(args.unit, parser)
        if units.is_done(done.get(key), args.retry_timeouts):
            print(f"{key[0]} at {key[1]} worker(s), seed {key[2]}: recorded already in {path}")
            return 0
    else:
        next_key = units.next_unit(done, units.STUDY_RULES, retry_timeouts=args.retry_timeouts)
        if next_key is None:
            print(f"every unit of the study is recorded in {path}")
            return NOTHING_LEFT
        key = next_key
    extra = train_options(args)
    load0, t0 = os.getloadavg()[0], time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="nbdist-convergence-") as tmp:
        run = train(*key, extra, Path(tmp))
    wall = time.perf_counter() - t0
    units.append(path, units.to_record(run, proto, wall=wall, load=(load0, os.getloadavg()[0]), root=ROOT))
    say(run, wall)
    return 0


NOTHING_LEFT = 3  # --next's exit status when every unit is recorded: a loop stops on it


def parse_unit(text: str, parser: argparse.ArgumentParser) -> units.Key:
    parts = text.split(",")
    rules = ", ".join(units.STUDY_RULES)
    if (
        len(parts) != 3
        or parts[0] not in units.STUDY_RULES
        or not all(p.isdigit() for p in parts[1:])
        or parts[1] == "0"
    ):
        parser.error(f"--unit takes RULE,WORKERS,SEED (workers 1 or more), got {text!r}; rules: {rules}")
    return parts[0], int(parts[1]), int(parts[2])


def study_intro(proto: dict, path: Path) -> str:
    every = proto["validate_every_samples"]
    extra = f", extra options {' '.join(proto['extra'])}" if proto["extra"] else ""
    return f"""# bench/convergence.py: issue 29's study, every rule at 1, 8 and 16 workers (accumulating)

Written by `PYTHONPATH=. python bench/convergence.py --report` from the units recorded in
`{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}` (one JSON line per (rule, workers, seed)).

Protocol: data `{proto["data"]}` (for the jets: the Pythia 8 top-vs-QCD images of the
2026-11-26 tables, 4,800 training and 1,200 validation jets, `examples/jet_cnn.py`), each
rule with today's defaults, batch {proto["batch"]} per worker, {proto["epochs"]} epochs, validated every
{every} samples{extra}. `downpour-warm` is Downpour with
`--warm-start-epochs 2`, `diloco-sync` DiLoCo with `--synchronous`, `diloco-avg` DiLoCo with
`--synchronous`, windows of 4 steps, plain averaging (outer lr 1, no outer momentum) and
`--lr-scaling sqrt`, `diloco-avg-linear` the same with `--lr-scaling linear`. Samples count over all
workers. A collapse: a validation at <= 0.51 after one at >= 0.6, or a run that ended with an
error; a run cut by its {units.RUN_DEADLINE:.0f} s deadline (the machine's load, not the rule) is left
out and listed as missing. "Samples to 98% of allreduce's 1-w best": the mean samples to
reach 98% of allreduce's mean 1-worker best, over allreduce's at the same workers (a run
that never reaches it counts with all its samples: ">="). H: a worker's mean local steps
between two exchanges, its window (the rule's default, or the variant's) cut where an epoch
ends (a window ends with its epoch); the aim's "at most 1/H of Downpour's bytes" allows 1%
for the messages' headers.

How the units ran: one at a time by `bench/convergence.py --next` (each run's ranks on the
2 cores). Where the scheduling below says SCHED_IDLE, nice 19, the units ran as background
work at idle priority BESIDE other work on the shared machine: the workers of an
asynchronous rule then also take turns with other processes, so their updates' staleness
(and with it Downpour's dips) depends on that load, not on the rule alone; synchronous
rules and allreduce wait for every worker, and only their wall time depends on it."""


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
    unit = parser.add_argument_group("issue 29's study, one unit at a time, accumulating across sessions")
    unit.add_argument("--unit", metavar="RULE,WORKERS,SEED", help="run and record this unit (skipped if recorded)")
    unit.add_argument(
        "--next", action="store_true", help=f"run and record the next missing unit (exit {NOTHING_LEFT}: none)"
    )
    unit.add_argument("--report", action="store_true", help="write the study's tables from the recorded units")
    unit.add_argument("--data", default=str(DATA), help="the units' JSON lines file")
    unit.add_argument("--report-out", help="the report's path (default bench/results/<today>-convergence.md)")
    unit.add_argument("--retry-timeouts", action="store_true", help="run units cut by their deadline again")
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
    if args.unit or args.next or args.report:
        raise SystemExit(study(args, parser))
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
