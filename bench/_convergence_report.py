"""The tables of issue 29's convergence study from the recorded units (not a benchmark).

`bench/convergence.py --report` calls `report()` with the newest record of every unit
(_convergence_units.py) and writes the markdown it returns under bench/results/. Per
worker count, per rule: best accuracy against one worker, samples to accuracy against
one worker and against allreduce, collapses, bytes sent per training sample against
Downpour's, staleness, wall time and load; then the aim line of the issue, decided only
where all seeds are in.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Sequence

from _convergence_units import SEEDS, Key, Run, from_record, missing, nominal_window, staleness_stats

REACH = 0.98  # of the 1-worker best
GAP_AIM = 1.0  # points
# Bytes per sample against Downpour's: a rule that exchanges every H batches sends 1/H of
# Downpour's messages, of the same size; the headers and the epoch's last, partial batch
# move the measured ratio by about a thousandth.
BYTES_TOLERANCE = 0.01
NAN = float("nan")


def md_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + " --- |" * len(headers)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value) -> str:
    if isinstance(value, float):
        return "n/a" if math.isnan(value) else f"{value:.3f}"
    return str(value)


def mean(values: Sequence[float]) -> float:
    return statistics.fmean(values) if values else NAN


def samples_to(runs: list[Run], target: float) -> tuple[float, bool]:
    """Mean samples to `target` over runs; a run that never gets there counts with all its
    samples, and the mean is then a lower bound (True)."""
    reached = [r.samples_to(target) for r in runs if r.curve]
    if not reached or math.isnan(target):
        return NAN, False
    counted = [s if s is not None else r.samples for s, r in zip(reached, [r for r in runs if r.curve], strict=True)]
    return statistics.fmean(counted), any(s is None for s in reached)


def ratio_text(ratio: float, lower_bound: bool) -> str:
    return "n/a" if math.isnan(ratio) else f"{'>= ' if lower_bound else ''}{ratio:.2f}x"


def window(rule: str, runs: list[Run], epochs: int, batch: int) -> float:
    """H, a worker's mean local steps between two exchanges as the runs took them: its
    nominal window (the variant's, else the rule's default), cut where an epoch ends (a
    window ends with its epoch): 10 batches an epoch in windows of 4 are windows of 4, 4
    and 2, a mean of 3.33."""
    if rule == "allreduce":
        return 1.0
    nominal = nominal_window(rule)
    per_epoch = [r.trained / epochs / r.workers / batch for r in runs if r.trained]
    if not per_epoch:
        return float(nominal)
    batches = math.ceil(mean(per_epoch))
    return batches / math.ceil(batches / nominal)


def worker_table(by: dict[tuple[str, int], list[Run]], rules: list[str], workers: int, proto: dict) -> tuple[str, dict]:
    """The table at `workers` workers, and each rule's figures for the aim line."""
    ref = by.get(("allreduce", 1), [])
    target = REACH * mean([r.best for r in ref if r.curve])
    allreduce_n, allreduce_lb = samples_to(by.get(("allreduce", workers), []), target)
    downpour_bytes = mean([r.bytes_per_sample for r in by.get(("downpour", workers), []) if r.trained])
    rows, figures = [], {}
    for rule in rules:
        one, many = by.get((rule, 1), []), by.get((rule, workers), [])
        best1 = mean([r.best for r in one if r.curve])
        best_n = mean([r.best for r in many if r.curve])
        to_own, own_lb = samples_to(many, REACH * best1)
        own1, _ = samples_to(one, REACH * best1)
        to_ref, ref_lb = samples_to(many, target)
        sent = mean([r.bytes_per_sample for r in many if r.trained])
        h = window(rule, many, proto["epochs"], proto["batch"])
        stale = staleness_stats(sum((r.staleness for r in many), Counter()))
        f = {
            "seeds": len(many),
            "gap": 100.0 * (best1 - best_n),
            "collapsed": sum(r.collapsed for r in many),
            "vs_allreduce": to_ref / allreduce_n if allreduce_n else NAN,
            "vs_allreduce_lb": ref_lb or allreduce_lb,
            "saving": downpour_bytes / sent if sent else NAN,
            "h": h,
        }
        figures[rule] = f
        rows.append(
            [
                rule,
                f"{len(many)}/{SEEDS}",
                best1,
                best_n,
                f"{f['gap']:.1f}" if not math.isnan(f["gap"]) else "n/a",
                mean([r.final for r in many if r.curve]),
                ratio_text(to_own / own1 if own1 else NAN, own_lb),
                ratio_text(f["vs_allreduce"], f["vs_allreduce_lb"]),
                f["collapsed"],
                sum(bool(r.error) for r in many),
                f"{sent:.0f}" if not math.isnan(sent) else "n/a",
                f"{f['saving']:.1f}" if not math.isnan(f["saving"]) else "n/a",
                f"{h:.1f}",
                f"{stale['mean']:.2f} / {stale['p99']} / {stale['max']}" if stale else "-",
                f"{mean([r.wall for r in many]):.0f}" if many else "n/a",
            ]
        )
    headers = [
        "rule",
        "seeds",
        "best, 1 w",
        f"best, {workers} w",
        "gap (points)",
        f"final, {workers} w",
        f"samples to {REACH:.0%} of own 1-w best, {workers} w / 1 w",
        f"samples to {REACH:.0%} of allreduce's 1-w best, / allreduce's at {workers} w",
        "collapsed",
        "errors",
        "bytes sent / sample",
        "Downpour's bytes / this",
        "H (mean window, cut at epoch ends)",
        "staleness mean / p99 / max",
        "wall s (mean)",
    ]
    return md_table(headers, rows), figures


