"""The live plots of one run: Bokeh figures whose data sources only ever grow by
`ColumnDataSource.stream`, so the browser receives the new rows and nothing else.

Why Bokeh directly and not HoloViews Buffers here: a Buffer ends in the same `stream`
call, but first re-evaluates its DynamicMap and, in an overlay of one line per rank,
every layer of it: a noticeable part of a second per send on a busy two-core machine,
with twenty sends per poll. These plots are polled twice a second while ranks train on
the same cores, so they skip that machinery, as the study dashboard does
(nbdist.dashboard.study).

Every figure carries a Bokeh name (`nbdist-<view>`) so that a test, or a user's own
script, can find it in the page.
"""

from __future__ import annotations

from typing import Any

import pandas as pd
from bokeh.models import ColumnDataSource, HoverTool
from bokeh.models.annotations.legends import Legend, LegendItem
from bokeh.palettes import Category10_10, Category20_20
from bokeh.plotting import figure

from nbdist.dashboard.frames import PHASES, Frames

__all__ = ["RunPlots", "named_figure", "PHASE_COLORS", "MAX_RANK_LINES", "phase_legend", "queue_model_staleness"]

PHASE_COLORS = {"compute": "#2ca02c", "communicate": "#1f77b4", "wait": "#d62728"}
MAX_RANK_LINES = 32  # beyond this a per-rank plot shows the first ranks only (and says so)
HISTORY = 5_000  # points kept per line in the browser (a line gets about two a second)
TIMELINE_SECONDS = 60  # the timeline shows the last minute: about 2 intervals x 3 phases a second per rank
WIDTH, HEIGHT = 520, 270


def named_figure(name: str, title: str, xlabel: str, ylabel: str, **extra: Any) -> Any:
    """A figure named `nbdist-<name>` (a test or a script finds it in the page by it), with
    the dashboard's size and tools; `extra` goes to Bokeh's `figure`."""
    fig = figure(
        name=f"nbdist-{name}",
        title=title,
        width=extra.pop("width", WIDTH),
        height=extra.pop("height", HEIGHT),
        x_axis_label=xlabel,
        y_axis_label=ylabel,
        toolbar_location="above",
        tools="pan,box_zoom,wheel_zoom,reset,save",
        **extra,
    )
    return fig


def _color(i: int) -> str:
    palette = Category10_10 if i < 10 else Category20_20
    return palette[i % len(palette)]


def _stream(source: ColumnDataSource, frame: pd.DataFrame, rollover: int = HISTORY) -> None:
    if len(frame):
        source.stream({c: frame[c].tolist() for c in source.column_names}, rollover=rollover)


class _RankLines:
    """One line per rank, each on its own data source, legend outside the plot."""

    def __init__(
        self,
        name: str,
        title: str,
        ranks: list[int],
        x: str,
        y: str,
        xlabel: str,
        ylabel: str,
        extra: tuple[str, ...] = (),
    ):
        shown = ranks[:MAX_RANK_LINES]
        if len(ranks) > len(shown):
            title += f" (first {len(shown)} of {len(ranks)} ranks)"
        self.x, self.y = x, y
        self.figure = named_figure(name, title, xlabel, ylabel)
        self.sources = {r: ColumnDataSource({c: [] for c in (x, y, *extra)}) for r in shown}
        items = []
        for i, (rank, source) in enumerate(self.sources.items()):
            line = self.figure.line(x, y, source=source, color=_color(i), line_width=1.5)
            items.append((f"rank {rank}", [line]))
        self.legend = Legend(items=items, click_policy="hide", label_text_font_size="9pt")
        self.figure.add_layout(self.legend, "right")
        self.figure.add_tools(HoverTool(tooltips=[(ylabel, f"@{y}{{0.[00]}}"), (xlabel, f"@{x}{{0.0}}")]))

    def send(self, frames: dict[int, pd.DataFrame]) -> None:
        for rank, frame in frames.items():
            if rank in self.sources:
                _stream(self.sources[rank], frame)


def queue_model_staleness(layout: dict[str, Any], options: dict[str, Any]) -> int | None:
    """The staleness the simple queue model expects of a run's updates (Hermans & Louppe
    2018, the GEM paper: with n asynchronous workers each update finds the n - 1 others'
    applied since its worker read the centre): n - 1, n the workers of one master. None
    where no update is stale by design: synchronous rounds, allreduce."""
    sizes = layout.get("options", {})
    if sizes.get("topology", "master-worker") != "master-worker" or options.get("synchronous"):
        return None
    workers = sizes.get("workers")
    return int(workers) - 1 if workers else None


