"""Per-run metric log: each rank appends its records to its own JSON-lines file.

Records are buffered in memory and written a few times a second from the training
loop's own thread, at step boundaries: a step never waits on a file or on a client.
One file per rank means no two processes ever write the same file. A sink (the
notebook's live stream) receives the same batches at the same moments. About once a
second the log also records the rank's CPU and memory use (kind "resources"), and each
rank's last record (kind "run": how it ended) names the node it ran on.

A rank killed while it writes leaves its last line without its newline. Before a resumed
run appends to a log, that torn tail is cut off (with a warning saying how many bytes
went), so the next record starts a line of its own; and every reader of the logs skips a
line that is not a whole record, and says so, instead of failing on it.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from nbdist.durable import make_dir, naming, open_private
from nbdist.metrics.record import Record
from nbdist.metrics.resources import ResourceSampler

__all__ = ["RunLog", "RecordSink", "read_log", "metrics_dir", "parse_records", "repair_torn_tail"]

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


def repair_torn_tail(path: Path) -> int:
    """Cut a last line that has no newline (its writer was killed half-way through it),
    so that what is appended next starts a line of its own; returns the bytes cut."""
    try:
        fh = open(path, "rb+")
    except FileNotFoundError:
        return 0
    with fh:
        size = fh.seek(0, os.SEEK_END)
        end = size
        while end > 0:  # back to the last newline, a block at a time
            start = max(0, end - 65536)
            fh.seek(start)
            block = fh.read(end - start)
            newline = block.rfind(b"\n")
            if newline >= 0:
                end = start + newline + 1
                break
            end = start
        if end < size:
            fh.truncate(end)
            fh.flush()
            os.fsync(fh.fileno())
        return size - end


def parse_records(lines: Iterable[bytes | str], path: Path, first_line: int = 1) -> list[dict[str, Any]]:
    """The records of `lines` (of log `path`, numbered from `first_line`); a line that is
    not a whole record is skipped, and one warning names how many and the first."""
    records: list[dict[str, Any]] = []
    bad: list[int] = []
    for number, line in enumerate(lines, first_line):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            bad.append(number)
            continue
        if isinstance(record, dict) and "kind" in record and "time" in record:
            records.append(record)
        else:
            bad.append(number)
    if bad:
        some = f"line {bad[0]}" if len(bad) == 1 else f"{len(bad)} lines (the first: line {bad[0]})"
        print(
            f"nbdist: warning: {path}: skipped {some} that {'is' if len(bad) == 1 else 'are'} not a whole "
            f"record (a rank killed while writing it?)",
            file=sys.stderr,
            flush=True,
        )
    return records


def _records_in(path: Path) -> int:
    if not path.exists():
        return 0
    with open(path, "rb") as fh:
        return sum(1 for line in fh if line.strip())


class RunLog:
    __slots__ = (
        "run",
        "trial",
        "rank",
        "role",
        "path",
        "_pending",
        "_last_flush",
        "flush_every",
        "_file",
        "sink",
        "seq",
        "_resources",
        "_last_sample",
        "sample_every",
        "_failed",
    )

    def __init__(
        self,
        run_dir: Path,
        run: str,
        rank: int,
        role: str,
        *,
        trial: int | None = None,
        flush_every: float = 0.25,
        sample_every: float = 1.0,
        sink: RecordSink | None = None,
    ):
        self.run, self.trial, self.rank, self.role = run, trial, rank, role
        directory = metrics_dir(run_dir)
        make_dir(directory)
        self.path = directory / f"rank-{rank:05d}.jsonl"
        torn = repair_torn_tail(self.path)
        if torn:
            print(
                f"nbdist: warning: {self.path} ended in a torn record ({torn} bytes with no newline: the rank was "
                f"killed while writing it); dropped them before appending",
                file=sys.stderr,
                flush=True,
            )
        # A resumed run appends to its log: its records go on counting where it stopped.
        self.seq = _records_in(self.path)
        self._file = open_private(self.path, "a")
        self._pending: list[dict[str, Any]] = []
        self.sink = sink
        self._last_flush = time.monotonic()
        self.flush_every = flush_every
        self._resources = ResourceSampler()
        self._last_sample = time.monotonic()
        self.sample_every = sample_every
        self._failed = False  # a write failed (a full disk): raised once, not again at close

    def emit(self, kind: str, values: dict[str, Any], *, step: int = 0, epoch: int = 0) -> None:
        if kind == "run":  # once per rank: where it ran, for a job spread over several nodes
            values = {**values, "host": socket.gethostname()}
        self._append(kind, values, step, epoch)
        now = time.monotonic()
        if now - self._last_sample >= self.sample_every:
            self._last_sample = now
            self._append("resources", self._resources.sample(), step, epoch)
        # An epoch's record goes out at once: a study (and the notebook) acts on it.
        if kind == "epoch" or now - self._last_flush >= self.flush_every:
            self.flush()

    def _append(self, kind: str, values: dict[str, Any], step: int, epoch: int) -> None:
        record = Record(
            self.run,
            self.trial,
            self.rank,
            self.role,
            kind,
            int(step),
            int(epoch),
            time.time(),
            {k: _finite(v) for k, v in values.items()},
            self.seq,
        )
        self.seq += 1
        self._pending.append(record.to_dict())

    def flush(self) -> None:
        """Write the records held; an OSError (a full disk) is raised the first time only:
        the run then ends, and its failure records must not raise it again."""
        if self._pending:
            batch, self._pending = self._pending, []
            try:
                with naming(self.path):
                    self._file.write("\n".join(json.dumps(r, separators=(",", ":")) for r in batch) + "\n")
                    self._file.flush()
            except OSError:
                if self._failed:
                    return
                self._failed = True
                raise
            if self.sink is not None:
                self.sink(batch)
        self._last_flush = time.monotonic()

    def close(self) -> None:
        try:
            self.flush()
        finally:
            try:
                self._file.close()
            except OSError:
                if not self._failed:
                    raise


def read_log(run_dir: Path | str, kind: str | None = None) -> Iterator[dict[str, Any]]:
    """Every record of a run (all ranks), optionally only one kind, ordered by time."""
    records = []
    for path in sorted(metrics_dir(Path(run_dir)).glob("rank-*.jsonl")):
        with open(path, "rb") as fh:
            records += [r for r in parse_records(fh, path) if kind is None or r["kind"] == kind]
    records.sort(key=lambda r: r["time"])
    return iter(records)