def aim_line(figures: dict, workers: int) -> str:
    """At least one master/worker rule within GAP_AIM of one worker, no collapse in SEEDS
    seeds, in no more samples than allreduce, sending at most 1/H of Downpour's bytes."""
    met, open_ = [], []
    for rule, f in figures.items():
        if rule == "allreduce":
            continue
        checks = [
            f["gap"] <= GAP_AIM,
            f["collapsed"] == 0,
            f["vs_allreduce"] <= 1.0 and not f["vs_allreduce_lb"],
            f["saving"] >= (1.0 - BYTES_TOLERANCE) * f["h"] > 1,
        ]
        if all(checks) and f["seeds"] >= SEEDS:
            met.append(rule)
        elif all(checks):
            open_.append(f"{rule} ({f['seeds']} of {SEEDS} seeds)")
    if met:
        return f"aim at {workers} workers: met by {', '.join(met)}"
    if open_:
        return f"aim at {workers} workers: not decided; on course so far: {', '.join(open_)}"
    return f"aim at {workers} workers: not met by any rule recorded so far"


def dips_line(by: dict[tuple[str, int], list[Run]], workers: int) -> str:
    plain, warm = by.get(("downpour", workers), []), by.get(("downpour-warm", workers), [])
    return (
        f"Downpour's dips at {workers} workers: {sum(r.collapsed for r in plain)} of {len(plain)} runs "
        f"without a warm start, {sum(r.collapsed for r in warm)} of {len(warm)} with `--warm-start-epochs 2`"
    )


def group(units: dict[Key, dict]) -> dict[tuple[str, int], list[Run]]:
    """(rule, workers) -> its runs, the timed-out ones left out (the load's, not the rule's)."""
    by: dict[tuple[str, int], list[Run]] = {}
    for record in units.values():
        run = from_record(record)
        if not run.timed_out:
            by.setdefault((run.algorithm, run.workers), []).append(run)
    return by


def report(units: dict[Key, dict], rules: list[str], proto: dict, *, intro: str, continue_with: str) -> str:
    by = group(units)
    records = list(units.values())
    parts = [intro, ""]
    if records:
        loads = [x for r in records for x in r["load"]]
        scheduled = Counter(r["scheduling"] for r in records)
        parts += [
            f"- Units recorded: {len(records)} ({sum(1 for r in records if r['error'])} ended with an error), "
            f"{min(r['date'] for r in records)} to {max(r['date'] for r in records)}",
            f"- Machine: {'; '.join(sorted({r['host'] for r in records}))}",
            f"- Scheduling: {', '.join(f'{s} ({n} units)' for s, n in scheduled.items())}",
            f"- Load average (1 min) around the units: {min(loads):.1f} to {max(loads):.1f}, "
            f"mean {statistics.fmean(loads):.1f}",
            f"- Commits: {', '.join(sorted({r['commit'] for r in records}))}",
            "",
        ]
    one_rows = []
    for rule in rules:
        runs = by.get((rule, 1), [])
        one_rows.append(
            [
                rule,
                f"{len(runs)}/{SEEDS}",
                mean([r.best for r in runs if r.curve]),
                mean([r.final for r in runs if r.curve]),
                sum(r.collapsed for r in runs),
                f"{mean([r.bytes_per_sample for r in runs if r.trained]):.0f}" if runs else "n/a",
                f"{mean([r.wall for r in runs]):.0f}" if runs else "n/a",
            ]
        )
    parts += [
        "## 1 worker",
        "",
        md_table(["rule", "seeds", "best", "final", "collapsed", "bytes sent / sample", "wall s (mean)"], one_rows),
        "",
    ]
    for workers in sorted({w for _, w in by} - {1}):
        text, figures = worker_table(by, rules, workers, proto)
        aim = f"**{aim_line(figures, workers)}**"
        parts += [f"## {workers} workers", "", text, "", aim, "", dips_line(by, workers), ""]
    gaps = missing(units, rules)
    parts += ["## Missing units", ""]
    if gaps:
        for workers in sorted({w for _, w in gaps}):
            at = {rule: seeds for (rule, w), seeds in gaps.items() if w == workers}
            if len(at) == len(rules) and len({tuple(s) for s in at.values()}) == 1:
                parts.append(f"- {workers} worker(s): seeds {_ranges(next(iter(at.values())))} of every rule")
            else:
                parts += [f"- {workers} worker(s): {rule} seeds {_ranges(at[rule])}" for rule in rules if rule in at]
        parts += ["", f"To continue (runs the next missing unit each time): `{continue_with}`"]
    else:
        parts += ["None: every unit of the study is recorded."]
    return "\n".join(parts) + "\n"


def _ranges(seeds: list[int]) -> str:
    spans, start = [], seeds[0]
    for prev, cur in zip(seeds, seeds[1:] + [None], strict=True):
        if cur != prev + 1:
            spans.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(spans)
