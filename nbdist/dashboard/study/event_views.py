"""The study views drawn from what happened to trials on the way and from several
objectives: learning curves with pruned and promoted trials marked, the Pareto front, a
PBT population's lineage and hyper-parameter schedules.

The learning curves only grow (`ColumnDataSource.stream`: the browser gets the new rows);
the others replace their data when the trials change.
"""

from __future__ import annotations

import math
from typing import Any

from bokeh.models import ColumnDataSource, HoverTool
from bokeh.models.annotations.arrows import Arrow, VeeHead
from bokeh.palettes import Category10_10

from nbdist.dashboard.plots import named_figure
from nbdist.dashboard.study.frames import ParamAxis
from nbdist.dashboard.study.trial_views import WIDE, fit_mapper, value_mapper

__all__ = ["CurvesView", "ParetoView", "LineageView", "ScheduleView"]

PARETO_SIZE = 560


def _stream(source: ColumnDataSource, columns: dict[str, Any]) -> None:
    if any(len(rows) for rows in columns.values()):
        source.stream(columns)


class CurvesView:
    """Intermediate values: every trial's curve over its epochs, and marks where trials
    were pruned, promoted, or left at their rung."""

    def __init__(self, objective: str) -> None:
        self.points = ColumnDataSource({"epoch": [], "value": [], "trial": []})
        self.segments = ColumnDataSource({"x0": [], "y0": [], "x1": [], "y1": [], "trial": []})
        self.marks = ColumnDataSource({c: [] for c in ("epoch", "value", "trial", "kind", "legend", "marker", "color")})
        fig = named_figure("intermediate", "Intermediate values", "epoch", objective, width=WIDE, height=360)
        fig.segment("x0", "y0", "x1", "y1", source=self.segments, color="#1f77b4", alpha=0.35, name="curve-segments")
        dots = fig.scatter("epoch", "value", source=self.points, size=3, alpha=0.5, name="curve-points")
        marked = fig.scatter(
            "epoch",
            "value",
            source=self.marks,
            marker="marker",
            color="color",
            size=10,
            line_width=2,
            legend_field="legend",
            name="curve-marks",
        )
        fig.add_tools(
            HoverTool(renderers=[dots], tooltips=[("trial", "@trial"), ("epoch", "@epoch"), ("value", "@value")]),
            HoverTool(renderers=[marked], tooltips=[("trial", "@trial"), ("epoch", "@epoch"), ("", "@legend")]),
        )
        fig.legend.location = "top_right"
        self.figure, self.objective = fig, objective
        self._trials: set[int] = set()  # those with a point drawn
        self._counts: dict[str, int] = {}  # marks drawn, by kind

    def add(self, points: dict[str, list], segments: dict[str, list], marks: dict[str, list]) -> None:
        _stream(self.points, points)
        _stream(self.segments, segments)
        _stream(self.marks, marks)
        self._trials.update(points["trial"])
        for kind in marks["kind"]:
            self._counts[kind] = self._counts.get(kind, 0) + 1
        counts = {k: self._counts.get(k, 0) for k in ("pruned", "promoted")}
        self.figure.title.text = (
            f"Intermediate values: {self.objective} of {len(self._trials)} trials "
            f"({counts['pruned']} pruned, {counts['promoted']} promotions)"
        )


