"""A run's validation curve against the training samples seen, read from its log.

    curve = validation_curve("runs/my-run")            # [(samples_seen, val_acc), ...]
    samples_to_reach(curve, 0.95)                       # first samples count with val_acc >= 0.95, or None
    samples_to_reach(validation_curve(run, "val_loss"), 0.2, higher_is_better=False)

Samples are counted over all workers from the start of the run, so runs with different
numbers of workers compare on one axis. The points are every validation in the log: the
epochs' own (each epoch record carries `samples_seen`) and, with
`--validate-every-samples N`, the 'val' records in between. A log written before epoch
records carried `samples_seen` gives the epochs' cumulative samples instead.

A resumed run trains again from its checkpoint and records those samples again: a
record whose samples_seen falls below its predecessor's (of the same kind) replaces the
points it went back over, so the curve is the one of the training that went on.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from nbdist.metrics.log import read_log

__all__ = ["validation_curve", "samples_to_reach"]

Curve = list[tuple[int, float]]


def validation_curve(run_dir: Path | str, metric: str = "val_acc") -> Curve:
    """(samples_seen, value of `metric`) for every validation of the run in `run_dir`,
    sorted by samples; validations that did not report `metric` are left out."""
    vals, epochs = [], []
    for record in read_log(run_dir):
        if record["kind"] == "val":
            vals.append(record["values"])
        elif record["kind"] == "epoch":
            epochs.append(record["values"])
    points = _latest_training(_with_samples(epochs)) + _latest_training(vals)
    curve: dict[int, float] = {}
    for values in points:
        if values.get(metric) is not None:
            curve[int(values["samples_seen"])] = float(values[metric])  # one point per samples count
    return sorted(curve.items())


def samples_to_reach(
    curve: Iterable[tuple[int, float]], threshold: float, *, higher_is_better: bool = True
) -> int | None:
    """The first samples count at which the curve's value reaches `threshold` (>=, or <=
    where lower is better, e.g. a loss); None if it never does."""
    for samples, value in sorted(curve):
        if (value >= threshold) if higher_is_better else (value <= threshold):
            return samples
    return None


def _with_samples(epochs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Epoch records with samples_seen; older logs' get the cumulative count of their
    epochs (an epoch recorded again after a resume replaces the earlier record)."""
    if all("samples_seen" in e for e in epochs):
        return epochs
    latest = {int(e["epoch"]): e for e in epochs}
    seen, out = 0, []
    for number in sorted(latest):
        seen += int(latest[number].get("samples") or 0)
        out.append({**latest[number], "samples_seen": seen})
    return out


def _latest_training(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Records in the order written; one whose samples_seen went back (a resume) drops
    the earlier ones past it. (Equal counts stay: two epochs that ended at the same update
    of a master; at one samples count the curve keeps the later record.)"""
    kept: list[dict[str, Any]] = []
    for values in records:
        seen = int(values["samples_seen"])
        while kept and int(kept[-1]["samples_seen"]) > seen:
            kept.pop()
        kept.append(values)
    return kept
