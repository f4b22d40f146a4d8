"""The study views drawn from the trials' final values: optimisation history, population
per generation, parallel coordinates, slices, contour and parameter importances.

Bokeh figures made once; a new trial or another objective replaces their sources' data
(a few thousand rows at most), and never the figures. Every figure and the renderers a
test counts carry names (`nbdist-<view>`, `<view>-<part>`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from bokeh.models import BasicTicker, ColumnDataSource, FactorRange, FixedTicker, HoverTool, LinearColorMapper
from bokeh.palettes import Viridis256

from nbdist.dashboard.plots import WIDTH, named_figure
from nbdist.dashboard.study.frames import ParamAxis

__all__ = [
    "value_mapper",
    "HistoryView",
    "PopulationView",
    "ParallelView",
    "SliceView",
    "ContourView",
    "ImportanceView",
]

WIDE = 2 * WIDTH + 20


def value_mapper(maximize: bool) -> LinearColorMapper:
    """Colours of an objective's values: the better, the brighter, whichever the direction."""
    return LinearColorMapper(palette=Viridis256 if maximize else Viridis256[::-1], low=0, high=1)


def fit_mapper(mapper: LinearColorMapper, values: list[float]) -> None:
    if values:
        low, high = float(np.min(values)), float(np.max(values))
        mapper.update(low=low, high=high if high > low else low + 1e-12)


def category_ticks(axis_model: Any, axis: ParamAxis | None) -> None:
    """A category parameter's axis: its categories at their indices; else plain numbers."""
    if axis is not None and axis.kind == "category":
        axis_model.ticker = FixedTicker(ticks=list(range(len(axis.categories))))
        axis_model.major_label_overrides = {i: c for i, c in axis.ticks().items()}
    elif isinstance(axis_model.ticker, FixedTicker):  # was a category's
        axis_model.ticker = BasicTicker()
        axis_model.major_label_overrides = {}


class HistoryView:
    """Each trial's value by trial number (its fold spread, its state's colour) and the
    best complete value so far."""

    def __init__(self) -> None:
        self.points = ColumnDataSource({c: [] for c in ("trial", "value", "low", "high", "state", "color", "epochs")})
        self.best = ColumnDataSource({"trial": [], "best": []})
        fig = named_figure("history", "Optimisation history", "trial", "value", width=WIDE)
        fig.segment("trial", "low", "trial", "high", source=self.points, color="gray", name="history-spread")
        dots = fig.scatter(
            "trial", "value", source=self.points, color="color", size=6, legend_field="state", name="history-points"
        )
        fig.step("trial", "best", source=self.best, mode="after", color="black", line_width=2, name="history-best")
        fig.add_tools(
            HoverTool(
                renderers=[dots],
                tooltips=[("trial", "@trial"), ("value", "@value"), ("state", "@state"), ("epochs", "@epochs")],
            )
        )
        fig.legend.location = "top_right"
        self.figure = fig

    def show(self, points: dict[str, list], best: dict[str, list], objective: str) -> None:
        self.points.data, self.best.data = points, best
        self.figure.title.text = f"Optimisation history: {objective} ({len(points['trial'])} trials)"
        self.figure.yaxis.axis_label = objective


class PopulationView:
    def __init__(self) -> None:
        self.source = ColumnDataSource({"generation": [], "value": [], "trial": []})
        fig = named_figure("population", "Population per generation", "generation (trial batch)", "value")
        dots = fig.scatter("generation", "value", source=self.source, size=7, name="population-points")
        fig.add_tools(HoverTool(renderers=[dots], tooltips=[("trial", "@trial"), ("value", "@value")]))
        self.figure = fig

    def show(self, columns: dict[str, list], objective: str) -> None:
        self.source.data = columns
        self.figure.title.text = f"Population per generation ({objective})"
        self.figure.yaxis.axis_label = objective


class ParallelView:
    """A line per complete trial across the parameters' axes, coloured by its value."""

    def __init__(self, maximize: bool) -> None:
        self.source = ColumnDataSource({"xs": [], "ys": [], "value": [], "trial": []})
        self.mapper = value_mapper(maximize)
        fig = named_figure("parallel-coordinates", "Parallel coordinates", "", "scaled value", width=WIDE)
        lines = fig.multi_line(
            "xs",
            "ys",
            source=self.source,
            line_color={"field": "value", "transform": self.mapper},
            line_width=2,
            line_alpha=0.6,
            name="parallel-lines",
        )
        fig.add_tools(HoverTool(renderers=[lines], tooltips=[("trial", "@trial"), ("value", "@value")]))
        self.figure = fig

    def show(self, columns: dict[str, list], names: list[str], objective: str) -> None:
        axes = [*names, objective]
        self.figure.xaxis.ticker = FixedTicker(ticks=list(range(len(axes))))
        self.figure.xaxis.major_label_overrides = dict(enumerate(axes))
        fit_mapper(self.mapper, columns["value"])
        self.source.data = columns
        self.figure.title.text = f"Parallel coordinates: {objective} ({len(columns['trial'])} complete trials)"