class RunPlots:
    """Every live plot of one run, and `send(frames)` to append new rows to them.
    `staleness_reference`: the queue model's expected staleness (queue_model_staleness),
    drawn across the staleness plot. `every_samples`: the run's --validate-every-samples
    (its validations between the epochs' are drawn as small points)."""

    def __init__(
        self,
        ranks: list[int],
        worker_ranks: list[int],
        metric: str = "acc",
        staleness_reference: int | None = None,
        every_samples: int | None = None,
    ):
        self.every_samples = every_samples
        self.metric = metric
        self.shown_ranks = ranks[:MAX_RANK_LINES]
        time_label = "wall time [s]"
        self.throughput = _RankLines(
            "throughput", "Throughput per rank", worker_ranks, "t", "samples_per_s", time_label, "samples/s"
        )
        self.total = ColumnDataSource({"t": [], "samples_per_s": []})
        self.total_figure = named_figure("total-throughput", "Throughput, all workers", time_label, "samples/s")
        self.total_figure.line("t", "samples_per_s", source=self.total, color="black", line_width=2)
        self.bytes_sent = _RankLines(
            "bytes-sent",
            "Data sent per rank: gradients, messages (--compression)",
            worker_ranks,
            "t",
            "mb_sent",
            time_label,
            "MB sent since the start",
        )

        self.staleness = _RankLines(
            "staleness",
            "Gradient staleness per worker",
            worker_ranks,
            "t",
            "staleness",
            time_label,
            "staleness (mean per point)",
            extra=("max",),
        )
        self.staleness_mean = ColumnDataSource({"t": [], "staleness": []})
        mean = self.staleness.figure.line("t", "staleness", source=self.staleness_mean, color="black", line_width=2.5)
        # bokeh's type hints give Legend.items as (label, renderers) pairs; it holds LegendItems.
        self.staleness.legend.items.insert(0, LegendItem(label="all workers", renderers=[mean]))  # type: ignore[arg-type]
        self.staleness_reference = staleness_reference
        if staleness_reference is not None:
            # A glyph, not an annotation: the plot's range then always takes it in.
            reference = self.staleness.figure.hspan(
                y=[staleness_reference],
                line_color="black",
                line_width=1.5,
                line_dash="dashed",
                name="nbdist-staleness-reference",
            )
            self.staleness.legend.items.insert(
                1,
                LegendItem(label=f"queue model: n-1 = {staleness_reference}", renderers=[reference]),  # type: ignore[arg-type]
            )
        self.staleness_ranks = [f"rank {r}" for r in worker_ranks[:MAX_RANK_LINES]]
        self.staleness_counts = ColumnDataSource({"staleness": [], **{r: [] for r in self.staleness_ranks}})
        self.staleness_figure = named_figure(
            "staleness-distribution", "Staleness distribution (updates per value)", "staleness", "updates"
        )
        if self.staleness_ranks:
            self.staleness_figure.vbar_stack(
                self.staleness_ranks,
                x="staleness",
                width=0.8,
                source=self.staleness_counts,
                color=[_color(i) for i in range(len(self.staleness_ranks))],
                legend_label=self.staleness_ranks,
            )
            self.staleness_figure.legend.location = "top_right"

        # One source per kind of curve, shared by the figures that draw it: a row
        # streamed once appears in all of them.
        self.train_loss = ColumnDataSource({"t": [], "samples_seen": [], "loss": [], "metric": []})
        val = f"val_{metric}"
        self.epochs = ColumnDataSource(
            {"epoch": [], "t": [], "samples_seen": [], "train_loss": [], "val_loss": [], val: []}
        )
        self.compare = ColumnDataSource({"t": [], "samples_seen": [], "val_loss": [], val: []})
        self.validations = ColumnDataSource({"t": [], "samples_seen": [], "val_loss": [], val: []})
        self.loss = {x: self._curves("loss", x) for x in ("samples_seen", "t")}
        self.accuracy = {x: self._curves(metric, x) for x in ("samples_seen", "t")}

        self.timeline = ColumnDataSource({"x0": [], "y0": [], "x1": [], "y1": [], "rank": [], "phase": [], "color": []})
        self.timeline_figure = named_figure(
            "timeline",
            "Timeline per rank: compute / communicate / wait",
            time_label,
            "rank",
            width=2 * WIDTH + 20,
            height=max(180, 36 * len(self.shown_ranks) + 80),
        )
        self.timeline_figure.quad(
            left="x0", right="x1", bottom="y0", top="y1", color="color", line_alpha=0, source=self.timeline
        )
        self.timeline_figure.yaxis.ticker = self.shown_ranks
        self.timeline_figure.add_tools(HoverTool(tooltips=[("rank", "@rank"), ("phase", "@phase")]))

        self.cpu = _RankLines("cpu", "CPU per rank", ranks, "t", "cpu_percent", time_label, "% of one core")
        self.memory = _RankLines("memory", "Memory per rank", ranks, "t", "rss_mb", time_label, "resident MB")

        self.gan = ColumnDataSource(
            {"t": [], "samples_seen": [], "d_loss": [], "g_loss": [], "d_real": [], "d_fake": []}
        )
        self.gan_figure = named_figure("gan", "GAN: losses, D(x) and D(G(z))", "samples seen", "")
        for i, y in enumerate(("d_loss", "g_loss", "d_real", "d_fake")):
            self.gan_figure.line("samples_seen", y, source=self.gan, color=_color(i), legend_label=y)

    def _curves(self, what: str, x: str) -> Any:
        """Live training values (per report), validation per epoch, and the run compared."""
        xlabel = "samples seen" if x == "samples_seen" else "wall time [s]"
        title = "loss" if what == "loss" else _metric_title(what)
        name = f"{'loss' if what == 'loss' else 'accuracy'}-by-{'samples' if x == 'samples_seen' else 'time'}"
        fig = named_figure(name, f"{title.capitalize()} vs {xlabel}", xlabel, title)
        live_y, val = ("loss", "val_loss") if what == "loss" else ("metric", f"val_{what}")
        fig.line(x, live_y, source=self.train_loss, color="#1f77b4", alpha=0.5, legend_label=f"train {title}")
        fig.line(x, val, source=self.epochs, color="#ff7f0e", line_width=3, legend_label=f"validation {title}")
        points = fig.scatter(x, val, source=self.epochs, color="#ff7f0e", size=6)
        labelled = {"legend_label": f"validation every {self.every_samples} samples"} if self.every_samples else {}
        fig.scatter(
            x,
            val,
            source=self.validations,
            color="#ff7f0e",
            size=4,
            fill_alpha=0.3,
            name=f"nbdist-{name}-sampled",
            **labelled,
        )
        fig.line(x, val, source=self.compare, color="gray", line_dash="dashed", legend_label="compared run")
        fig.add_tools(HoverTool(renderers=[points], tooltips=[("epoch", "@epoch"), (title, f"@{val}{{0.0000}}")]))
        fig.legend.location = "top_right" if what == "loss" else "bottom_right"
        return fig

    # -- feeding ------------------------------------------------------------------------
    def send(self, frames: Frames) -> None:
        self.throughput.send(frames.throughput)
        self.bytes_sent.send(frames.bytes_sent)
        if frames.total_throughput is not None:
            _stream(self.total, frames.total_throughput)
        self.staleness.send(frames.staleness)
        if frames.staleness_mean is not None:
            _stream(self.staleness_mean, frames.staleness_mean)
        if frames.staleness_counts is not None:
            self.staleness_counts.data = self._counts(frames.staleness_counts)
        if frames.train_loss is not None:
            _stream(self.train_loss, frames.train_loss)
        if frames.epochs is not None:
            _stream(self.epochs, self._epoch_columns(frames.epochs, self.epochs))
        if frames.validations is not None:
            _stream(self.validations, self._epoch_columns(frames.validations, self.validations))
        if frames.timeline is not None:
            timeline = frames.timeline[frames.timeline["rank"].isin(self.shown_ranks)]
            _stream(
                self.timeline,
                timeline.assign(color=timeline["phase"].map(PHASE_COLORS)),
                rollover=6 * TIMELINE_SECONDS * max(len(self.shown_ranks), 1),
            )
        self.cpu.send(frames.resources)
        self.memory.send(frames.resources)
        if frames.gan is not None:
            _stream(self.gan, frames.gan)

    def _counts(self, counts: pd.DataFrame) -> dict[str, list]:
        """The staleness distribution as stacked columns: one per rank, a row per value.
        An aggregate: replaced as a whole (a few dozen rows)."""
        table = counts.pivot_table(index="staleness", columns="rank", values="count", fill_value=0)
        table.columns = [f"rank {r}" for r in table.columns]
        table = table.reindex(columns=self.staleness_ranks, fill_value=0)
        return {"staleness": table.index.tolist(), **{c: table[c].tolist() for c in table.columns}}

    @staticmethod
    def _epoch_columns(epochs: pd.DataFrame, source: ColumnDataSource) -> pd.DataFrame:
        return epochs.reindex(columns=source.column_names).astype("float64")

    def show_compared(self, epochs: pd.DataFrame | None) -> None:
        """Validation curves of another run, drawn dashed under this one's (None clears them)."""
        columns = self.compare.column_names
        frame = pd.DataFrame(columns=columns) if epochs is None else self._epoch_columns(epochs, self.compare)
        self.compare.data = {c: frame[c].tolist() for c in columns}

    @property
    def figures(self) -> dict[str, Any]:
        return {
            "throughput": self.throughput.figure,
            "total-throughput": self.total_figure,
            "bytes-sent": self.bytes_sent.figure,
            "staleness": self.staleness.figure,
            "staleness-distribution": self.staleness_figure,
            "timeline": self.timeline_figure,
            "cpu": self.cpu.figure,
            "memory": self.memory.figure,
            "gan": self.gan_figure,
            **{f.name.removeprefix("nbdist-"): f for f in [*self.loss.values(), *self.accuracy.values()]},
        }


def _metric_title(metric: str) -> str:
    return "accuracy" if metric in ("acc", "accuracy") else metric


def phase_legend() -> str:
    swatches = "".join(
        f'<span style="display:inline-block;width:12px;height:12px;background:{PHASE_COLORS[p]};'
        f'margin:0 4px 0 12px"></span>{p}'
        for p in PHASES
    )
    return f"<div style='font-size:12px'>{swatches}</div>"
