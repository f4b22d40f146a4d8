"""A scaling study's page (a run of kind "scale", nbdist/scaling/store.py): samples/s and
efficiency against ranks, the measured points as markers and the model's predicted
curves as lines, with the calibration and the recommendation above them.

Like the run plots (plots.py), the figures are Bokeh's, fed by `ColumnDataSource.stream`:
each poll of the store sends the points measured since the last one, and the curves once
the study has predicted them.
"""

from __future__ import annotations

from typing import Any

import panel as pn
from bokeh.models import ColumnDataSource

from nbdist.dashboard.panes import LiveMarkdown
from nbdist.dashboard.plots import _color, named_figure
from nbdist.dashboard.sources import RecordSource, RunInfo

__all__ = ["ScalingView", "FAMILIES"]

FAMILIES = ("allreduce", "master/worker", "sub-masters")
_DASHES = {"allreduce": "solid", "master/worker": "dashed", "sub-masters": "dotted"}
_COLUMNS = ("ranks", "samples_per_s", "efficiency", "label")


class ScalingView:
    """The live part of the page for one scaling study (the dashboard's `_RunView` for runs)."""

    def __init__(self, source: RecordSource, info: RunInfo):
        self.source, self.info = source, info
        self.reference: float | None = None  # one rank's samples/s: what efficiency divides by
        self.points = 0
        self.throughput = named_figure(
            "scaling-throughput", "Samples/s by ranks: measured (markers), predicted (lines)", "ranks", "samples/s",
            x_axis_type="log", y_axis_type="log",
        )  # fmt: skip
        self.efficiency = named_figure(
            "scaling-efficiency", "Efficiency: samples/s over ranks x one rank's", "ranks", "efficiency",
            x_axis_type="log",
        )  # fmt: skip
        self.predicted = {family: _source() for family in FAMILIES}
        for i, family in enumerate(FAMILIES):
            for fig, y in ((self.throughput, "samples_per_s"), (self.efficiency, "efficiency")):
                fig.line(
                    "ranks", y, source=self.predicted[family], color=_color(i), line_dash=_DASHES[family],
                    legend_label=f"{family} (predicted)", name=f"nbdist-predicted-{family}",
                )  # fmt: skip
        self.measured: dict[str, ColumnDataSource] = {}
        for fig in (self.throughput, self.efficiency):
            fig.legend.location = "top_left"
            fig.legend.click_policy = "hide"
        self.header = LiveMarkdown("", sizing_mode="stretch_width", name="nbdist-scaling-header")
        self.summary = LiveMarkdown("", sizing_mode="stretch_width", name="nbdist-scaling-summary")
        self.panel = pn.Column(
            self.header,
            pn.Row(pn.pane.Bokeh(self.throughput), pn.pane.Bokeh(self.efficiency)),
            self.summary,
        )
        self.header.object = self._header(info, None)

    def _measured(self, label: str) -> ColumnDataSource:
        """The markers of one set-up, made when its first point comes."""
        if label not in self.measured:
            source = _source()
            color = _color(len(self.measured) + len(FAMILIES))
            for fig, y in ((self.throughput, "samples_per_s"), (self.efficiency, "efficiency")):
                fig.scatter(
                    "ranks", y, source=source, size=9, color=color, legend_label=label, name=f"nbdist-measured-{label}"
                )
            self.measured[label] = source
        return self.measured[label]

    def tick(self) -> int:
        records = self.source.poll()
        for record in records:
            values, kind = record["values"], record["kind"]
            if kind == "calibration":
                self.header.object = self._header(self.info, values)
            elif kind == "measured":
                self._add_measured(values["measured"])
            elif kind == "predicted":
                self._add_predicted(values)
            elif kind == "summary":
                self.summary.object = _summary(values)
        info = self.source.info()
        if info is not None and info.status != self.info.status:
            self.info = info
        return len(records)

    def _add_measured(self, point: dict[str, Any]) -> None:
        if point["setup"]["topology"] == "allreduce" and point["ranks"] == 1 and point["scaling"] == "weak":
            self.reference = point["samples_per_s"]
        label = point["label"] + (", strong" if point["scaling"] == "strong" else "")
        _stream(self._measured(label), [point], self.reference)
        self.points += 1

    def _add_predicted(self, point: dict[str, Any]) -> None:
        if point["family"] == "allreduce" and point["ranks"] == 1 and self.reference is None:
            self.reference = point["samples_per_s"]
        _stream(self.predicted[point["family"]], [point], self.reference)

    def _header(self, info: RunInfo, calibration: dict[str, Any] | None) -> str:
        parts = [f"**{info.id}**", f"**{info.status}**", "scaling study"]
        if calibration is not None:
            parts.append(
                f"{calibration['model']}: {calibration['params']:,} parameters, batch {calibration['batch_size']}, "
                f"a step {calibration['step_s'] * 1e3:.3g} ms, calibrated on {calibration['ranks']} ranks "
                f"({calibration['cores']} cores)"
            )
        return "  ·  ".join(parts)


def _source() -> ColumnDataSource:
    return ColumnDataSource({c: [] for c in _COLUMNS})


def _stream(source: ColumnDataSource, points: list[dict[str, Any]], reference: float | None) -> None:
    source.stream(
        {
            "ranks": [p["ranks"] for p in points],
            "samples_per_s": [p["samples_per_s"] for p in points],
            "efficiency": [
                p["samples_per_s"] / (reference * p["ranks"]) if reference else float("nan") for p in points
            ],
            "label": [p["label"] for p in points],
        }
    )


def _summary(values: dict[str, Any]) -> str:
    rec = values.get("recommendation") or {}
    lines = []
    if values.get("median_error") is not None:
        lines.append(
            f"Prediction error at the measured points: median {values['median_error']:.1%}, "
            f"worst {values['worst_error']:.1%}."
        )
    if rec:
        lines.append(
            f"**Recommended: {rec['label']} on {rec['ranks']} ranks**, {rec['seconds']:.3g} s to target "
            f"({rec['low']:.3g}-{rec['high']:.3g} s)."
        )
    return "\n\n".join(lines)
