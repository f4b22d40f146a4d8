"""What happened to each trial on the way, from the run store's trial events: learning
curves with the epochs where trials were pruned, promoted or left at a rung, and a PBT
population's lineage (who took whose state, when) and hyper-parameter schedules.

Learning curves are append-only: each new intermediate value joins its trial's curve as
one segment from the trial's previous value, so the view streams new rows and never
redraws what it has. Marks wait for the value they sit on when it comes later.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from nbdist.store import TrialRow

__all__ = ["CurveFeed", "MARKS", "lineage_columns", "lineage_members", "schedule_lines", "schedule_params"]

# The marks on the learning curves: event kind -> (legend, marker, colour).
MARKS = {
    "pruned": ("pruned", "x", "#d62728"),
    "promoted": ("promoted", "triangle", "#2ca02c"),
    "stopped": ("left at its rung", "square", "#ff7f0e"),
}
_FIRST = {"value": 0}  # in one batch, values before the marks that sit on them


def _columns(*names: str) -> dict[str, list]:
    return {name: [] for name in names}


class CurveFeed:
    """Turns trial events, as they arrive, into the new rows of the learning-curve view:
    points, segments joining a trial's consecutive values, and marks."""

    def __init__(self) -> None:
        self.values: dict[int, dict[int, float]] = {}  # trial -> epoch -> its intermediate value
        self._seen: set[tuple[int, str, int]] = set()
        self._waiting: list[dict[str, Any]] = []  # marks whose value has not come yet

    def add(self, events: Iterable[dict[str, Any]]) -> tuple[dict[str, list], dict[str, list], dict[str, list]]:
        """New (points, segments, marks) columns for `events` (ones already added are skipped)."""
        points = _columns("epoch", "value", "trial")
        segments = _columns("x0", "y0", "x1", "y1", "trial")
        marks = _columns("epoch", "value", "trial", "kind", "legend", "marker", "color")
        fresh = []
        for e in events:
            key = (e["number"], e["kind"], e["epoch"])
            if (e["kind"] == "value" or e["kind"] in MARKS) and key not in self._seen:
                self._seen.add(key)
                fresh.append(e)
        fresh.sort(key=lambda e: (e["number"], e["epoch"], _FIRST.get(e["kind"], 1)))
        for e in fresh:
            if e["kind"] == "value":
                self._add_value(e, points, segments)
        waiting, self._waiting = self._waiting + [e for e in fresh if e["kind"] in MARKS], []
        for e in waiting:
            value = (e["data"] or {}).get("value")
            if value is None:
                value = self.values.get(e["number"], {}).get(e["epoch"])
            if value is None:
                self._waiting.append(e)
                continue
            legend, marker, color = MARKS[e["kind"]]
            for name, item in zip(
                marks, (e["epoch"], float(value), e["number"], e["kind"], legend, marker, color), strict=True
            ):
                marks[name].append(item)
        return points, segments, marks

    def _add_value(self, e: dict[str, Any], points: dict[str, list], segments: dict[str, list]) -> None:
        value = (e["data"] or {}).get("value")
        if value is None:
            return
        number, epoch, value = e["number"], e["epoch"], float(value)
        curve = self.values.setdefault(number, {})
        before = [ep for ep in curve if ep < epoch]
        curve[epoch] = value
        for name, item in zip(points, (epoch, value, number), strict=True):
            points[name].append(item)
        if before:
            last = max(before)
            for name, item in zip(segments, (last, curve[last], epoch, value, number), strict=True):
                segments[name].append(item)


def lineage_members(events: Sequence[dict[str, Any]], trials: Sequence[TrialRow], pbt: bool) -> list[int]:
    """The trials of a PBT population: every trial of a PBT study, else those an exploit names."""
    if pbt:
        return sorted(t.number for t in trials)
    named = {e["number"] for e in events if e["kind"] == "exploit"}
    named |= {int(e["data"]["source"]) for e in events if e["kind"] == "exploit"}
    return sorted(named)


def lineage_columns(
    events: Sequence[dict[str, Any]], members: Sequence[int], values: dict[int, dict[int, float]]
) -> tuple[dict[str, list], dict[str, list]]:
    """The population over epochs: each member's intermediate values at (epoch, member),
    and each exploit as an edge from the source member to the one that took its state
    after that epoch (with the parameters it changed)."""
    chosen = set(members)
    points = _columns("epoch", "trial", "value")
    for number in sorted(chosen):
        for epoch, value in sorted(values.get(number, {}).items()):
            points["epoch"].append(epoch)
            points["trial"].append(number)
            points["value"].append(value)
    edges = _columns("epoch", "source", "receiver", "change")
    for e in sorted((e for e in events if e["kind"] == "exploit"), key=lambda e: (e["epoch"], e["number"])):
        data = e["data"] or {}
        previous, params = data.get("previous") or {}, data.get("params") or {}
        change = ", ".join(
            f"{name} {_short(previous.get(name))} -> {_short(value)}"
            for name, value in sorted(params.items())
            if previous.get(name) != value
        )
        edges["epoch"].append(e["epoch"])
        edges["source"].append(int(data.get("source", -1)))
        edges["receiver"].append(e["number"])
        edges["change"].append(change)
    return points, edges


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def schedule_params(events: Sequence[dict[str, Any]]) -> list[str]:
    """The numeric parameters that a 'params' event sets (those a schedule can draw)."""
    names = {
        name
        for e in events
        if e["kind"] == "params"
        for name, value in (e["data"] or {}).items()
        if isinstance(value, (int, float)) and not isinstance(value, bool)
    }
    return sorted(names)


def schedule_lines(
    events: Sequence[dict[str, Any]], trials: Sequence[TrialRow], members: Sequence[int], param: str
) -> dict[str, list]:
    """Each member's value of `param` over its epochs, as steps: from each 'params' event
    (epoch 0: what it started with; later: an exploit's new parameters) to the next, and
    the last to the epochs it trained."""
    trained = {t.number: t.epochs or 0 for t in trials}
    by_trial: dict[int, list[tuple[int, Any]]] = {}
    for e in events:
        if e["kind"] == "params" and e["number"] in members and param in (e["data"] or {}):
            by_trial.setdefault(e["number"], []).append((e["epoch"], e["data"][param]))
    lines = _columns("xs", "ys", "trial")
    for number, steps in sorted(by_trial.items()):
        steps.sort()
        end = max(trained.get(number, 0), steps[-1][0])
        xs: list[float] = []
        ys: list[float] = []
        for (epoch, value), after in zip(steps, [s[0] for s in steps[1:]] + [end], strict=True):
            xs += [epoch, after]
            ys += [float(value), float(value)]
        lines["xs"].append(xs)
        lines["ys"].append(ys)
        lines["trial"].append(number)
    return lines
