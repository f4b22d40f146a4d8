"""Client side of the live stream: gather the record batches every rank publishes.

The batches land in the task's per-engine `data` dicts (ipyparallel's client thread
merges them in as they arrive); `LiveRecords.poll()` moves the new ones into one list.
Reading pops the keys, so each batch is taken once and the dicts do not grow.

The list is bounded, so that a job of many hours does not fill the kernel's memory:
records that come per interval (each rank's throughput and resources, a master's phases
and update summaries: a few per rank per second) are kept for the most recent
`keep_recent` only; those that follow the data or the run's events (epochs, validations,
run ends, faults, restarts) are all kept. The whole stream is in the run's log and the
run store. Readers that follow the stream (the store writer, the dashboard, a study)
hold a cursor, the number of records received before theirs, and read with `since`.
"""

from __future__ import annotations

import bisect
import threading
from typing import Any

__all__ = ["LiveRecords", "RecordHistory", "KEEP_RECENT", "KEPT_KINDS"]

# Interval records kept in the notebook: about 12 minutes of a 17-rank job, hours of a small one.
KEEP_RECENT = 50_000
KEPT_KINDS = frozenset({"epoch", "val", "run", "fault", "restart"})


class LiveRecords:
    """The records of one task's engines, gathered into a RecordHistory as they arrive."""

    def __init__(self, async_result: Any, prefix: str, keep_recent: int = KEEP_RECENT):
        self._result = async_result
        self._prefix = prefix
        self.history = RecordHistory(keep_recent)

    @property
    def records(self) -> list[dict[str, Any]]:
        return self.history.records

    def since(self, cursor: int) -> tuple[list[dict[str, Any]], int]:
        return self.history.since(cursor)

    def _engine_dicts(self) -> list[dict[str, Any]]:
        data = self._result.data
        return data if isinstance(data, list) else [data]

    def poll(self) -> list[dict[str, Any]]:
        """The records that arrived since the last poll (also added to the history)."""
        with self.history.lock:
            new: list[dict[str, Any]] = []
            for published in self._engine_dicts():
                for key in sorted(k for k in list(published) if k.startswith(self._prefix)):
                    new.extend(published.pop(key))
            self.history.add(new)
            return new


class RecordHistory:
    """The kept records of a stream, in arrival order, and cursors to follow it."""

    def __init__(self, keep_recent: int = KEEP_RECENT):
        self.lock = threading.RLock()
        self._keep_recent = keep_recent
        self.records: list[dict[str, Any]] = []  # the kept records, in arrival order
        self._numbers: list[int] = []  # each kept record's number in the stream (0, 1, ...)
        self.received = 0  # records received in all
        self._interval_kept = 0  # kept records of a kind not in KEPT_KINDS

    def add(self, new: list[dict[str, Any]]) -> None:
        with self.lock:
            self.records.extend(new)
            self._numbers.extend(range(self.received, self.received + len(new)))
            self.received += len(new)
            self._interval_kept += sum(1 for r in new if r["kind"] not in KEPT_KINDS)
            if self._interval_kept > 2 * self._keep_recent:  # thinned now and then, not per add
                self._thin()

    def since(self, cursor: int) -> tuple[list[dict[str, Any]], int]:
        """The kept records received after the first `cursor` ones, and the new cursor.
        A reader more than `keep_recent` interval records behind misses those thinned out."""
        with self.lock:
            start = bisect.bisect_left(self._numbers, cursor)
            return self.records[start:], self.received

    def _thin(self) -> None:
        """Drop the oldest interval records, keeping the newest `keep_recent` of them."""
        drop = self._interval_kept - self._keep_recent
        kept, numbers = [], []
        for record, number in zip(self.records, self._numbers, strict=True):
            if drop > 0 and record["kind"] not in KEPT_KINDS:
                drop -= 1
                continue
            kept.append(record)
            numbers.append(number)
        self.records, self._numbers = kept, numbers
        self._interval_kept = self._keep_recent
