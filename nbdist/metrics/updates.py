"""A master's record of the updates it applies: one summary per reporting interval.

A master with many workers and a small model applies hundreds of updates a second; one
record per update would be millions of rows an hour in the run's log, the run store and
the notebook's history. So a master sends one 'updates' record per interval instead: how
many updates it applied from each source rank, with their staleness as a histogram per
rank. The records a run writes per second are then bounded whatever the update rate, and
the dashboard draws the same per-worker mean, maximum and distribution from them.

`--trace-updates` also writes one 'update' record per update (source rank, staleness,
version, and "traced": its interval's summary counts it), for looking closely at one
run's order of service; it is off by default.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = ["UpdateSummary", "staleness_entries", "staleness_by_rank"]


@dataclass(slots=True)
class UpdateSummary:
    """The updates applied since the last 'updates' record."""

    counts: Counter = field(default_factory=Counter)  # (source rank, staleness) -> updates
    first_version: int = 0

    def add(self, source_rank: int, staleness: int, version: int) -> None:
        if not self.counts:
            self.first_version = version
        self.counts[(source_rank, staleness)] += 1

    def take(self, version: int) -> dict[str, Any] | None:
        """The values of the interval's 'updates' record (None when nothing was applied),
        and a fresh interval. `histogram` rows are [source rank, staleness, updates]."""
        if not self.counts:
            return None
        total = sum(self.counts.values())
        values = {
            "updates": total,
            "first_version": self.first_version,
            "version": version,
            "staleness_mean": sum(s * c for (_, s), c in self.counts.items()) / total,
            "staleness_max": max(s for _, s in self.counts),
            "histogram": [[rank, s, c] for (rank, s), c in sorted(self.counts.items())],
        }
        self.counts = Counter()
        return values


def staleness_entries(record: dict[str, Any]) -> list[tuple[int, int, int]]:
    """(source rank, staleness, updates) an 'updates' summary or a single 'update' record
    counts. A traced 'update' (--trace-updates, marked "traced") counts nothing: the
    summary of its interval counts it; a single record without the mark comes from a log
    written before the summaries, and counts itself."""
    v = record["values"]
    if record["kind"] == "updates":
        return [(int(rank), int(s), int(c)) for rank, s, c in v.get("histogram", [])]
    if v.get("staleness") is None or v.get("traced"):
        return []
    return [(int(v.get("source_rank", record["rank"])), int(v["staleness"]), 1)]


def staleness_by_rank(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per source rank, over a run's records: updates applied, mean, min and max
    staleness (from staleness_entries). Rows sorted by rank."""
    counts: Counter = Counter()
    for record in records:
        for rank, staleness, n in staleness_entries(record):
            counts[(rank, staleness)] += n
    rows = []
    for rank in sorted({rank for rank, _ in counts}):
        mine = {s: n for (r, s), n in counts.items() if r == rank}
        total = sum(mine.values())
        rows.append(
            {
                "rank": rank,
                "updates": total,
                "mean": sum(s * n for s, n in mine.items()) / total,
                "min": min(mine),
                "max": max(mine),
            }
        )
    return rows
