"""From metric records to the rows each dashboard view streams (pandas only, no plotting).

`RunFrames` is fed the records of one run as they arrive and returns, per view, only
the rows that are new; the plots append those and nothing else. It keeps what the views
need across batches: each rank's latest throughput (for the total), the samples seen so
far, a master's cumulative phase times (its timeline is their differences), the
staleness counts (for the distribution).
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from nbdist.metrics.updates import staleness_entries

__all__ = ["RunFrames", "Frames", "PHASES", "phase_parts"]

PHASES = ("compute", "communicate", "wait")

# What each timed part of a rank's loop is on the timeline. Workers and allreduce ranks
# report seconds per interval in their 'train' records; masters report running totals in
# their 'phase' records. An allreduce rank's "wait" is the wait for the reduction to
# finish: communication that backward did not hide.
_PARTS = {
    "worker": {"compute_s": "compute", "send_s": "communicate", "wait_s": "wait"},
    "allreduce": {"compute_s": "compute", "update_s": "compute", "wait_s": "communicate"},
    "master": {
        "update": "compute",
        "validate": "compute",
        "reply": "communicate",
        "uplink": "communicate",
        "wait": "wait",
    },
}


def phase_parts(values: dict[str, Any], kind: str) -> dict[str, float]:
    """Seconds of compute / communicate / wait in one record's values; `kind` is
    "worker", "allreduce" or "master"."""
    parts = dict.fromkeys(PHASES, 0.0)
    for key, phase in _PARTS[kind].items():
        parts[phase] += float(values.get(key) or 0.0)
    return parts


@dataclass
class Frames:
    """New rows per view. Per-rank views are keyed by world rank."""

    throughput: dict[int, pd.DataFrame] = field(default_factory=dict)  # t, samples_per_s
    total_throughput: pd.DataFrame | None = None  # t, samples_per_s
    bytes_sent: dict[int, pd.DataFrame] = field(default_factory=dict)  # t, mb_sent: the rank's running total
    staleness: dict[int, pd.DataFrame] = field(default_factory=dict)  # t, staleness (mean), max
    staleness_mean: pd.DataFrame | None = None  # t, staleness: the mean over every worker's updates
    staleness_counts: pd.DataFrame | None = None  # rank, staleness, count: the whole table, when it changed
    train_loss: pd.DataFrame | None = None  # t, samples_seen, loss, metric
    epochs: pd.DataFrame | None = None  # epoch, t, samples_seen, train_loss, val_loss, val_<metric>, ...
    validations: pd.DataFrame | None = None  # t, samples_seen, val_loss, val_<metric>: --validate-every-samples
    timeline: pd.DataFrame | None = None  # x0, y0, x1, y1, rank, phase
    resources: dict[int, pd.DataFrame] = field(default_factory=dict)  # t, cpu_percent, rss_mb
    gan: pd.DataFrame | None = None  # t, samples_seen, d_loss, g_loss, d_real, d_fake (GAN runs)
    ended: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> its 'run' record values
    events: list[tuple[float, str]] = field(default_factory=list)  # t, what happened (ranks lost, restarts)

    def empty(self) -> bool:
        return not (
            self.throughput or self.bytes_sent or self.staleness or self.resources or self.ended or self.events
        ) and all(
            v is None
            for v in (
                self.total_throughput,
                self.staleness_counts,
                self.staleness_mean,
                self.train_loss,
                self.epochs,
                self.validations,
                self.timeline,
                self.gan,
            )
        )


GAN_KEYS = ("d_loss", "g_loss", "d_real", "d_fake")


class RunFrames:
    def __init__(self, topology: str = "master-worker", t0: float | None = None):
        self.topology = topology
        self.t0 = t0
        self._rate: dict[int, float] = {}
        self._bytes_sent: Counter = Counter()  # per rank, since the run began
        self._samples_seen = 0
        self._epoch_samples = 0
        self._phase_totals: dict[int, dict[str, float]] = {}
        self._last_time: dict[int, float] = {}
        self._staleness: Counter = Counter()
        self.metric_name: str | None = None

    def _t(self, when: float) -> float:
        if self.t0 is None:
            self.t0 = when
        return when - self.t0

    def ingest(self, records: list[dict[str, Any]]) -> Frames:
        out = Frames()
        by_kind: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r in sorted(records, key=lambda r: r["time"]):
            by_kind[r["kind"]].append(r)
        if self.t0 is None and records:
            self.t0 = min(r["time"] for r in records)
        self._train(by_kind["train"], out)
        self._updates(by_kind["updates"] + by_kind["update"], out)
        self._masters(by_kind["phase"], out)
        self._epochs(by_kind["epoch"], out)
        self._validations(by_kind["val"], out)
        self._resources(by_kind["resources"], out)
        for r in by_kind["run"]:
            out.ended[r["rank"]] = r["values"]
        self._events(by_kind["fault"], by_kind["restart"], out)
        if out.timeline is not None:
            out.timeline = out.timeline.sort_values("x0", kind="stable").reset_index(drop=True)
        return out

    # -- per view ---------------------------------------------------------------------
    def _events(self, faults: list[dict[str, Any]], restarts: list[dict[str, Any]], out: Frames) -> None:
        """Workers dropped and restarts, in words; a dropped worker's throughput leaves the total."""
        for r in faults:
            v = r["values"]
            self._rate.pop(v.get("rank"), None)
            where = f", host {v['host']}" if v.get("host") else ""
            out.events.append(
                (
                    self._t(r["time"]),
                    f"rank {v.get('rank')} ({v.get('role')} {v.get('worker')}{where}) "
                    f"{v.get('cause')}: dropped, {v.get('workers_left')} workers go on",
                )
            )
        for r in restarts:
            v = r["values"]
            if r["rank"] == 0:  # every rank of the restart says so; one line
                start = f"from checkpoint {v['checkpoint']}" if v.get("checkpoint") else "from the start"
                out.events.append(
                    (
                        self._t(r["time"]),
                        f"restart {v.get('attempt')} on {v.get('ranks')} ranks ({v.get('layout')}), {start}",
                    )
                )
        out.events.sort()

    def _train(self, records: list[dict[str, Any]], out: Frames) -> None:
        if not records:
            return
        kind = "allreduce" if self.topology == "allreduce" else "worker"
        rows: dict[int, list[tuple[float, float]]] = defaultdict(list)
        sent: dict[int, list[tuple[float, float]]] = defaultdict(list)
        totals, losses, segments, gan = [], [], [], []
        for r in records:
            v, rank, t = r["values"], r["rank"], self._t(r["time"])
            rate = float(v.get("samples_per_s") or 0.0)
            rows[rank].append((t, rate))
            if "bytes_sent" in v:  # gradients and messages on the wire (records since --compression)
                self._bytes_sent[rank] += int(v["bytes_sent"])
                sent[rank].append((t, self._bytes_sent[rank] / 1e6))
            self._rate[rank] = rate
            totals.append((t, sum(self._rate.values())))
            samples = int(v.get("samples") or 0)
            self._samples_seen += samples
            if self.metric_name is None:
                self.metric_name = next((k for k in v if k not in _TRAIN_KEYS and k not in GAN_KEYS), None)
            if samples and v.get("loss") is not None:
                losses.append((t, self._samples_seen, v["loss"], v.get(self.metric_name) if self.metric_name else None))
            if any(k in v for k in GAN_KEYS):
                gan.append((t, self._samples_seen, *(v.get(k) for k in GAN_KEYS)))
            segments += self._segments(rank, t, phase_parts(v, kind))
        out.throughput = {rank: pd.DataFrame(rs, columns=["t", "samples_per_s"]) for rank, rs in rows.items()}
        out.bytes_sent = {rank: pd.DataFrame(rs, columns=["t", "mb_sent"]) for rank, rs in sent.items()}
        out.total_throughput = pd.DataFrame(totals, columns=["t", "samples_per_s"])
        if losses:
            out.train_loss = pd.DataFrame(losses, columns=["t", "samples_seen", "loss", "metric"])
        if gan:
            out.gan = pd.DataFrame(gan, columns=["t", "samples_seen", *GAN_KEYS])
        self._add_segments(out, segments)

    def _updates(self, records: list[dict[str, Any]], out: Frames) -> None:
        """The masters' 'updates' summaries (per half second: updates and staleness per
        source rank) and, with --trace-updates, their single 'update' records: per worker,
        one point (mean and max) per second of the run the records cover, and the counts
        for the distribution. By the second, not by the batch read: a finished run's page
        and an export read every record at once, and drew one point per worker, no line."""
        # second of the run -> (t, staleness, updates), per source rank and over them all
        per_rank: dict[int, dict[int, list[tuple[float, int, int]]]] = defaultdict(lambda: defaultdict(list))
        every: dict[int, list[tuple[float, int, int]]] = defaultdict(list)
        for r in records:
            t = self._t(r["time"])
            second = math.floor(t / STALENESS_POINT_SECONDS)
            for source, staleness, count in staleness_entries(r):
                per_rank[source][second].append((t, staleness, count))
                every[second].append((t, staleness, count))
                self._staleness[(source, staleness)] += count
        if not per_rank:
            return
        out.staleness = {rank: _staleness_points(seconds, with_max=True) for rank, seconds in per_rank.items()}
        out.staleness_mean = _staleness_points(every, with_max=False)
        out.staleness_counts = pd.DataFrame(
            [(rank, value, count) for (rank, value), count in sorted(self._staleness.items())],
            columns=["rank", "staleness", "count"],
        )

    def _masters(self, records: list[dict[str, Any]], out: Frames) -> None:
        segments = []
        for r in records:
            rank, totals = r["rank"], phase_parts(r["values"], "master")
            before = self._phase_totals.get(rank, dict.fromkeys(PHASES, 0.0))
            self._phase_totals[rank] = totals
            delta = {p: max(totals[p] - before[p], 0.0) for p in PHASES}
            segments += self._segments(rank, self._t(r["time"]), delta)
        self._add_segments(out, segments)

    def _segments(self, rank: int, t: float, parts: dict[str, float]) -> list[tuple]:
        """The interval that ended at `t`, split in its phases laid end to end (their order
        within the interval is not recorded, only their shares)."""
        spent = sum(parts.values())
        start = self._last_time.get(rank, t - spent)
        self._last_time[rank] = t
        length = t - start
        if length <= 0 or spent <= 0:
            return []
        scale = min(1.0, length / spent)  # rounding and untimed bits: never past the interval
        segments, x = [], start
        for phase in PHASES:
            width = parts[phase] * scale
            if width > 0:
                segments.append((x, rank - 0.4, x + width, rank + 0.4, rank, phase))
                x += width
        return segments

    @staticmethod
    def _add_segments(out: Frames, segments: list[tuple]) -> None:
        if not segments:
            return
        frame = pd.DataFrame(segments, columns=["x0", "y0", "x1", "y1", "rank", "phase"])
        out.timeline = frame if out.timeline is None else pd.concat([out.timeline, frame], ignore_index=True)

    def _epochs(self, records: list[dict[str, Any]], out: Frames) -> None:
        rows = []
        for r in records:
            v = dict(r["values"])
            self._epoch_samples += int(v.get("samples") or 0)
            # Runs recorded before epoch records carried samples_seen: their epochs' sum.
            rows.append({"samples_seen": self._epoch_samples, **v, "t": self._t(r["time"])})
        if rows:
            out.epochs = pd.DataFrame(rows)

    def _validations(self, records: list[dict[str, Any]], out: Frames) -> None:
        """Validations every N samples (--validate-every-samples), between the epochs'."""
        rows = [{**r["values"], "t": self._t(r["time"])} for r in records]
        if rows:
            out.validations = pd.DataFrame(rows)

    def _resources(self, records: list[dict[str, Any]], out: Frames) -> None:
        rows: dict[int, list[tuple[float, float, float]]] = defaultdict(list)
        for r in records:
            v = r["values"]
            rows[r["rank"]].append((self._t(r["time"]), v.get("cpu_percent"), v.get("rss_mb")))
        out.resources = {rank: pd.DataFrame(rs, columns=["t", "cpu_percent", "rss_mb"]) for rank, rs in rows.items()}


# The staleness plot's points: one per worker per this many seconds of the run.
STALENESS_POINT_SECONDS = 1.0

# The keys of a 'train' record that are not its metric.
_TRAIN_KEYS = {"samples", "samples_per_s", "loss", "compute_s", "send_s", "wait_s", "update_s", "version", "bytes_sent"}


def _staleness_points(seconds: dict[int, list[tuple[float, int, int]]], *, with_max: bool) -> pd.DataFrame:
    """One row per second of (t, staleness, updates) points: its last time, the mean
    staleness (and the largest), in time order."""
    rows = []
    for _, points in sorted(seconds.items()):
        row = (max(t for t, _, _ in points), _mean_staleness(points))
        rows.append((*row, max(s for _, s, _ in points)) if with_max else row)
    return pd.DataFrame(rows, columns=["t", "staleness", "max"] if with_max else ["t", "staleness"])


def _mean_staleness(points: list[tuple[float, int, int]]) -> float:
    """The mean staleness of (t, staleness, updates) points, each weighted by its updates."""
    return sum(s * n for _, s, n in points) / sum(n for _, _, n in points)
