"""Getting a run's records into the store from the files its ranks write.

Every rank already appends its records to `metrics/rank-NNNNN.jsonl` (nbdist.metrics.log).
For a batch run the run leader follows those files on a thread (`RunRecorder`) and is the
store's only writer: no rank ever waits on SQLite, and a thousand ranks never open the
database at once. The same follower imports a finished run's directory
(`python -m nbdist store import RUN_DIR`), e.g. one trained where the store was not
reachable. Records carry (run, rank, seq), so reading a file twice stores nothing twice.

The recorder outlives any failure of one pass (a store locked by another writer past
its wait, a connection lost, a damaged log line): the records stay in the files and in
its hands, it tries again after a pause that doubles up to RETRY_LONGEST, and it says
once, in one line, that the store's records are delayed. The run's end is recorded
however long the store took, up to END_RETRY_SECONDS; past that, one line says how to
record it later.
"""

from __future__ import annotations

import errno
import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

from nbdist.metrics.log import metrics_dir, parse_records
from nbdist.metrics.record import stopped_on_request
from nbdist.store.runstore import RunStore

__all__ = ["LogFollower", "RunFeed", "RunRecorder", "import_run", "record_checkpoints"]

RECORD_EVERY = 0.5  # seconds between the recorder's passes over the logs
# After a failed pass the recorder waits twice as long as before, up to this.
RETRY_LONGEST = 30.0
# How long the recorder's writes wait for another writer's lock before the pass fails
# and is tried again later (it holds the records meanwhile: no need to wait longer).
RECORDER_LOCK_WAIT = 5.0
# How long the end of a run tries to record its last records and its end.
END_RETRY_SECONDS = 120.0


class LogFollower:
    """Reads the complete lines appended to a run's rank logs since the last read."""

    def __init__(self, run_dir: Path | str):
        self.directory = metrics_dir(Path(run_dir))
        self._offsets: dict[Path, int] = {}
        self._lines: dict[Path, int] = {}  # lines read so far, to name a damaged one

    def poll(self) -> list[dict[str, Any]]:
        records: list[dict[str, Any]] = []
        for path in sorted(self.directory.glob("rank-*.jsonl")):
            offset = self._offsets.get(path, 0)
            with open(path, "rb") as fh:
                fh.seek(offset)
                chunk = fh.read()
            # A line is complete once its newline is written; the rest waits for next time.
            complete = chunk[: chunk.rfind(b"\n") + 1]
            lines = complete.splitlines()
            records += parse_records(lines, path, first_line=self._lines.get(path, 0) + 1)
            self._offsets[path] = offset + len(complete)
            self._lines[path] = self._lines.get(path, 0) + len(lines)
        return records


