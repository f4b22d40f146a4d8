"""The numbers behind the study dashboard's views, from the run store's trial rows: plain
columns (dicts of lists, numpy arrays), no Panel and no Bokeh, so that each is tested
on its own.

A trial's value for objective k is its `values[k]` in a multi-objective study and its
figure of merit (`fom`, the first objective) otherwise. Complete trials are the ones
ranked, compared and fitted (as Optuna's dashboard does); pruned, stopped and paused
trials are drawn, at the value where they stopped, but never counted as the best.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nbdist.hpo.space import Categorical, Space
from nbdist.hpo.space_input import as_space
from nbdist.store import TrialRow

__all__ = [
    "FINISHED",
    "STATE_COLORS",
    "ParamAxis",
    "param_axes",
    "study_space",
    "value_of",
    "history_columns",
    "population_columns",
    "parallel_lines",
    "slice_columns",
    "contour_grid",
    "pareto_mask",
    "objective_ranks",
]

FINISHED = ("complete", "pruned", "stopped", "failed")
# The states a trial's value is drawn for, and their colours (the same in every view).
STATE_COLORS = {
    "complete": "#1f77b4",
    "paused": "#9467bd",
    "stopped": "#ff7f0e",
    "pruned": "#d62728",
}


def value_of(trial: TrialRow, k: int = 0) -> float | None:
    """Trial's value for objective k (None where it has none, or not a finite one)."""
    value: float | None
    if trial.values is not None and k < len(trial.values):
        value = trial.values[k]
    elif k == 0:
        value = trial.fom
    else:
        return None
    return float(value) if value is not None and math.isfinite(value) else None


def _with_values(trials: Iterable[TrialRow], k: int, states: Sequence[str]) -> list[tuple[TrialRow, float]]:
    return [(t, v) for t in trials if t.state in states and (v := value_of(t, k)) is not None]


# -- the parameters' axes ---------------------------------------------------------------
@dataclass
class ParamAxis:
    """How a parameter is placed on an axis: its value (linear), log10 of it (a log-uniform
    dimension), or the index of its category."""

    name: str
    kind: str  # linear | log | category
    categories: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.name} (log10)" if self.kind == "log" else self.name

    def coords(self, values: Sequence[Any]) -> np.ndarray:
        if self.kind == "category":
            for v in values:
                if str(v) not in self.categories:
                    self.categories.append(str(v))
            return np.array([self.categories.index(str(v)) for v in values], dtype=float)
        out = np.array([float(v) for v in values], dtype=float)
        return np.log10(out) if self.kind == "log" else out

    def ticks(self) -> dict[int, str]:
        """Tick labels of a category axis (index -> category)."""
        return dict(enumerate(self.categories))


def study_space(stored: Any) -> Space | None:
    """The study row's space (its compact text, or a dict of name -> dimension text),
    None when it cannot be read (the axes then follow the parameters' values)."""
    if not isinstance(stored, (str, dict)):
        return None
    try:
        return as_space(stored)
    except ValueError:
        return None


def param_axes(space: Space | None, trials: Sequence[TrialRow]) -> dict[str, ParamAxis]:
    """An axis per parameter, from the space's dimensions (log-uniform: log axis), or from
    the values seen when the space is not known."""
    axes: dict[str, ParamAxis] = {}
    for name, dim in (space or {}).items():
        if isinstance(dim, Categorical):
            axes[name] = ParamAxis(name, "category", [str(c) for c in dim.categories])
        else:
            axes[name] = ParamAxis(name, "log" if getattr(dim, "log", False) else "linear")
    for name in sorted({k for t in trials for k in t.params} - set(axes)):
        values = [t.params[name] for t in trials if name in t.params]
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            positive = min(values) > 0 and max(values) / min(values) > 100  # spread over decades
            axes[name] = ParamAxis(name, "log" if positive else "linear")
        else:
            axes[name] = ParamAxis(name, "category", sorted({str(v) for v in values}))
    return axes


# -- history ------------------------------------------------------------------------------
def history_columns(trials: Sequence[TrialRow], k: int, maximize: bool) -> tuple[dict[str, list], dict[str, list]]:
    """The trials with a value for objective k (by number: value, fold spread, state,
    colour), and the best complete value so far, by trial number."""
    drawn = sorted(_with_values(trials, k, tuple(STATE_COLORS)), key=lambda tv: tv[0].number)
    spread = [(t.fom_std or 0.0) if k == 0 else 0.0 for t, _ in drawn]
    points: dict[str, list] = {
        "trial": [t.number for t, _ in drawn],
        "value": [v for _, v in drawn],
        "low": [v - s for (_, v), s in zip(drawn, spread, strict=True)],
        "high": [v + s for (_, v), s in zip(drawn, spread, strict=True)],
        "state": [t.state for t, _ in drawn],
        "color": [STATE_COLORS[t.state] for t, _ in drawn],
        "epochs": [t.epochs or 0 for t, _ in drawn],
    }
    best: dict[str, list] = {"trial": [], "best": []}
    current: float | None = None
    for t, v in drawn:
        if t.state != "complete":
            continue
        if current is None or (v > current if maximize else v < current):
            current = v
        best["trial"].append(t.number)
        best["best"].append(current)
    return points, best


def population_columns(trials: Sequence[TrialRow], k: int) -> dict[str, list]:
    """Each finished trial's value by its generation (a trial batch for bayes or random)."""
    drawn = sorted(_with_values(trials, k, FINISHED), key=lambda tv: tv[0].number)
    return {
        "generation": [t.generation if t.generation is not None else (t.group or 0) for t, _ in drawn],
        "value": [v for _, v in drawn],
        "trial": [t.number for t, _ in drawn],
    }


