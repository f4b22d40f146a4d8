"""Per-run metric log: each rank appends its records to its own JSON-lines file.

Records are buffered in memory and written a few times a second from the training
loop's own thread, at step boundaries: a step never waits on a file or on a client.
One file per rank means no two processes ever write the same file. A sink (the
notebook's live stream) receives the same batches at the same moments.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from nbdist.metrics.record import Record

__all__ = ["RunLog", "RecordSink", "read_log", "metrics_dir"]

# Called with each flushed batch of record dicts; must return at once (no waiting on
# a client or a network on the training loop's thread).
RecordSink = Callable[[list[dict[str, Any]]], None]


def metrics_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "metrics"


def _finite(value: Any) -> Any:
    # JSON has no NaN/inf; None keeps a record valid and says "no value".
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class RunLog:
    __slots__ = ("run", "trial", "rank", "role", "path", "_pending", "_last_flush", "flush_every", "_file",
                 "sink")

    def __init__(self, run_dir: Path, run: str, rank: int, role: str, *, trial: int | None = None,
                 flush_every: float = 0.25, sink: RecordSink | None = None):
        self.run, self.trial, self.rank, self.role = run, trial, rank, role
        directory = metrics_dir(run_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"rank-{rank:05d}.jsonl"
        self._file = open(self.path, "a", encoding="utf-8")
        self._pending: list[dict[str, Any]] = []
        self.sink = sink
        self._last_flush = time.monotonic()
        self.flush_every = flush_every

    def emit(self, kind: str, values: dict[str, Any], *, step: int = 0, epoch: int = 0) -> None:
        record = Record(self.run, self.trial, self.rank, self.role, kind, int(step), int(epoch),
                        time.time(), {k: _finite(v) for k, v in values.items()})
        self._pending.append(record.to_dict())
        if time.monotonic() - self._last_flush >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            batch, self._pending = self._pending, []
            self._file.write("\n".join(json.dumps(r, separators=(",", ":")) for r in batch) + "\n")
            self._file.flush()
            if self.sink is not None:
                self.sink(batch)
        self._last_flush = time.monotonic()

    def close(self) -> None:
        self.flush()
        self._file.close()


def read_log(run_dir: Path | str, kind: str | None = None) -> Iterator[dict[str, Any]]:
    """Every record of a run (all ranks), optionally only one kind, ordered by time."""
    records = []
    for path in sorted(metrics_dir(Path(run_dir)).glob("rank-*.jsonl")):
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    rec = json.loads(line)
                    if kind is None or rec["kind"] == kind:
                        records.append(rec)
    records.sort(key=lambda r: r["time"])
    return iter(records)