class SliceView:
    """The objective against each parameter, one small figure per parameter, coloured by
    trial number (later trials brighter)."""

    def __init__(self) -> None:
        self.figures: dict[str, Any] = {}
        self.sources: dict[str, ColumnDataSource] = {}
        self.mappers: dict[str, LinearColorMapper] = {}

    def ensure(self, axes: dict[str, ParamAxis]) -> bool:
        """Figures for parameters not seen before; True when some were made."""
        new = [a for name, a in axes.items() if name not in self.figures]
        for axis in new:
            source = ColumnDataSource({"x": [], "value": [], "trial": []})
            mapper = LinearColorMapper(palette=Viridis256, low=0, high=1)
            fig = named_figure(
                f"slice-{axis.name}",
                f"Slice: {axis.name}",
                axis.name,
                "value",
                width=340,
                height=260,
                x_axis_type="log" if axis.kind == "log" else "linear",
            )
            dots = fig.scatter(
                "x",
                "value",
                source=source,
                size=5,
                alpha=0.7,
                color={"field": "trial", "transform": mapper},
                name="slice-points",
            )
            fig.add_tools(HoverTool(renderers=[dots], tooltips=[("trial", "@trial"), ("value", "@value")]))
            category_ticks(fig.xaxis[0], axis)
            self.figures[axis.name], self.sources[axis.name], self.mappers[axis.name] = fig, source, mapper
        return bool(new)

    def show(self, name: str, axis: ParamAxis, columns: dict[str, list], objective: str) -> None:
        fit_mapper(self.mappers[name], columns["trial"])
        category_ticks(self.figures[name].xaxis[0], axis)
        self.sources[name].data = columns
        self.figures[name].yaxis.axis_label = objective


class ContourView:
    """The objective over two parameters: interpolated between the trials, which are drawn on it."""

    def __init__(self, maximize: bool) -> None:
        self.points = ColumnDataSource({"x": [], "y": [], "value": [], "trial": []})
        self.image = ColumnDataSource({"image": [], "x": [], "y": [], "dw": [], "dh": []})
        self.mapper = value_mapper(maximize)
        fig = named_figure("contour", "Contour", "", "", width=WIDTH + 80, height=WIDTH - 40)
        fig.image(
            image="image", x="x", y="y", dw="dw", dh="dh", source=self.image, color_mapper=self.mapper, alpha=0.85
        )
        fig.renderers[-1].name = "contour-image"
        dots = fig.scatter(
            "x",
            "y",
            source=self.points,
            size=6,
            fill_color={"field": "value", "transform": self.mapper},
            line_color="white",
            name="contour-points",
        )
        fig.add_tools(HoverTool(renderers=[dots], tooltips=[("trial", "@trial"), ("value", "@value")]))
        self.figure = fig

    def show(
        self,
        points: dict[str, list],
        image: dict[str, list],
        x_axis: ParamAxis,
        y_axis: ParamAxis,
        objective: str,
    ) -> None:
        fig = self.figure
        fig.xaxis.axis_label, fig.yaxis.axis_label = x_axis.label, y_axis.label
        category_ticks(fig.xaxis[0], x_axis)
        category_ticks(fig.yaxis[0], y_axis)
        fit_mapper(self.mapper, points["value"])
        self.image.data, self.points.data = image, points
        fig.title.text = f"Contour: {objective} over {x_axis.name} and {y_axis.name} ({len(points['trial'])} trials)"


class ImportanceView:
    """The parameters by importance, the most important at the top."""

    def __init__(self) -> None:
        self.source = ColumnDataSource({"param": [], "importance": [], "text": []})
        fig = named_figure(
            "importance", "Parameter importance", "importance", "", y_range=FactorRange(), width=WIDTH + 80
        )
        bars = fig.hbar(y="param", right="importance", height=0.7, source=self.source, name="importance-bars")
        fig.add_tools(HoverTool(renderers=[bars], tooltips=[("parameter", "@param"), ("importance", "@text")]))
        fig.x_range.start = 0
        self.figure = fig
        self.ranked: list[tuple[str, float]] = []

    def show(self, ranked: list[tuple[str, float]], title: str) -> None:
        self.ranked = ranked
        self.figure.y_range.factors = [name for name, _ in reversed(ranked)]  # factors go bottom up
        self.source.data = {
            "param": [name for name, _ in ranked],
            "importance": [value for _, value in ranked],
            "text": [f"{value:.3f}" for _, value in ranked],
        }
        self.figure.title.text = title