# -- parameters against the objective ------------------------------------------------------
def _scaled(x: np.ndarray) -> np.ndarray:
    lo, hi = np.nanmin(x), np.nanmax(x)
    return np.full_like(x, 0.5) if hi == lo else (x - lo) / (hi - lo)


def parallel_lines(trials: Sequence[TrialRow], axes: dict[str, ParamAxis], k: int) -> tuple[dict[str, list], list]:
    """One line per complete trial across the parameters' axes and the objective's last,
    each axis scaled to [0, 1] over the trials drawn (log axes in decades, categories
    evenly). Returns the lines' columns (xs, ys, value, trial) and the axes' names."""
    drawn = sorted(_with_values(trials, k, ("complete",)), key=lambda tv: tv[0].number)
    names = [n for n in axes if all(n in t.params for t, _ in drawn)]
    if not drawn:
        return {"xs": [], "ys": [], "value": [], "trial": []}, names
    columns = [_scaled(axes[n].coords([t.params[n] for t, _ in drawn])) for n in names]
    values = np.array([v for _, v in drawn])
    matrix = np.column_stack([*columns, _scaled(values)])
    xs = list(range(matrix.shape[1]))
    return {
        "xs": [xs] * len(drawn),
        "ys": [row.tolist() for row in matrix],
        "value": values.tolist(),
        "trial": [t.number for t, _ in drawn],
    }, names


def slice_columns(trials: Sequence[TrialRow], axis: ParamAxis, k: int) -> dict[str, list]:
    """The objective against one parameter (category axes: the category's index), for the
    complete trials that have it."""
    drawn = sorted(
        ((t, v) for t, v in _with_values(trials, k, ("complete",)) if axis.name in t.params),
        key=lambda tv: tv[0].number,
    )
    raw = [t.params[axis.name] for t, _ in drawn]
    x = axis.coords(raw)
    if axis.kind == "log":
        x = 10.0**x  # a slice's log axis is Bokeh's own
    return {"x": x.tolist(), "value": [v for _, v in drawn], "trial": [t.number for t, _ in drawn]}


def contour_grid(
    trials: Sequence[TrialRow], x_axis: ParamAxis, y_axis: ParamAxis, k: int, size: int = 48
) -> tuple[dict[str, list], dict[str, list]]:
    """The objective over two parameters: the complete trials as points (axis coordinates)
    and, where three or more points span both axes, the values linearly interpolated
    between them on a size x size grid (scipy's griddata; outside their hull: empty).
    Returns the points' columns and the image's (one image)."""
    drawn = [(t, v) for t, v in _with_values(trials, k, ("complete",)) if {x_axis.name, y_axis.name} <= set(t.params)]
    x = x_axis.coords([t.params[x_axis.name] for t, _ in drawn])
    y = y_axis.coords([t.params[y_axis.name] for t, _ in drawn])
    z = np.array([v for _, v in drawn], dtype=float)
    points = {"x": x.tolist(), "y": y.tolist(), "value": z.tolist(), "trial": [t.number for t, _ in drawn]}
    image: dict[str, list] = {"image": [], "x": [], "y": [], "dw": [], "dh": []}
    if len(z) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:
        return points, image
    from scipy.interpolate import griddata

    gx, gy = np.linspace(x.min(), x.max(), size), np.linspace(y.min(), y.max(), size)
    mx, my = np.meshgrid(gx, gy)
    try:
        grid = griddata((x, y), z, (mx, my), method="linear")
    except Exception:  # noqa: BLE001 - collinear points (qhull): the points alone are drawn
        return points, image
    image.update(image=[grid], x=[gx[0]], y=[gy[0]], dw=[gx[-1] - gx[0]], dh=[gy[-1] - gy[0]])
    return points, image


# -- several objectives ---------------------------------------------------------------------
def pareto_mask(values: np.ndarray, maximize: Sequence[bool]) -> np.ndarray:
    """Which rows of `values` (trials x objectives) no other row dominates: at least as
    good in every objective and better in one (nbdist.hpo.outcome.dominates)."""
    values = np.asarray(values, dtype=float)
    mask = np.zeros(len(values), dtype=bool)
    if values.size == 0:
        return mask
    signed = np.where(np.asarray(maximize, dtype=bool), -values, values)  # every objective minimised
    # A row can only be dominated by one before it in lexicographic order, and a row that a
    # dominated row dominates is dominated by a row of the front too: each row is compared
    # with the front found so far only (a few rows), not with every other.
    front = np.empty((0, signed.shape[1]))
    for i in np.lexsort(signed.T[::-1]):
        row = signed[i]
        if not (np.all(front <= row, axis=1) & np.any(front < row, axis=1)).any():
            mask[i] = True
            front = np.vstack([front, row])
    return mask


def objective_ranks(trials: Sequence[TrialRow], k: int, maximize: bool) -> dict[int, int]:
    """Each complete trial's rank for objective k (1: the best; ties share the better rank)."""
    drawn = _with_values(trials, k, ("complete",))
    ordered = sorted((-v if maximize else v) for _, v in drawn)
    first: dict[float, int] = {}
    for place, v in enumerate(ordered, start=1):
        first.setdefault(v, place)
    return {t.number: first[-v if maximize else v] for t, v in drawn}
