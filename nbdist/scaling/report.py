"""A scaling study as text: Markdown tables the command prints and the results files keep."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Sequence
from typing import Any

from nbdist.scaling.analysis import WITHIN_BEST, Analysis, Comparison
from nbdist.scaling.goodput import ASYNC_SAMPLES, MEASURED_STALENESS, SYNC_SAMPLES
from nbdist.scaling.inputs import Calibration
from nbdist.scaling.setups import Point

__all__ = ["table", "calibration_text", "measured_text", "comparison_text", "curves_text", "goodput_text", "report"]


def table(rows: Iterable[Sequence[Any]], headers: Sequence[str]) -> str:
    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:,.3g}" if abs(value) < 100 else f"{value:,.0f}"
        return str(value)

    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join("---" for _ in headers) + " |"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3g}"


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.3g} us"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.0%}"


def calibration_text(cal: Calibration) -> str:
    rules = cal.rules()
    lines = [
        f"model {cal.model}: {cal.params:,} parameters, batch {cal.batch_size}; measured on {cal.ranks} ranks of "
        f"{cal.host or 'this node'} ({cal.cores} cores) in {cal.seconds:.0f} s",
        f"- step (forward + backward): {_ms(cal.step_s)} ms alone, {cal.per_sample_s * 1e6:.3g} us per sample, "
        f"x{cal.busy_factor:.2f} with every core busy; "
        f"spread {cal.spread[0]:.2f}-{cal.spread[-1]:.2f} of the mean (to the 95th percentile)",
        f"- loops beyond the step: allreduce rank {_us(cal.allreduce_loop_s)}; a worker's exchange "
        + ", ".join(f"{r} {_us(cal.worker_exchange_s[r])}" for r in rules),
        f"- messages within the node: {_us(cal.p2p_alpha_s)} + {cal.p2p_beta_s * 1e9:.3g} ns/byte; "
        f"allreduce of two ranks {_us(cal.allreduce_alpha_s)} + {cal.allreduce_beta_s * 1e9:.3g} ns/byte; "
        + (
            f"between nodes {_us(cal.between_nodes[0])} + {cal.between_nodes[1] * 1e9:.3g} ns/byte"
            if cal.between_nodes
            else "between nodes not measured (one node: a --network preset stands in)"
        ),
        f"- master per update: loop {_us(cal.master_fixed_s)}, apply "
        + ", ".join(f"{r} {_us(cal.apply_s[r])}" for r in rules)
        + f"; {_us(cal.client_test_s)} per client per pass; a lone worker's wait beyond the service "
        f"{_us(cal.reply_latency_s)}; a message to a rank sleeping on busy cores {_us(cal.wake_s)} more",
        f"- one runnable rank more than cores: a step {_us(cal.round_extra_s)} more than even sharing, "
        f"a wait of {_us(cal.turn_s)} for a core each time a rank becomes runnable",
        f"- checkpoint share {_ms(cal.checkpoint_s)} ms; gradient noise scale B_simple "
        + (
            f"{cal.noise_scale:.0f} (16-84%: {cal.noise_range[0]:.0f}-{cal.noise_range[1]:.0f})"
            if cal.noise_scale and cal.noise_range
            else "not measured"
        )
        + f" from batches of {cal.noise_batches[0]} and {cal.noise_batches[1]}",
    ]
    return "\n".join(lines)


def measured_text(points: list[Point], reference: dict[str, float]) -> str:
    """The measured points; speed-up against one rank of the same scaling. "others' cores":
    what other processes on the node used meanwhile (the model's prediction for the point
    counts the cores they left; load.py)."""
    rows = []
    for p in points:
        one = reference.get(p.scaling)
        speedup = p.samples_per_s / one if one else None
        note = f"oversubscribed: {p.ranks} ranks on {p.cores} cores" if p.oversubscribed else ""
        others = (p.extra or {}).get("others")
        rows.append(
            [
                p.setup.label,
                p.scaling,
                p.ranks,
                p.workers,
                p.cores,
                others,
                p.batch,
                p.samples_per_s,
                speedup,
                None if speedup is None else speedup / p.ranks,
                None if speedup is None else speedup / p.cores,
                _ms(p.step_s),
                _ms(p.compute_s),
                _ms(p.communicate_s),
                _ms(p.wait_s),
                p.staleness_mean,
                p.staleness_p99,
                p.master_utilisation,
                note,
            ]
        )
    return table(
        rows,
        [
            "set-up",
            "scaling",
            "ranks",
            "workers",
            "cores",
            "others' cores",
            "batch",
            "samples/s",
            "speed-up",
            "eff./rank",
            "eff./core",
            "step ms",
            "compute",
            "communicate",
            "wait",
            "staleness",
            "p99",
            "master util.",
            "",
        ],
    )


def comparison_text(comparisons: list[Comparison]) -> str:
    """Each measured point beside its prediction; the errors' median and worst."""
    rows = [
        [
            c.measured.setup.label + (" (calibration)" if (c.measured.extra or {}).get("calibration") else ""),
            c.measured.scaling,
            c.measured.ranks,
            c.predicted.samples_per_s,
            c.measured.samples_per_s,
            _pct(c.error),
            c.predicted.staleness_mean if c.measured.setup.asynchronous else None,
            c.measured.staleness_mean if c.measured.setup.asynchronous else None,
            _pct(c.staleness_error),
            c.predicted.staleness_p99 if c.measured.setup.asynchronous else None,
            c.measured.staleness_p99 if c.measured.setup.asynchronous else None,
            f"{c.measured.ranks} ranks on {c.measured.cores} cores" if c.measured.oversubscribed else "",
            (c.measured.extra or {}).get("others"),
        ]
        for c in comparisons
    ]
    text = table(
        rows,
        [
            "set-up",
            "scaling",
            "ranks",
            "predicted samples/s",
            "measured",
            "error",
            "predicted staleness",
            "measured",
            "error",
            "p99 simulated",
            "p99 measured",
            "oversubscribed",
            "others' cores",
        ],
    )
    checked = [abs(c.error) for c in comparisons if not (c.measured.extra or {}).get("calibration")]
    if checked:
        text += f"\n\nprediction error on samples/s: median {statistics.median(checked):.1%}, worst {max(checked):.1%}"
    return text


