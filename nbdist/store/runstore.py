"""The run store: every run, its metric records, its checkpoints and, for studies, their
trials, in one SQLite file (WAL mode) or one PostgreSQL database (nbdist.store.dialects).

Exactly one writer feeds a run's records: the notebook's collector for a notebook job,
the run leader's recorder thread for a batch run (topology ranks never touch the store).
Readers (the dashboard, `job.history` of a past run) poll it while it is written: WAL,
or PostgreSQL's snapshots, let them read without blocking the writer.

A study may be shared by several jobs (coordinators): each joins it as a row of
`study_jobs` with a heartbeat; the study tables are nbdist.store.studies, the connection
and its transactions nbdist.store.connection, the rows handed out nbdist.store.rows.

A run whose writer vanished (the job was killed) stays "running" in the file; the next
reader that opens the store marks it "killed" (same host: its writer process is gone;
any host: no heartbeat for STALE_SECONDS).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from nbdist.store.dialects import StoreError
from nbdist.store.rows import (
    RUN_STATES,
    STALE_SECONDS,
    TRIAL_STATES,
    RunRow,
    TrialRow,
    from_json,
    json_text,
    process_alive,
    without_passwords,
)
from nbdist.store.studies import StudyTables

__all__ = ["RunStore", "RunRow", "TrialRow", "STALE_SECONDS", "RUN_STATES", "TRIAL_STATES"]

_RECORD_COLUMNS = ("run", "rank", "seq", "trial", "role", "kind", "step", "epoch", "time")


class RunStore(StudyTables):
    """One connection to a store (a file path, sqlite:///PATH or postgresql://...): its
    runs, records and checkpoints here, its studies from StudyTables; use one RunStore
    per thread."""

    # -- runs: written by the run's one writer ----------------------------------------
    def begin_run(
        self,
        run_id: str,
        *,
        run_dir: str | Path | None,
        options: dict[str, Any],
        layout: dict[str, Any],
        kind: str = "train",
        study: str | None = None,
        trial: int | None = None,
    ) -> None:
        """A new run, a reserved one, or a resumed one (the same id): running again, from now."""
        now = time.time()
        with self._write() as conn:
            conn.execute(
                """INSERT INTO runs (id, kind, status, run_dir, options, layout, study, trial, started,
                                     heartbeat, host, pid)
                   VALUES (?, ?, 'running', ?, ?, ?, ?, ?, ?, ?, ?, ?)
                   ON CONFLICT (id) DO UPDATE SET status = 'running', reason = NULL, ended = NULL,
                       kind = excluded.kind, run_dir = COALESCE(excluded.run_dir, runs.run_dir),
                       options = excluded.options, layout = excluded.layout,
                       study = COALESCE(excluded.study, runs.study), trial = COALESCE(excluded.trial, runs.trial),
                       heartbeat = excluded.heartbeat, host = excluded.host, pid = excluded.pid""",
                (
                    run_id,
                    kind,
                    None if run_dir is None else str(run_dir),
                    json_text(without_passwords(options)),
                    json_text(layout),
                    study,
                    trial,
                    now,
                    now,
                    socket.gethostname(),
                    os.getpid(),
                ),
            )

    def reserve_run(
        self, run_id: str, run_dir: str | Path, *, study: str | None = None, trial: int | None = None
    ) -> bool:
        """Take the name `run_id` for a run about to start (its row, running from now);
        False when the store has a run of that name (one INSERT decides between two jobs
        that choose the same name at once)."""
        now = time.time()
        with self._write() as conn:
            return (
                conn.execute(
                    "INSERT INTO runs (id, status, run_dir, study, trial, started, heartbeat, host, pid) "
                    "VALUES (?, 'running', ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING",
                    (run_id, str(run_dir), study, trial, now, now, socket.gethostname(), os.getpid()),
                ).rowcount
                == 1
            )

    def heartbeat(self, run_id: str) -> None:
        # A run marked killed whose writer turns out to be alive (it was only paused)
        # is running again.
        with self._write() as conn:
            conn.execute(
                "UPDATE runs SET heartbeat = ?, status = CASE status WHEN 'killed' THEN "
                "'running' ELSE status END WHERE id = ?",
                (time.time(), run_id),
            )

    def end_run(self, run_id: str, status: str, reason: str | None = None, final: dict[str, Any] | None = None) -> None:
        if status not in RUN_STATES or status == "running":
            raise ValueError(f"a run ends as one of {RUN_STATES[1:]}, not {status!r}")
        with self._write() as conn:
            conn.execute(
                "UPDATE runs SET status = ?, reason = ?, final = COALESCE(?, final), ended = ?, "
                "heartbeat = ? WHERE id = ?",
                (status, reason, json_text(final), time.time(), time.time(), run_id),
            )

    def add_records(self, records: Iterable[dict[str, Any]]) -> int:
        """Insert metric records (Record.to_dict() form); ones already stored are skipped.
        Returns how many were new."""
        rows = [tuple(r.get(c) for c in _RECORD_COLUMNS) + (json_text(r["values"]),) for r in records]
        if not rows:
            return 0
        with self._write() as db:
            return db.executemany(
                'INSERT INTO records (run, rank, seq, trial, role, kind, step, epoch, time, "values") '
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                rows,
            )

    def add_checkpoint(self, run_id: str, label: str, path: str | Path, when: float | None = None) -> None:
        with self._write() as conn:
            conn.execute(
                "INSERT INTO checkpoints (run, label, path, time) VALUES (?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (run_id, label, str(path), when),
            )

    # -- reading ----------------------------------------------------------------------
    def reap(self, stale_after: float = STALE_SECONDS) -> list[str]:
        """Mark runs whose writer is gone as killed; returns their ids."""
        here, now = socket.gethostname(), time.time()
        rows = self._db.execute("SELECT id, heartbeat, host, pid FROM runs WHERE status = 'running'").fetchall()
        dead = [
            run_id
            for run_id, beat, host, pid in rows
            if (host == here and pid and not process_alive(pid)) or (beat or 0) < now - stale_after
        ]
        if dead:
            with self._write() as conn:
                conn.executemany(
                    "UPDATE runs SET status = 'killed', ended = heartbeat, reason = 'the job ended without "
                    "finishing the run (killed, or its node lost); its last records are kept' "
                    "WHERE id = ? AND status = 'running'",
                    [(d,) for d in dead],
                )
        return dead

    def runs(self, *, kind: str | None = None, study: str | None = None) -> list[RunRow]:
        """Every run, newest first (writers that vanished are marked killed first)."""
        self.reap()
        query, args = "SELECT * FROM runs", []
        where = []
        if kind is not None:
            where.append("kind = ?")
            args.append(kind)
        if study is not None:
            where.append("study = ?")
            args.append(study)
        if where:
            query += " WHERE " + " AND ".join(where)
        return [self._run_row(r) for r in self._db.execute(query + " ORDER BY started DESC", args)]

    def run_ids(self) -> list[str]:
        return [row[0] for row in self._db.execute("SELECT id FROM runs")]

    def run(self, run_id: str) -> RunRow:
        self.reap()
        row = self._db.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            raise StoreError(f"no run {run_id!r} in the store {self.label}")
        return self._run_row(row)

    def _run_row(self, row: tuple) -> RunRow:
        (
            run_id,
            kind,
            status,
            reason,
            run_dir,
            options,
            layout,
            final,
            study,
            trial,
            started,
            ended,
            heartbeat,
            _host,
            _pid,
        ) = row
        return RunRow(
            run_id,
            kind,
            status,
            reason,
            run_dir,
            from_json(options, {}),
            from_json(layout, {}),
            from_json(final, {}),
            study,
            trial,
            started,
            ended,
            heartbeat,
        )

    def records(
        self, run_id: str, *, after: int = 0, kinds: Iterable[str] | None = None, limit: int | None = None
    ) -> tuple[list[dict[str, Any]], int]:
        """The run's records stored after row `after`, in the order they were stored, and
        the row to ask after next time (poll with it to get only what is new)."""
        rowid = self._db.rowid
        query = (
            f'SELECT {rowid}, run, rank, seq, trial, role, kind, step, epoch, time, "values" '
            f"FROM records WHERE run = ? AND {rowid} > ?"
        )
        args: list[Any] = [run_id, after]
        if kinds is not None:
            kinds = list(kinds)
            query += f" AND kind IN ({','.join('?' * len(kinds))})"
            args += kinds
        query += f" ORDER BY {rowid}"
        if limit is not None:
            query += f" LIMIT {int(limit)}"
        out, last = [], after
        for rowid, run, rank, seq, trial, role, kind, step, epoch, when, values in self._db.execute(query, args):
            out.append(
                {
                    "run": run,
                    "trial": trial,
                    "rank": rank,
                    "role": role,
                    "kind": kind,
                    "step": step,
                    "epoch": epoch,
                    "time": when,
                    "values": json.loads(values),
                    "seq": seq,
                }
            )
            last = rowid
        return out, last

    def checkpoints(self, run_id: str) -> list[dict[str, Any]]:
        rows = self._db.execute("SELECT label, path, time FROM checkpoints WHERE run = ? ORDER BY label", (run_id,))
        return [{"label": label, "path": path, "time": when} for label, path, when in rows]