class ParetoView:
    """Two objectives against each other: the trials no other beats in both (the front,
    joined in order) and the rest."""

    def __init__(self) -> None:
        columns = ("x", "y", "trial")
        self.front = ColumnDataSource({c: [] for c in columns})
        self.others = ColumnDataSource({c: [] for c in columns})
        fig = named_figure("pareto", "Pareto front", "", "", width=PARETO_SIZE, height=PARETO_SIZE - 60)
        rest = fig.scatter("x", "y", source=self.others, color="#9aa5b1", size=5, alpha=0.6, name="pareto-others")
        fig.line("x", "y", source=self.front, color="#d62728", line_width=1.5, name="pareto-line")
        best = fig.scatter("x", "y", source=self.front, color="#d62728", size=8, name="pareto-front")
        tips = [("trial", "@trial"), ("x", "@x"), ("y", "@y")]
        fig.add_tools(HoverTool(renderers=[rest, best], tooltips=tips))
        self.figure = fig

    def show(self, front: dict[str, list], others: dict[str, list], x_name: str, y_name: str) -> None:
        self.figure.xaxis.axis_label, self.figure.yaxis.axis_label = x_name, y_name
        self.front.data, self.others.data = front, others
        n = len(front["trial"])
        self.figure.title.text = f"Pareto front: {n} of {n + len(others['trial'])} complete trials"


class LineageView:
    """A PBT population over epochs: each member's value at each epoch (colour), and an
    arrow from the member whose state was taken to the member that took it."""

    def __init__(self, maximize: bool) -> None:
        self.points = ColumnDataSource({"epoch": [], "trial": [], "value": []})
        self.edges = ColumnDataSource({"epoch": [], "source": [], "receiver": [], "change": []})
        self.mapper = value_mapper(maximize)
        fig = named_figure("lineage", "PBT lineage", "epoch", "trial (population member)", width=WIDE, height=360)
        dots = fig.scatter(
            "epoch",
            "trial",
            source=self.points,
            size=9,
            marker="square",
            color={"field": "value", "transform": self.mapper},
            name="lineage-points",
        )
        taken = fig.segment(
            "epoch",
            "source",
            "epoch",
            "receiver",
            source=self.edges,
            color="black",
            line_width=2,
            name="lineage-exploits",
        )
        heads = Arrow(
            end=VeeHead(size=9, fill_color="black"),
            source=self.edges,
            x_start="epoch",
            y_start="source",
            x_end="epoch",
            y_end="receiver",
        )
        heads.update(line_alpha=0)  # the segments are the arrows' bodies (they carry the hover)
        fig.add_layout(heads)
        fig.add_tools(
            HoverTool(renderers=[dots], tooltips=[("trial", "@trial"), ("epoch", "@epoch"), ("value", "@value")]),
            HoverTool(
                renderers=[taken],
                tooltips=[
                    ("after epoch", "@epoch"),
                    ("", "trial @receiver took trial @source's state"),
                    ("", "@change"),
                ],
            ),
        )
        self.figure = fig

    def show(self, points: dict[str, list], edges: dict[str, list]) -> None:
        fit_mapper(self.mapper, points["value"])
        self.points.data, self.edges.data = points, edges
        members = len(set(points["trial"]))
        self.figure.title.text = f"PBT lineage: {members} members, {len(edges['epoch'])} exploits"


class ScheduleView:
    """Each member's value of one hyper-parameter over its epochs (PBT changes it at exploits)."""

    def __init__(self) -> None:
        self.source = ColumnDataSource({"xs": [], "ys": [], "trial": [], "color": []})
        self.figure = named_figure("schedule", "Hyper-parameter schedules", "epoch", "", width=WIDE, height=320)
        lines = self.figure.multi_line(
            "xs", "ys", source=self.source, line_color="color", line_width=2, alpha=0.8, name="schedule-lines"
        )
        self.figure.add_tools(HoverTool(renderers=[lines], tooltips=[("trial", "@trial")]))

    def show(self, lines: dict[str, list], axis: ParamAxis | None, name: str) -> None:
        if axis is not None and axis.kind == "log":
            lines = {**lines, "ys": [[_log10(v) for v in ys] for ys in lines["ys"]]}
        colors = [Category10_10[n % len(Category10_10)] for n in lines["trial"]]
        self.source.data = {**lines, "color": colors}
        self.figure.yaxis.axis_label = axis.label if axis is not None else name
        self.figure.title.text = f"Hyper-parameter schedules: {name} of {len(lines['trial'])} trials"


def _log10(value: float) -> float:
    return math.log10(value) if value > 0 else float("nan")
