"""The hyper-parameter study view: the population as it evolves, the figure of merit of
every trial with its spread over folds, the best so far, and the parameters against the
figure of merit (parallel coordinates).

Trials are read from the run store as they finish; each finished trial is appended to
the plots once. The parallel coordinates are normalised per parameter over the trials
seen so far, so they are redrawn as a whole (a study has tens to hundreds of trials).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import holoviews as hv
import numpy as np
import pandas as pd
from holoviews.streams import Pipe

from nbdist.dashboard.plots import HEIGHT, WIDTH
from nbdist.store import RunStore, TrialRow

__all__ = ["StudyPlots", "FINISHED"]

FINISHED = ("complete", "pruned", "failed")


def _named(name: str) -> Callable[[Any, Any], None]:
    """A plot hook that names the Bokeh figure `nbdist-<name>`, for tests and scripts."""

    def hook(plot: Any, element: Any) -> None:
        plot.state.name = f"nbdist-{name}"

    return hook


_COLUMNS = ["trial", "generation", "fom", "low", "high", "best"]


class StudyPlots:
    def __init__(self, store: RunStore, study_id: str):
        self.store, self.study_id = store, study_id
        study = store.study(study_id)
        self.maximize = study.get("direction") == "maximize"
        self.objective = study.get("objective") or "figure of merit"
        self._sent: set[int] = set()
        self._best: float | None = None
        self._finished: list[TrialRow] = []
        # The whole table on each update, not only the new rows (a study has tens to hundreds
        # of trials): under a notebook cell, streamed rows reached the browser's plots
        # unevenly (one plot of the same Buffer showed 5 trials, the other 3).
        self._rows: list[tuple] = []
        self.trials = Pipe(data=_table(self._rows))
        self.parallel = Pipe(data=[])
        fom = self.objective
        population = hv.DynamicMap(lambda data: hv.Scatter(data, "generation", ["fom", "trial"]), streams=[self.trials])
        self.population = population.opts(
            title=f"Population per generation ({fom})",
            width=WIDTH,
            height=HEIGHT,
            size=7,
            tools=["hover"],
            hooks=[_named("population")],
            xlabel="generation (trial batch for bayes/random)",
            ylabel=fom,
        )
        # One map drawing the three layers (not three maps on one stream, multiplied):
        # under a notebook cell only the first update of such a product reached the browser.
        per_trial = hv.DynamicMap(_per_trial_layers, streams=[self.trials])
        self.per_trial = per_trial.opts(
            title=f"{fom} per trial",
            width=WIDTH,
            height=HEIGHT,
            hooks=[_named("trials")],
            xlabel="trial",
            ylabel=fom,
            legend_position="top_right",
        )
        coords = hv.DynamicMap(_parallel_element, streams=[self.parallel])
        self.parallel_plot = coords.opts(
            title="Parameters vs figure of merit",
            width=2 * WIDTH + 20,
            height=HEIGHT,
            color="fom",
            cmap="viridis_r" if not self.maximize else "viridis",
            colorbar=True,
            line_width=2,
            alpha=0.8,
            hooks=[_named("parallel-coordinates")],
            xlabel="",
            ylabel="normalised value",
            tools=["hover"],
        )

    def update(self) -> int:
        """Append the trials that finished since the last update; returns how many."""
        new = [t for t in self.store.trials(self.study_id) if t.state in FINISHED and t.number not in self._sent]
        rows = []
        for t in sorted(new, key=lambda t: t.ended or 0):
            self._sent.add(t.number)
            if t.fom is None or not math.isfinite(t.fom):
                continue
            better = self._best is None or (t.fom > self._best if self.maximize else t.fom < self._best)
            self._best = t.fom if better else self._best
            spread = t.fom_std or 0.0
            generation = t.generation if t.generation is not None else (t.group or 0)
            rows.append((t.number, generation, t.fom, t.fom - spread, t.fom + spread, self._best))
            self._finished.append(t)
        if rows:
            self._rows += rows
            self.trials.send(_table(self._rows))
            self.parallel.send(parallel_paths(self._finished, self.objective))
        return len(new)


def _per_trial_layers(data: pd.DataFrame) -> hv.Overlay:
    """Each trial's figure of merit, its spread over folds, and the best so far."""
    spread = hv.Segments(data, ["trial", "low", "trial", "high"], label="fold spread").opts(color="gray")
    points = hv.Scatter(data, "trial", ["fom", "generation"], label="mean over folds").opts(size=6, tools=["hover"])
    best = hv.Curve(data, "trial", "best", label="best so far").opts(
        color="black", line_width=2, interpolation="steps-post"
    )
    return spread * points * best


def _table(rows: list[tuple]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=_COLUMNS).astype("float64")


# Before the first trial ends: one path of one blank point, no named ticks. HoloViews
# can neither colour an empty Path by its value nor draw an empty list of ticks, and the
# study's page, opened as the study starts, would fail to draw.
NO_PATHS = [{"x": np.zeros(1), "y": np.full(1, np.nan), "fom": np.nan}]


def _parallel_element(data: Any) -> hv.Path:
    paths, axes = data if data else ([], [])
    return hv.Path(paths or NO_PATHS, ["x", "y"], ["fom"]).opts(xticks=list(enumerate(axes)) or None)


def _numeric_axis(lo: float, hi: float) -> Callable[[Any], float]:
    """A parameter's values scaled to [0, 1] over [lo, hi], in decades where they span more
    than two (log-scaled spaces)."""
    f: Callable[[Any], Any] = np.log10 if lo > 0 and hi / lo > 100 else (lambda v: v)
    lo_, hi_ = f(lo), f(hi)
    return lambda v: 0.5 if hi_ == lo_ else (f(v) - lo_) / (hi_ - lo_)


def _category_axis(levels: list[str]) -> Callable[[Any], float]:
    """Categories placed evenly over [0, 1], in `levels` order."""
    return lambda v: levels.index(str(v)) / max(len(levels) - 1, 1)


def parallel_paths(trials: list[TrialRow], objective: str) -> tuple[list[dict[str, Any]], list[str]]:
    """One path per trial across the parameter axes (x = axis index), each parameter
    scaled to [0, 1] over the trials; categories placed evenly; the last axis is the fom.
    Returns the paths and the axes' names."""
    names = sorted({k for t in trials for k in t.params})
    axes: list[Callable[[Any], float]] = []
    for name in names:
        values = [t.params.get(name) for t in trials]
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if len(numbers) == len(values):
            axes.append(_numeric_axis(min(numbers), max(numbers)))
        else:
            axes.append(_category_axis(sorted({str(v) for v in values})))
    # The study view passes finished trials only: each has its figure of merit.
    foms = [t.fom if t.fom is not None else math.nan for t in trials]
    lo, hi = min(foms), max(foms)
    paths = []
    for t, fom in zip(trials, foms, strict=True):
        ys = [axis(t.params.get(name)) for axis, name in zip(axes, names, strict=True)]
        ys.append(0.5 if hi == lo else (fom - lo) / (hi - lo))
        paths.append({"x": np.arange(len(ys), dtype=float), "y": np.array(ys, dtype=float), "fom": fom})
    return paths, [*names, objective]
