"""A study's page: a header, a choice of objective, and one tab per view (history,
parallel coordinates, slice, contour, importance, intermediate values, the Pareto front of
a multi-objective study, a PBT population's lineage and schedules, the trial table).

`update()` reads what is new in the run store (the dashboard's poll calls it once a
second) and hands each view its new rows: the learning curves stream theirs, the views of
final values replace their data when a trial's row changed.

Served and in a notebook, only the tab in view is drawn in the browser (Panel's dynamic
tabs), and only its views are computed: the others are marked stale and brought up to
date when their tab is opened. A study of a thousand trials opens as fast as its first
tab, and a running one costs a poll only the work of the tab in view. Importances are
fitted while the Importance or the Contour tab is in view (the contour's default pair is
the two most important parameters), at most every IMPORTANCE_EVERY seconds while a study
runs (a forest over a thousand trials takes a moment), and at once when the objective or
the evaluator is changed. An exported page (`live=False`) holds every tab, all computed,
and no widgets (nothing would answer them).

The views set their Bokeh models directly (a source's data, a title): each change the page
makes, on a poll or on the browser's word, ends in `_send()`, which pushes those changes
to the notebook cells that show the page (panes.push_bokeh_changes; a served session
sends them by itself).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import panel as pn

from nbdist.dashboard.panes import LiveMarkdown, push_bokeh_changes
from nbdist.dashboard.study.curves import CurveFeed, lineage_columns, lineage_members, schedule_lines, schedule_params
from nbdist.dashboard.study.data import StudyData
from nbdist.dashboard.study.event_views import CurvesView, LineageView, ParetoView, ScheduleView
from nbdist.dashboard.study.frames import (
    contour_grid,
    history_columns,
    parallel_lines,
    param_axes,
    pareto_mask,
    population_columns,
    slice_columns,
    value_of,
)
from nbdist.dashboard.study.importance import EVALUATORS, ImportanceError, param_importances
from nbdist.dashboard.study.notes import NotesView
from nbdist.dashboard.study.table import TrialTable, trial_table
from nbdist.dashboard.study.trial_views import (
    ContourView,
    HistoryView,
    ImportanceView,
    ParallelView,
    PopulationView,
    SliceView,
)
from nbdist.store import RunStore

__all__ = ["StudyPage", "IMPORTANCE_EVERY"]

IMPORTANCE_EVERY = 10.0  # seconds between two fits of the importances while a study runs


class StudyPage:
    def __init__(self, store: RunStore, study_id: str, *, live: bool = True):
        self.data = StudyData(store, study_id)
        self.live = live
        info = self.data.info
        self.k = 0  # the objective the views show
        self.axes = param_axes(info.space, [])
        self.feed = CurveFeed()
        self.history, self.population = HistoryView(), PopulationView()
        self.parallel, self.slices = ParallelView(info.maximize[0]), SliceView()
        self.contour, self.importance = ContourView(info.maximize[0]), ImportanceView()
        self.curves, self.table = CurvesView(info.objectives[0]), TrialTable()
        self.notes = NotesView(store, study_id, live=live)
        self.notes.refresh()  # before the trial table, which shows them
        self.pareto = ParetoView() if len(info.objectives) > 1 else None
        self.lineage: LineageView | None = None
        self.schedule: ScheduleView | None = None
        self._importance_key: tuple = ()
        self._importance_at = 0.0
        self._contour_chosen = False  # the user picked the contour's parameters
        self._picking = False  # the page sets the contour's parameters (not the user)
        self._stale: set[str] = set()  # tabs whose views are behind the store
        self.header = LiveMarkdown("", sizing_mode="stretch_width", name="nbdist-study-header")
        self._make_widgets()
        self.slices.ensure(self.axes)
        self.slice_grid = pn.GridBox(*self._slice_panes(), ncols=3)
        bokeh = pn.pane.Bokeh
        tabs: list[tuple[str, Any]] = [
            ("History", pn.Column(bokeh(self.history.figure), bokeh(self.population.figure))),
            ("Parallel coordinates", bokeh(self.parallel.figure)),
            ("Slice", self.slice_grid),
            ("Contour", pn.Column(self._shown(pn.Row(self.contour_x, self.contour_y)), bokeh(self.contour.figure))),
            ("Importance", pn.Column(self._shown(self.evaluator), bokeh(self.importance.figure))),
            ("Intermediate values", bokeh(self.curves.figure)),
        ]
        if self.pareto is not None:
            pareto = [self._shown(pn.Row(self.pareto_x, self.pareto_y))] if len(info.objectives) > 2 else []
            tabs.append(("Pareto front", pn.Column(*pareto, bokeh(self.pareto.figure))))
        tabs += [("Trials", bokeh(self.table.table)), ("Notes", self.notes.panel)]
        self.tabs = pn.Tabs(*tabs, dynamic=live, name="nbdist-study-tabs")
        self._tab_names = [name for name, _ in tabs]
        self.tabs.param.watch(self._tab_opened, "active")
        top = [self.header] + ([self.objective] if len(info.objectives) > 1 and live else [])
        self.panel = pn.Column(*top, self.tabs, name="nbdist-study")
        if info.pbt:
            self._add_lineage_tab()
        self._stale = set(self._refreshers)
        self.update()
        self.header.object = self._header()

    # -- widgets ---------------------------------------------------------------------------
    def _make_widgets(self) -> None:
        info, names = self.data.info, list(self.axes)
        self.objective = pn.widgets.Select(label="objective", options=info.objectives, value=info.objectives[0])
        self.objective.param.watch(lambda e: self.show_objective(info.objectives.index(e.new)), "value")
        self.evaluator = pn.widgets.Select(label="importance by", options=list(EVALUATORS), value=EVALUATORS[0])
        self.evaluator.param.watch(lambda e: self._send(self._refresh_importance, force=True), "value")
        self.contour_x = pn.widgets.Select(label="x", options=names, value=names[0] if names else None)
        self.contour_y = pn.widgets.Select(label="y", options=names, value=names[1 % len(names)] if names else None)
        for select in (self.contour_x, self.contour_y):
            select.param.watch(self._contour_picked, "value")
        objectives = info.objectives
        self.pareto_x = pn.widgets.Select(label="x", options=objectives, value=objectives[0])
        self.pareto_y = pn.widgets.Select(label="y", options=objectives, value=objectives[min(1, len(objectives) - 1)])
        for select in (self.pareto_x, self.pareto_y):
            select.param.watch(lambda e: self._send(self._refresh_pareto), "value")
        self.schedule_param = pn.widgets.Select(label="hyper-parameter", options=[], value=None)
        self.schedule_param.param.watch(lambda e: self._send(self._refresh_lineage), "value")

    def _send(self, change: Any, *args: Any, **kwargs: Any) -> None:
        """Make `change`, then send what it set on the views' Bokeh models to the notebook."""
        change(*args, **kwargs)
        push_bokeh_changes(self.panel)

    def _shown(self, widgets: Any) -> Any:
        return widgets if self.live else pn.Spacer(height=0)

    def _contour_picked(self, event: Any) -> None:
        if not self._picking:  # the user's choice, not the importances'
            self._contour_chosen = True
            self._send(self._refresh_contour)

    def _slice_panes(self) -> list[Any]:
        return [pn.pane.Bokeh(self.slices.figures[name]) for name in self.axes if name in self.slices.figures]

    def _add_lineage_tab(self) -> None:
        if self.lineage is not None:
            return
        self.lineage, self.schedule = LineageView(self.data.info.maximize[0]), ScheduleView()
        at = self._tab_names.index("Trials")  # before the trial table
        view = pn.Column(
            pn.pane.Bokeh(self.lineage.figure), self._shown(self.schedule_param), pn.pane.Bokeh(self.schedule.figure)
        )
        self.tabs.insert(at, ("PBT lineage", view))
        self._tab_names.insert(at, "PBT lineage")
        self._stale.add("PBT lineage")

    # -- keeping up with the store ------------------------------------------------------------
    def update(self) -> int:
        """Show what the store has new; returns how many trials finished since the last update."""
        changed, new, finished = self.data.poll()
        if new:
            self.curves.add(*self.feed.add(new))
            if any(e["kind"] == "exploit" for e in new):
                self._add_lineage_tab()
        if changed:
            self._stale |= set(self._refreshers) - {"Importance"}
            self.header.object = self._header()
        if self.lineage is not None and any(e["kind"] in ("exploit", "params", "value") for e in new):
            self._stale.add("PBT lineage")
        self._send(self._refresh_shown)
        return finished

    def show_objective(self, k: int) -> None:
        """Draw the views of final values for objective k (a multi-objective study's choice)."""
        self.k = k
        self._stale |= set(self._refreshers)
        self._send(self._refresh_shown, force=True)

    @property
    def _refreshers(self) -> dict[str, Any]:
        """Each tab's views, brought up to date by one call."""
        return {
            "History": self._refresh_history,
            "Parallel coordinates": self._refresh_parallel,
            "Slice": self._refresh_slices,
            "Contour": self._refresh_contour,
            "Importance": self._refresh_importance,
            "Pareto front": self._refresh_pareto,
            "PBT lineage": self._refresh_lineage,
            "Trials": self._refresh_table,
            "Notes": self.notes.refresh,
        }

    def _shown_tabs(self) -> list[str]:
        if not self.live:
            return list(self._tab_names)
        return [self._tab_names[self.tabs.active]]

    def _refresh_shown(self, force: bool = False) -> None:
        """Bring the tabs in view up to date (an exported page: all of them)."""
        shown = self._shown_tabs()
        if "Contour" in shown and not self._contour_chosen:
            shown = ["Importance", *shown]  # the contour's default pair: the two most important
        for name in shown:
            if name == "Importance":
                self._refresh_importance(force)
            elif name in self._stale and name in self._refreshers:
                self._stale.discard(name)
                self._refreshers[name]()

    def _tab_opened(self, event: Any) -> None:
        # Notes are read again when opened (another page may have saved some), and the
        # table's note column with them.
        self._stale |= {"Notes", "Trials"}
        self._send(self._refresh_shown, force=True)

    def _refresh_axes(self) -> None:
        grown = param_axes(self.data.info.space, self.data.trials)
        for name, axis in grown.items():
            self.axes.setdefault(name, axis)
        if self.slices.ensure(self.axes):
            self.slice_grid.objects = self._slice_panes()
            names = list(self.axes)
            self.contour_x.options, self.contour_y.options = names, names

    def _refresh_history(self) -> None:
        info, trials, k = self.data.info, self.data.trials, self.k
        self.history.show(*history_columns(trials, k, info.maximize[k]), info.objectives[k])
        self.population.show(population_columns(trials, k), info.objectives[k])

    def _refresh_parallel(self) -> None:
        self._refresh_axes()
        self.parallel.show(*parallel_lines(self.data.trials, self.axes, self.k), self.data.info.objectives[self.k])

    def _refresh_slices(self) -> None:
        self._refresh_axes()
        for name, axis in self.axes.items():
            self.slices.show(
                name, axis, slice_columns(self.data.trials, axis, self.k), self.data.info.objectives[self.k]
            )

    def _refresh_table(self) -> None:
        info = self.data.info
        self._refresh_axes()
        columns = trial_table(
            self.data.trials,
            self.data.runs,
            info.layout,
            info.objectives,
            info.maximize,
            list(self.axes),
            notes=self.notes.by_trial,
        )
        self.table.show(columns, self.axes)

    def _refresh_contour(self) -> None:
        x, y = self.contour_x.value, self.contour_y.value
        if x is None or y is None:
            return
        self.contour.show(
            *contour_grid(self.data.trials, self.axes[x], self.axes[y], self.k),
            self.axes[x],
            self.axes[y],
            self.data.info.objectives[self.k],
        )

    def _refresh_pareto(self) -> None:
        if self.pareto is None:
            return
        info = self.data.info
        i, j = info.objectives.index(self.pareto_x.value), info.objectives.index(self.pareto_y.value)
        done = [t for t in self.data.trials if t.state == "complete" and t.values is not None]
        values = np.array([t.values for t in done], dtype=float).reshape(len(done), len(info.objectives))
        mask = pareto_mask(values[:, [i, j]], [info.maximize[i], info.maximize[j]])
        front = sorted((values[n, i], values[n, j], t.number) for n, t in enumerate(done) if mask[n])
        rest = [(values[n, i], values[n, j], t.number) for n, t in enumerate(done) if not mask[n]]
        self.pareto.show(_xyt(front), _xyt(rest), info.objectives[i], info.objectives[j])

    def _refresh_lineage(self) -> None:
        if self.lineage is None or self.schedule is None:
            return
        events, trials = self.data.events, self.data.trials
        members = lineage_members(events, trials, self.data.info.pbt)
        self.lineage.show(*lineage_columns(events, members, self.feed.values))
        names = schedule_params(events)
        if names != self.schedule_param.options:
            self.schedule_param.options = names
        param = self.schedule_param.value
        if param not in names:
            param = next((n for n in names if n == "lr"), names[0] if names else None)
            if param is not None:
                self.schedule_param.value = param  # its watcher draws it
                return
        if param is not None:
            self.schedule.show(schedule_lines(events, trials, members, param), self.axes.get(param), param)

    def _refresh_importance(self, force: bool = False) -> None:
        info = self.data.info
        self._refresh_axes()
        done = sum(1 for t in self.data.trials if t.state == "complete" and value_of(t, self.k) is not None)
        key = (self.k, self.evaluator.value, done)
        if key == self._importance_key:
            return
        if self.live and not force and time.monotonic() - self._importance_at < IMPORTANCE_EVERY:
            return
        self._importance_key, self._importance_at = key, time.monotonic()
        objective = info.objectives[self.k]
        try:
            ranked = param_importances(self.data.trials, self.axes, self.k, info.maximize[self.k], key[1])
        except ImportanceError as why:
            self.importance.show([], f"Parameter importance: {why}")
            return
        self.importance.show(ranked, f"Parameter importance ({key[1]}, {done} complete trials): {objective}")
        top = [name for name, _ in ranked[:2]]
        if not self._contour_chosen and len(top) == 2 and [self.contour_x.value, self.contour_y.value] != top:
            # The two that matter most, until the user picks others.
            self._picking = True
            try:
                self.contour_x.value, self.contour_y.value = top
            finally:
                self._picking = False
            self._stale.add("Contour")

    def _header(self) -> str:
        info, counts = self.data.info, self.data.counts()
        states = ", ".join(f"{n} {state}" for state, n in sorted(counts.items(), key=lambda kv: -kv[1]))
        parts = [
            f"**study {info.id}**",
            f"**{info.status}**",
            f"searcher {info.searcher}",
            f"scheduler {info.scheduler}",
            f"{len(self.data.trials)} trials ({states})" if states else "no trials yet",
        ]
        best = self._best()
        if best is not None:
            parts.append(best)
        return "  ·  ".join(parts)

    def _best(self) -> str | None:
        info = self.data.info
        if len(info.objectives) > 1:
            done = [t for t in self.data.trials if t.state == "complete" and t.values is not None]
            if not done:
                return None
            front = pareto_mask(np.array([t.values for t in done], dtype=float), info.maximize)
            return f"Pareto front: {int(front.sum())} trials"
        scored = [(v, t.number) for t in self.data.trials if t.state == "complete" and (v := value_of(t)) is not None]
        if not scored:
            return None
        value, number = (max if info.maximize[0] else min)(scored)
        return f"best {info.objectives[0]} {value:.4g} (trial {number})"


def _xyt(rows: list[tuple[float, float, int]]) -> dict[str, list]:
    return {"x": [r[0] for r in rows], "y": [r[1] for r in rows], "trial": [r[2] for r in rows]}
