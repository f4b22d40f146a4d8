"""What a short real run measured, read back from its metric records.

Every rank of a run writes a 'train' record about twice a second (its samples, and the
seconds it spent computing, sending and waiting since the last one); a master writes
'updates' records (how stale each update it applied was) and 'phase' records (its
cumulative seconds waiting, updating and replying). A rank's first interval holds the
run's warm-up and its last one the end (the last workers finish alone, a checkpoint is
written): both are left out, so the figures are those of the steady state in between.
The point keeps that window (`extra["window"]`: where every rank was in its steady state),
for what other processes did on the node meanwhile (load.py).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from nbdist.metrics import read_log, staleness_entries
from nbdist.scaling.setups import Point, SetUp

__all__ = ["measure_run", "staleness_counts", "percentile", "MeasureError"]


class MeasureError(RuntimeError):
    """A run whose records are too few to measure (it was too short)."""


def _steady(records: list[dict[str, Any]]) -> list[tuple[dict[str, Any], float]]:
    """The records of the steady state, each with the seconds it spans (since the record
    before it)."""
    if len(records) < 2:
        raise MeasureError("the run was too short to measure (fewer than 2 records of a rank)")
    spans = [(r, r["time"] - before["time"]) for before, r in zip(records, records[1:], strict=False)]
    return spans[:-1] if len(spans) >= 3 else spans


def staleness_counts(records: list[dict[str, Any]], workers: set[int]) -> Counter:
    """staleness -> updates of the workers' updates in the masters' steady-state records
    (a sub-master's push is an update at the top master too: not counted)."""
    counts: Counter = Counter()
    by_master: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        if record["kind"] == "updates":
            by_master[record["rank"]].append(record)
    for mine in by_master.values():
        steady = mine[1:-1] if len(mine) >= 4 else mine
        for record in steady:
            for rank, staleness, n in staleness_entries(record):
                if rank in workers:
                    counts[staleness] += n
    return counts


def percentile(counts: Counter, share: float) -> float:
    total = sum(counts.values())
    seen = 0
    for value in sorted(counts):
        seen += counts[value]
        if seen >= share * total:
            return float(value)
    return 0.0


def measure_run(run_dir: str | Path, setup: SetUp, ranks: int, batch: int, cores: int, scaling: str = "weak") -> Point:
    """The measured figures of one run of `setup` on `ranks` ranks with `cores` cores."""
    records = list(read_log(run_dir))
    by_rank: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        if record["kind"] == "train" and record["role"] == "worker":
            by_rank[record["rank"]].append(record)
    if not by_rank:
        raise MeasureError(f"no training records in {run_dir}")
    rate, steps_s, compute, talk, wait = 0.0, [], [], [], []
    starts, ends = [], []
    per_update = 1 if setup.allreduce else max(1, setup.sync_every)
    for mine in by_rank.values():
        steady = _steady(mine)
        starts.append(steady[0][0]["time"] - steady[0][1])
        ends.append(steady[-1][0]["time"])
        intervals = [(r["values"], seconds) for r, seconds in steady if seconds > 0 and r["values"]["samples"]]
        if not intervals:
            raise MeasureError(f"rank {mine[0]['rank']} of {run_dir} trained nothing in its steady state")
        samples = sum(v["samples"] for v, _ in intervals)
        seconds = sum(s for _, s in intervals)
        steps = samples / batch / per_update
        rate += samples / seconds
        steps_s.append(seconds / steps)
        phase = {k: sum(v.get(f"{k}_s", 0.0) for v, _ in intervals) / steps for k in _PHASES}
        if setup.allreduce:  # waiting in the allreduce is waiting for the slowest rank and the reduction
            compute.append(phase["compute"] + phase["update"])
            talk.append(phase["wait"])
            wait.append(0.0)
        else:
            compute.append(phase["compute"])
            talk.append(phase["send"])
            wait.append(phase["wait"])
    point = Point(
        setup,
        ranks,
        len(by_rank) if not setup.allreduce else ranks,
        batch,
        samples_per_s=rate,
        step_s=_mean(steps_s),
        compute_s=_mean(compute),
        communicate_s=_mean(talk),
        wait_s=_mean(wait),
        cores=min(ranks, cores),
        oversubscribed=ranks > cores,
        scaling=scaling,
        extra={"window": [max(starts), min(ends)]},
    )
    if setup.allreduce:
        point.staleness_mean = point.staleness_p99 = 0.0
        return point
    counts = staleness_counts(records, set(by_rank))
    if counts:
        total = sum(counts.values())
        point.staleness_mean = sum(s * n for s, n in counts.items()) / total
        point.staleness_p99 = percentile(counts, 0.99)
    point.master_utilisation = _master_busy(records)
    return point


_PHASES = ("compute", "send", "wait", "update")


def _master_busy(records: list[dict[str, Any]]) -> float | None:
    """The top master's share of time not spent waiting, over its steady-state phase records."""
    phases = [r for r in records if r["kind"] == "phase" and r["role"] == "master"]
    if not phases:
        return None
    top = min(r["rank"] for r in phases)
    mine = [r for r in phases if r["rank"] == top]
    if len(mine) < 3:
        return None
    first, last = (mine[1], mine[-2]) if len(mine) >= 4 else (mine[0], mine[-1])
    seconds = last["time"] - first["time"]
    waited = last["values"].get("wait", 0.0) - first["values"].get("wait", 0.0)
    return max(0.0, min(1.0, 1.0 - waited / seconds)) if seconds > 0 else None


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
