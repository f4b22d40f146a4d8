"""The dashboard app: a factory that builds the Panel page of a run, live.

    dashboard(store="runs/nbdist.db")            # a served app: run picker, compare, studies
    dashboard(job=job)                           # inline in the notebook, the job's run
    dashboard(store=..., run=..., live=False)    # a finished run, e.g. for a static export
    dashboard(store=..., study=..., runs=False)  # a study's page alone (nbdist.dashboard.study)

A periodic callback polls the source (the store's new rows, or the job's new records)
a few times a second, turns them into new rows per view (frames.RunFrames) and appends
those to the plots (plots.RunPlots). Nothing is recomputed from the start, and a plot is
rebuilt only when another run is picked.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import panel as pn

from nbdist.dashboard.frames import RunFrames
from nbdist.dashboard.layout_view import layout_html
from nbdist.dashboard.panes import LiveMarkdown, NotebookPage
from nbdist.dashboard.plots import RunPlots, phase_legend, queue_model_staleness
from nbdist.dashboard.scaling_view import ScalingView
from nbdist.dashboard.sources import JobSource, RecordSource, RunInfo, StoreSource, check_choices, run_choices
from nbdist.dashboard.study import StudyPage
from nbdist.store import RunStore, is_url

__all__ = ["Dashboard", "dashboard"]

POLL_MS = 1000  # a browser redraws each streamed plot per poll: once a second is live enough
CHOICES_EVERY = 2.0  # seconds between looks for new runs in the store


def _worker_ranks(layout: dict[str, Any]) -> list[int]:
    found: list[int] = []

    def walk(nodes: list[dict[str, Any]]) -> None:
        for node in nodes:
            if node["kind"] == "worker":
                found.extend(node["ranks"])
            walk(node.get("children", []))

    walk(layout.get("nodes", []))
    return sorted(found)


class _RunView:
    """The live part of the page for one run."""

    def __init__(self, source: RecordSource, info: RunInfo):
        self.source, self.info = source, info
        ranks = list(range(int(info.layout.get("n_ranks", 0))))
        workers = _worker_ranks(info.layout) or ranks
        self.frames = RunFrames(info.topology, info.started)
        # The first records name the model's metric (accuracy, a GAN's MMD, a user's own),
        # which the second row of plots follows.
        first = self.source.poll()
        frames = self.frames.ingest(first)
        metric = self.frames.metric_name or ("mmd" if info.options.get("gan") else "acc")
        self.plots = RunPlots(
            ranks,
            workers,
            metric=metric,
            staleness_reference=queue_model_staleness(info.layout, info.options),
            every_samples=info.options.get("validate_every_samples"),
        )
        self.header = LiveMarkdown("", sizing_mode="stretch_width", name="nbdist-header")
        self.events = LiveMarkdown("", sizing_mode="stretch_width", name="nbdist-events")
        self.event_lines: list[str] = []
        self.latest: dict[str, Any] = {}
        self.records = 0
        self._show(first, frames)
        p, bokeh = self.plots, pn.pane.Bokeh
        self.panel = pn.Column(
            self.header,
            self.events,
            pn.Tabs(
                ("by samples seen", pn.Row(bokeh(p.loss["samples_seen"]), bokeh(p.accuracy["samples_seen"]))),
                ("by wall time", pn.Row(bokeh(p.loss["t"]), bokeh(p.accuracy["t"]))),
            ),
            pn.Row(bokeh(p.throughput.figure), bokeh(p.total_figure)),
            pn.Row(bokeh(p.staleness.figure), bokeh(p.staleness_figure)),
            pn.Column(bokeh(p.timeline_figure), pn.pane.HTML(phase_legend())),
            pn.Row(bokeh(p.cpu.figure), bokeh(p.memory.figure)),
            pn.Row(bokeh(p.bytes_sent.figure)),
            pn.Row(
                pn.pane.HTML(layout_html(info.layout), name="nbdist-layout"),
                *([bokeh(p.gan_figure)] if info.options.get("gan") else []),
            ),
        )

    def _show(self, records: list[dict[str, Any]], frames: Any) -> None:
        if records:
            self.records += len(records)
            self.plots.send(frames)
            if frames.events:
                self.event_lines += [f"- {t:.0f} s: {text}" for t, text in frames.events]
                self.events.object = "**Ranks lost, restarts**\n\n" + "\n".join(self.event_lines)
            if frames.epochs is not None:
                self.latest = frames.epochs.iloc[-1].to_dict()

    def tick(self) -> int:
        records = self.source.poll()
        if records:
            self._show(records, self.frames.ingest(records))
        info = self.source.info() or self.info
        self.info = info
        self.header.object = self._header(info)
        return len(records)

    def _header(self, info: RunInfo) -> str:
        parts = [f"**{info.id}**", f"**{info.status}**", info.layout.get("describe", "")]
        epochs = info.options.get("epochs")
        if self.latest:
            parts.append(f"epoch {int(self.latest.get('epoch', 0))}/{epochs}")
            parts += [f"{k} {v:.4f}" for k, v in self.latest.items() if k.startswith("val_") and isinstance(v, float)]
        if info.started:
            parts.append(
                f"{time.time() - info.started:.0f} s since start" if info.status == "running" else info.reason or ""
            )
        parts.append(f"{self.records} records")
        return "  ·  ".join(p for p in parts if p)


class Dashboard:
    """A run's dashboard, from a store (with pickers) or from a notebook job."""

    def __init__(
        self,
        *,
        store: str | Path | None = None,
        job: Any = None,
        run: str | None = None,
        study: str | None = None,
        live: bool = True,
        period_ms: int = POLL_MS,
        runs: bool = True,
    ):
        if (store is None) == (job is None):
            raise ValueError("give the dashboard a store or a job")
        self.store_path = store if store is None or is_url(store) else Path(store)
        self.job = job
        self.live = live
        self.runs = runs  # False: the study's page alone, without a run's
        self.period_ms = period_ms
        self.view: _RunView | ScalingView | None = None
        self.study: StudyPage | None = None
        self.body = pn.Column(sizing_mode="stretch_width")
        self.study_body = pn.Column()
        self.controls = pn.Row()
        self._callback: Any = None
        self._started = False
        self._choices_read = time.monotonic()
        self._store = RunStore(self.store_path) if self.store_path is not None else None
        if self._store is not None:
            self._build_pickers(self._store, run, study)
        else:
            self.body[:] = [pn.pane.Markdown("*waiting for the job's first records ...*")]
        # A static page (live=False: an export) gets no pickers: nothing would answer them.
        parts: list[Any] = [pn.pane.Markdown("## nbdist dashboard")]
        parts += [self.controls] if live and len(self.controls) else []
        parts += [self.body] + ([self.study_body] if self.study is not None else [])
        self.page = NotebookPage(*parts, name="nbdist-dashboard")

    # -- the store's pickers --------------------------------------------------------------
    def _build_pickers(self, store: RunStore, run: str | None, study: str | None) -> None:
        check_choices(store, run, study)
        studies = {s["id"]: s["id"] for s in store.studies()}
        widgets: list[Any] = []
        if self.runs:
            choices = run_choices(store)
            self.run_picker = pn.widgets.Select(
                label="run", options=choices, value=run or next(iter(choices.values()), None), width=420
            )
            self.compare_picker = pn.widgets.Select(
                label="compare with", options={"(none)": "", **choices}, value="", width=420
            )
            self.run_picker.param.watch(lambda e: self.open_run(e.new), "value")
            self.compare_picker.param.watch(lambda e: self.compare(e.new), "value")
            widgets += [self.run_picker, self.compare_picker]
        if studies and (self.runs or study is None):
            self.study_picker = pn.widgets.Select(
                label="study", options=studies, value=study or next(iter(studies)), width=300
            )
            self.study_picker.param.watch(lambda e: self.open_study(e.new), "value")
            widgets.append(self.study_picker)
        if studies:
            self.open_study(study or next(iter(studies)))
        self.controls[:] = widgets
        if not self.runs:
            return
        if self.run_picker.value:
            self.open_run(self.run_picker.value)
        else:
            self.body[:] = [pn.pane.Markdown(f"*no runs in {store.label} yet: they appear here when they start*")]

    def _picked_store(self) -> tuple[str | Path, RunStore]:
        """The run store the pickers read (there are pickers only with a store)."""
        if self.store_path is None or self._store is None:
            raise RuntimeError("this dashboard shows a job's live records: it has no run store to pick from")
        return self.store_path, self._store

    def open_run(self, run_id: str) -> None:
        source = StoreSource(self._picked_store()[0], run_id)
        self._show(source, source.info())
        if getattr(self, "compare_picker", None) is not None and self.compare_picker.value:
            self.compare(self.compare_picker.value)

    def compare(self, run_id: str) -> None:
        """Draw another run's validation curves under this one's ('' clears them)."""
        if not isinstance(self.view, _RunView):
            return  # a scaling study compares nothing
        plots = self.view.plots
        if not run_id:
            plots.show_compared(None)
            return
        other = StoreSource(self._picked_store()[0], run_id)
        try:
            info = other.info()
            epochs = RunFrames(info.topology, info.started).ingest(_drain(other)).epochs
        finally:
            other.close()
        if epochs is not None:
            plots.show_compared(epochs)

    def open_study(self, study_id: str) -> None:
        self.study = StudyPage(self._picked_store()[1], study_id, live=self.live)
        self.study_body[:] = [self.study.panel]

    # -- the live loop ------------------------------------------------------------------
    def _show(self, source: RecordSource, info: RunInfo) -> None:
        if self.view is not None:
            self.view.source.close()
        self.view = ScalingView(source, info) if info.kind == "scale" else _RunView(source, info)
        self.view.tick()
        self.body[:] = [self.view.panel]

    def tick(self) -> None:
        """One poll of the sources: new rows to the plots."""
        if self.view is None and self.job is not None:
            source = JobSource(self.job)
            info = source.info()
            if info is None:
                return
            self._show(source, info)
            return
        if self._store is not None and self.runs:
            self._refresh_choices()
        if self.view is not None:
            new = self.view.tick()
            if self.job is not None and self.job.done and not new:
                self.stop()  # the job's last records are shown: nothing more will come
        if self.study is not None:
            self.study.update()

    def _refresh_choices(self) -> None:
        """Runs started since the page opened join the pickers; the first one is shown."""
        now = time.monotonic()
        if now - self._choices_read < CHOICES_EVERY:
            return
        self._choices_read = now
        choices = run_choices(self._picked_store()[1])
        if choices != self.run_picker.options:
            self.run_picker.options = choices
            self.compare_picker.options = {"(none)": "", **choices}
        if self.view is None and choices:
            self.run_picker.value = next(iter(choices.values()))  # its watcher opens it

    def drain(self) -> None:
        """Poll until everything stored so far is shown (a finished run, an export)."""
        while self.view is not None and self.view.tick():
            pass
        if self.study is not None:
            self.study.update()

    def start(self) -> Dashboard:
        """Poll the source while the page is shown (in this notebook or served session)."""
        if not self.live or self._started:
            return self
        self._started = True
        served = pn.state.curdoc is not None and pn.state.curdoc.session_context is not None
        if served:
            pn.state.on_session_destroyed(lambda _context: self.close())
            # Poll only once the browser has drawn the page: a job's view is built by a
            # poll, and models added between the page's HTML and its websocket never
            # reach the browser ("reference ... isn't known"), which then draws nothing.
            pn.state.onload(self._poll_periodically)
        else:
            self._poll_periodically()
        return self

    def _poll_periodically(self) -> None:
        self._callback = pn.state.add_periodic_callback(self.tick, period=self.period_ms)

    def servable(self) -> Any:
        """The page, live, marked for `panel serve` (and shown as is in a notebook)."""
        return self.start().page.servable(title="nbdist dashboard")

    def stop(self) -> None:
        """Stop polling (the page keeps what it shows)."""
        if self._callback is not None:
            self._callback.stop()
            self._callback = None

    def close(self) -> None:
        self.stop()
        if self.view is not None:
            self.view.source.close()
        if self._store is not None:
            self._store.close()

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> Any:
        return self.servable()._repr_mimebundle_(include, exclude)


def _drain(source: StoreSource) -> list[dict[str, Any]]:
    records, batch = [], source.poll()
    while batch:
        records += batch
        batch = source.poll()
    return records


def dashboard(
    store: str | Path | None = None,
    *,
    job: Any = None,
    run: str | None = None,
    study: str | None = None,
    live: bool = True,
    period_ms: int = POLL_MS,
    runs: bool = True,
) -> Dashboard:
    # Panel's notebook output loads Bokeh's and Panel's JavaScript from public CDNs by
    # default: a browser that cannot reach the internet (as on many HPC networks) then
    # draws nothing under the cell. Inline, the kernel sends it all (and a served page
    # takes it from the dashboard server's own static files either way).
    pn.extension(inline=True)
    return Dashboard(store=store, job=job, run=run, study=study, live=live, period_ms=period_ms, runs=runs)