def record_checkpoints(store: RunStore, run_id: str, run_dir: Path) -> None:
    """Committed checkpoint directories (those with meta.json) into the store."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return
    for meta in root.glob("*/meta.json"):
        if meta.parent.name.startswith("."):
            continue
        try:
            committed = meta.stat().st_mtime
        except FileNotFoundError:
            continue  # pruned since the listing (--keep-checkpoints), by the writer's thread
        store.add_checkpoint(run_id, meta.parent.name, meta.parent, committed)


class RunFeed:
    """The writing side of one run in the store: begins it (or resumes it), adds its
    records and committed checkpoints with a heartbeat, and ends it. Opening it checks
    the store, so a store that cannot be used is an error before any training."""

    def __init__(
        self,
        store_path: Path | str,
        run_id: str,
        run_dir: Path | str,
        *,
        options: dict[str, Any],
        layout: dict[str, Any],
        study: str | None = None,
        trial: int | None = None,
    ):
        self.run_id, self.run_dir = run_id, Path(run_dir).resolve()
        self.store = RunStore(store_path)
        self.store.begin_run(run_id, run_dir=self.run_dir, options=options, layout=layout, study=study, trial=trial)

    def add(self, records: list[dict[str, Any]]) -> None:
        self.store.add_records(records)
        record_checkpoints(self.store, self.run_id, self.run_dir)
        self.store.heartbeat(self.run_id)

    def end(self, status: str, reason: str | None = None, final: dict[str, Any] | None = None) -> None:
        self.store.end_run(self.run_id, status, reason, final)
        self.store.close()

    def close(self) -> None:
        """Stop writing without ending the run (it restarts, and goes on in this row)."""
        self.store.close()


class RunRecorder:
    """The run leader's thread that moves a batch run's records from its ranks' logs
    into the store while it trains."""

    def __init__(
        self,
        store_path: Path | str,
        run_id: str,
        run_dir: Path,
        *,
        options: dict[str, Any],
        layout: dict[str, Any],
        study: str | None = None,
        trial: int | None = None,
        every: float = RECORD_EVERY,
    ):
        self.every = every
        self.follower = LogFollower(run_dir)
        self.feed = RunFeed(store_path, run_id, run_dir, options=options, layout=layout, study=study, trial=trial)
        self.feed.store.lock_wait(RECORDER_LOCK_WAIT)
        self._unsent: list[dict[str, Any]] = []
        self._pause = every  # until the next pass: `every`, longer after failures
        self._delayed = False  # a pass failed since the last one that went through
        self._full = False  # the last failure was a full disk
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="nbdist-run-recorder", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        # The feed's connection is used by this thread only until finish() joins it.
        while not self._stop.wait(self._pause):
            self._attempt(self._record)

    def _attempt(self, write: Any) -> bool:
        """One write; on any error: say once that records are delayed, pause longer."""
        try:
            write()
        except Exception as exc:  # noqa: BLE001 - whatever one write raises, the recorder goes on
            self._full = _no_space(exc)
            if not self._delayed:
                self._delayed = True
                print(
                    f"nbdist: warning: the run store {self.feed.store.label} cannot take this run's records now "
                    f"({_first_line(exc)}); they are kept and sent again, the store's view of the run is delayed",
                    file=sys.stderr,
                    flush=True,
                )
            self._pause = min(2 * self._pause, RETRY_LONGEST)
            return False
        self._delayed, self._pause = False, self.every
        return True

    def _record(self) -> None:
        """The logs' new records into the store. A pass that fails keeps them for the
        next one: the store keeps each record once, however often it is sent."""
        self._unsent += self.follower.poll()
        self.feed.add(self._unsent)
        self._unsent = []

    def _until_done(self, write: Any, what: str) -> None:
        """`write()` at the end of the run, tried again until END_RETRY_SECONDS have passed."""
        deadline = time.monotonic() + END_RETRY_SECONDS
        self._pause = self.every
        while not self._attempt(write):
            # A full disk under the store is not freed by waiting: say so at once.
            if self._full or time.monotonic() + self._pause > deadline:
                why = "its disk is full" if self._full else f"not within {END_RETRY_SECONDS:.0f} s"
                print(
                    f"nbdist: warning: the run store {self.feed.store.label} did not take {what} ({why}); "
                    f"`python -m nbdist store import {self.feed.run_dir}` records it later",
                    file=sys.stderr,
                    flush=True,
                )
                return
            time.sleep(self._pause)

    def finish(self, status: str, reason: str | None = None, final: dict[str, Any] | None = None) -> None:
        """After every rank closed its log: the last records, then the run's end."""
        self._stop.set()
        self._thread.join()

        def last_records_and_end() -> None:
            self._record()
            self.feed.store.end_run(self.feed.run_id, status, reason, final)

        self._until_done(last_records_and_end, "the run's end")
        self.feed.close()

    def pause(self) -> None:
        """The run restarts after a failure (its new leader records it from then on):
        the records so far, and the run left running."""
        self._stop.set()
        self._thread.join()
        self._until_done(self._record, "the run's last records")
        self.feed.close()


def _no_space(exc: BaseException) -> bool:
    """A write that failed for want of disk space (SQLite's SQLITE_FULL, or ENOSPC/EDQUOT)."""
    return getattr(exc, "sqlite_errorname", "") == "SQLITE_FULL" or getattr(exc, "errno", None) in (
        errno.ENOSPC,
        errno.EDQUOT,
    )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def import_run(store: RunStore, run_dir: Path | str) -> tuple[str, int]:
    """A run directory (finished, stopped or killed) into the store; returns its id and
    how many records were new."""
    from nbdist.errors import UserError

    run_dir = Path(run_dir).resolve()
    if not (run_dir / "options.json").exists():
        raise UserError(f"{run_dir} is not a run directory (no options.json)")
    run_id = run_dir.name
    options = json.loads((run_dir / "options.json").read_text())
    layout_file = run_dir / "layout.json"
    layout = json.loads(layout_file.read_text()) if layout_file.exists() else {}
    records = LogFollower(run_dir).poll()
    store.begin_run(run_id, run_dir=run_dir, options=options, layout=layout)
    added = store.add_records(records)
    record_checkpoints(store, run_id, run_dir)
    status, reason, final = _outcome(run_dir, records)
    store.end_run(run_id, status, reason, final)
    return run_id, added


def _outcome(run_dir: Path, records: list[dict[str, Any]]) -> tuple[str, str | None, dict[str, Any] | None]:
    """How a run ended, from what it left: its summary, else its ranks' last words."""
    summary = run_dir / "summary.json"
    ends = [r["values"] for r in records if r["kind"] == "run"]
    failed = [v for v in ends if v.get("status") == "failed"]
    if failed:
        return "failed", failed[0].get("error"), None
    if summary.exists():
        data = json.loads(summary.read_text())
        stopped = stopped_on_request(data["stop_reason"])
        return ("stopped" if stopped else "completed"), data["stop_reason"], data.get("final")
    return "killed", "the run left no summary: it was killed before it ended", None
