"""The study's trial table: one row per trial with its state, its value and rank for each
objective (and, with several, whether it is on the Pareto front), the epochs it trained,
the group of MPI ranks that trained it, its fold runs, and its parameters.

Drawn as Bokeh's DataTable (SlickGrid: it draws only the rows in view, so a thousand
trials scroll as ten do; sortable by any column in the browser; its JavaScript is part
of Bokeh's own, which every page of the dashboard carries inline or from its server).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from bokeh.models import ColumnDataSource
from bokeh.models.widgets.tables import DataTable, NumberFormatter, TableColumn

from nbdist.dashboard.study.frames import ParamAxis, objective_ranks, pareto_mask, value_of
from nbdist.store import RunRow, TrialRow

__all__ = ["trial_table", "group_ranks", "TrialTable"]


def _ranks_text(ranks: Sequence[int]) -> str:
    ranks = list(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def group_ranks(layout: dict[str, Any] | None) -> dict[int, list[int]]:
    """Each group's MPI ranks, from the study's layout (Layout.to_dict)."""
    return {
        node["index"]: list(node["ranks"]) for node in (layout or {}).get("nodes", []) if node.get("kind") == "group"
    }


def _runs_text(runs: Sequence[RunRow]) -> str:
    return ", ".join(run.id if run.status == "completed" else f"{run.id} ({run.status})" for run in runs)


def _ranks_of(trial: TrialRow, groups: dict[int, list[int]], runs: Sequence[RunRow]) -> str:
    if trial.group is not None and trial.group in groups:
        return f"group {trial.group}: {_ranks_text(groups[trial.group])}"
    sizes = sorted({int(r.layout.get("n_ranks", 0)) for r in runs if r.layout.get("n_ranks")})
    where = f"group {trial.group}" if trial.group is not None else ""
    if sizes:
        where += ("; " if where else "") + " or ".join(map(str, sizes)) + " rank(s) per run"
    return where


def trial_table(
    trials: Sequence[TrialRow],
    runs: dict[int, list[RunRow]],
    layout: dict[str, Any] | None,
    objectives: Sequence[str],
    maximize: Sequence[bool],
    params: Sequence[str],
    notes: dict[int, str] | None = None,
) -> dict[str, list]:
    """The table's columns, one row per trial by number (values NaN where none)."""
    trials = sorted(trials, key=lambda t: t.number)
    groups = group_ranks(layout)
    columns: dict[str, list] = {"trial": [t.number for t in trials], "state": [t.state for t in trials]}
    for k, name in enumerate(objectives):
        ranks = objective_ranks(trials, k, maximize[k])
        columns[name] = [_number(value_of(t, k)) for t in trials]
        columns[f"rank: {name}"] = [ranks.get(t.number, math.nan) for t in trials]
    if len(objectives) > 1:
        complete = [t for t in trials if t.state == "complete" and t.values is not None]
        on_front = pareto_mask(np.array([t.values for t in complete]), maximize) if complete else np.zeros(0, bool)
        front = {t.number for t, yes in zip(complete, on_front.tolist(), strict=True) if yes}
        columns["Pareto front"] = ["yes" if t.number in front else "" for t in trials]
    columns["epochs"] = [_number(t.epochs) for t in trials]
    columns["ranks"] = [_ranks_of(t, groups, runs.get(t.number, [])) for t in trials]
    columns["runs"] = [_runs_text(runs.get(t.number, [])) for t in trials]
    for name in params:
        columns[name] = [_cell(t.params.get(name)) for t in trials]
    columns["error"] = [t.error or "" for t in trials]
    if notes:
        columns["note"] = [notes.get(t.number, "") for t in trials]
    return columns


def _number(value: Any) -> float:
    return math.nan if value is None else float(value)


def _cell(value: Any) -> Any:
    if value is None:
        return ""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


class TrialTable:
    def __init__(self) -> None:
        self.source = ColumnDataSource({"trial": []})
        self.table = DataTable(
            source=self.source,
            columns=[TableColumn(field="trial", title="trial")],
            width=1060,
            height=420,
            index_position=None,
            name="nbdist-trial-table",
            autosize_mode="none",
        )
        self._names: list[str] = ["trial"]

    def show(self, columns: dict[str, list], axes: dict[str, ParamAxis]) -> None:
        names = list(columns)
        if names != self._names:
            self.table.columns = [_column(name, columns[name], name in axes) for name in names]
            self._names = names
        self.source.data = columns


def _column(name: str, values: list, is_param: bool) -> TableColumn:
    wide = {"runs": 360, "ranks": 150, "error": 240, "note": 240}.get(name, 110 if is_param else 90)
    numbers = bool(values) and all(isinstance(v, float) for v in values) and name != "trial"
    if is_param or not numbers:  # parameters as given (a learning rate of 3e-5 is not 0)
        return TableColumn(field=name, title=name, width=wide)
    shown = "0" if name.startswith("rank") or name == "epochs" else "0.[0000]"
    return TableColumn(field=name, title=name, width=wide, formatter=NumberFormatter(format=shown, nan_format=""))