def curves_text(analysis: Analysis) -> str:
    by_ranks: dict[int, dict[str, Point]] = {}
    for p in analysis.curves:
        by_ranks.setdefault(p.ranks, {})[p.setup.family] = p
    single = by_ranks.get(1, {}).get("allreduce")
    rows = []
    for ranks, points in sorted(by_ranks.items()):
        row: list[Any] = [ranks]
        for family in ("allreduce", "master/worker", "sub-masters"):
            found = points.get(family)
            width = 2 if family == "allreduce" else 3
            if found is None:
                row += [None] * width
                continue
            p = found
            efficiency = p.samples_per_s / (single.samples_per_s * ranks) if single else None
            row += [p.samples_per_s, efficiency]
            if family == "master/worker":
                row.append(
                    f"{p.staleness_mean:.3g} (p99 {p.staleness_p99:.3g})" if p.staleness_p99 else p.staleness_mean
                )
            elif family == "sub-masters":
                row.append(f"{p.setup.masters} x {p.workers // p.setup.masters}, staleness {p.staleness_mean:.3g}")
        rows.append(row)
    headers = ["ranks", "allreduce samples/s", "efficiency"]
    headers += ["master/worker samples/s", "efficiency", "staleness"]
    headers += ["sub-masters samples/s", "efficiency", "masters x workers"]
    saturation = "; ".join(f"{label}: W* = {w:.1f} workers" for label, w in sorted(analysis.saturation.items()))
    return (
        f"predicted on {analysis.machine} (efficiency: samples/s over ranks x one rank's)\n\n"
        + table(rows, headers)
        + f"\n\nmaster saturation (W* = (Z + S) / S, one master): {saturation}"
    )


def goodput_text(analysis: Analysis, target_samples: float) -> str:
    if not analysis.goodput:
        return "\n".join(analysis.notes)
    best: dict[str, dict[str, Any]] = {}
    for row in analysis.goodput:
        if row["group"] not in best or row["seconds"] < best[row["group"]]["seconds"]:
            best[row["group"]] = row
    rows = [
        [g, r["ranks"], r["samples_per_s"], r["ratio"], r["goodput"], _duration(r["seconds"]), _range(r)]
        for g, r in sorted(best.items(), key=lambda kv: kv[1]["seconds"])
    ]
    rec = analysis.recommendation
    fastest = rec["fastest"]
    noise = f"{rec['noise_scale']:.0f}" + (
        f" (16-84%: {rec['noise_range'][0]:.0f}-{rec['noise_range'][1]:.0f})" if rec.get("noise_range") else ""
    )
    lines = [
        f"time to a target one worker reaches after {target_samples:,.0f} samples, at each set-up's best rank count "
        f"(noise scale {noise})",
        "",
        table(rows, ["set-up", "ranks", "samples/s", "samples ratio", "goodput", "time to target", "range"]),
        "",
        f"recommended: {rec['label']} on {rec['ranks']} ranks, {_duration(rec['seconds'])} to target "
        f"(range {_range(rec)}: the noise scale's 16-84%"
        + (
            f" and the model's median error {rec['model_error']:.0%} at the measured points"
            if analysis.comparisons
            else "; the model's error is not known: no point was measured"
        )
        + f"); the fastest, {fastest['label']} on "
        f"{fastest['ranks']} ranks ({_duration(fastest['seconds'])}), is within {WITHIN_BEST:.0%} of it or uses "
        f"more ranks for less than {WITHIN_BEST:.0%}",
        f"assumed: synchronous steps of W x b samples need (1 + W b / B) / (1 + b / B) times one worker's "
        f"samples (McCandlish et al. 2018); an update tau versions stale counts as a step of (1 + tau) b samples, "
        f"times a penalty growing linearly with tau to {ASYNC_SAMPLES / SYNC_SAMPLES:.2f}x at tau = "
        f"{MEASURED_STALENESS:g} (bench/convergence.py, 8 workers); the noise scale was measured at the initial "
        f"weights (it grows as the loss falls, so large batches are judged pessimistically)",
    ]
    return "\n".join(lines + analysis.notes)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.3g} s"
    if seconds < 7200:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


def _range(row: dict[str, Any]) -> str:
    return f"{_duration(row['low'])}-{_duration(row['high'])}"


def report(
    cal: Calibration,
    measured: list[Point],
    reference: dict[str, float],
    analysis: Analysis,
    target_samples: float,
) -> str:
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(cal.when)) if cal.when else ""
    parts = [
        f"## Calibration ({when})",
        calibration_text(cal),
        "## Measured",
        measured_text(measured, reference) if measured else "nothing measured",
        "## Predicted beside measured",
        comparison_text(analysis.comparisons) if analysis.comparisons else "nothing measured",
        "## Predicted to many ranks",
        curves_text(analysis),
        "## Goodput and time to target",
        goodput_text(analysis, target_samples),
    ]
    return "\n\n".join(parts)
