"""The run store: every run, its metric records, its checkpoints and, for studies, their
trials, in one SQLite file (WAL mode) or one PostgreSQL database (nbdist.store.dialects).

Exactly one writer feeds a run's records: the notebook's collector for a notebook job,
the run leader's recorder thread for a batch run (topology ranks never touch the store).
Readers (the dashboard, `job.history` of a past run) poll it while it is written: WAL,
or PostgreSQL's snapshots, let them read without blocking the writer.

A study may be shared by several jobs (coordinators): each joins it as a row of
`study_jobs` with a heartbeat, and every change to the study's searcher and trials is
made inside `coordinate(study)`, which holds the study's lock, so that two coordinators
never hand out the same trial.

A run whose writer vanished (the job was killed) stays "running" in the file; the next
reader that opens the store marks it "killed" (same host: its writer process is gone;
any host: no heartbeat for STALE_SECONDS).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbdist.store.dialects import Dialect, StoreError, mask_url, open_dialect
from nbdist.store.schema import prepare_schema

__all__ = ["RunStore", "RunRow", "TrialRow", "STALE_SECONDS", "RUN_STATES", "TRIAL_STATES"]

STALE_SECONDS = 60.0
RUN_STATES = ("running", "completed", "stopped", "failed", "killed")
TRIAL_STATES = ("running", "paused", "complete", "pruned", "stopped", "failed")
_RECORD_COLUMNS = ("run", "rank", "seq", "trial", "role", "kind", "step", "epoch", "time")


@dataclass(frozen=True, slots=True)
class RunRow:
    id: str
    kind: str
    status: str
    reason: str | None
    run_dir: str | None
    options: dict[str, Any]
    layout: dict[str, Any]
    final: dict[str, Any]
    study: str | None
    trial: int | None
    started: float | None
    ended: float | None
    heartbeat: float | None


@dataclass(frozen=True, slots=True)
class TrialRow:
    study: str
    number: int
    params: dict[str, Any]
    state: str  # running | paused | complete | pruned | stopped | failed
    fom: float | None
    fom_std: float | None
    folds: list[float]
    generation: int | None
    group: int | None
    error: str | None
    started: float | None
    ended: float | None
    owner: str | None = None  # the job (coordinator) that trains or trained it
    goal_reached: bool = False  # it reached the study's --goal: every job of the study stops
    epochs: int | None = None  # the epochs it trained (fewer than the study's when stopped early)
    values: list[float] | None = None  # a multi-objective study's values, one per objective


def _json(value: Any) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"), default=str)


def _no_passwords(value: Any) -> Any:
    """Options as stored: any URL in them (--store postgresql://...) without its password."""
    if isinstance(value, dict):
        return {k: _no_passwords(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_passwords(v) for v in value]
    return mask_url(value) if isinstance(value, str) else value


def _loads(text: str | None, empty: Any) -> Any:
    return empty if text is None else json.loads(text)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


class RunStore:
    """One connection to a store (a file path, sqlite:///PATH or postgresql://...); use
    one RunStore per thread."""

    def __init__(self, path: str | Path, *, create: bool = True):
        self._db: Dialect = open_dialect(path, create=create)
        self.label = self._db.label  # the store as shown in messages (no password)
        try:
            prepare_schema(self._db, create=create)
        except self._db.errors as exc:
            self._db.close()
            raise StoreError(f"{self.label} is not an nbdist run store ({exc})") from None
        except StoreError:
            self._db.close()
            raise

    def close(self) -> None:
        self._db.close()

    def lock_wait(self, seconds: float) -> None:
        """How long this connection's writes wait for another writer's lock (SQLite)."""
        self._db.lock_wait(seconds)

    def __enter__(self) -> RunStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _write(self) -> Iterator[Dialect]:
        with self._db.transaction():
            yield self._db

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
                    _json(_no_passwords(options)),
                    _json(layout),
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
                (status, reason, _json(final), time.time(), time.time(), run_id),
            )

    def add_records(self, records: Iterable[dict[str, Any]]) -> int:
        """Insert metric records (Record.to_dict() form); ones already stored are skipped.
        Returns how many were new."""
        rows = [tuple(r.get(c) for c in _RECORD_COLUMNS) + (_json(r["values"]),) for r in records]
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
            if (host == here and pid and not _process_alive(pid)) or (beat or 0) < now - stale_after
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
            _loads(options, {}),
            _loads(layout, {}),
            _loads(final, {}),
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

    # -- studies and trials (the coordinators write them; the dashboard reads them) ----
    def create_study(
        self,
        study_id: str,
        *,
        searcher: str,
        space: Any,
        options: dict[str, Any],
        objective: str,
        direction: str,
        searcher_state: Any = None,
    ) -> bool:
        """A new study; False (and nothing written) when the store has one of that name.
        The searcher's state goes in the same row: a job that joins the study as soon as
        it appears (--resume-study) finds it complete."""
        now = time.time()
        with self._write() as conn:
            return (
                conn.execute(
                    """INSERT INTO studies (id, status, searcher, space, options, objective, direction, started,
                                        heartbeat, host, pid, searcher_state)
                   VALUES (?, 'running', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING""",
                    (
                        study_id,
                        searcher,
                        _json(space),
                        _json(_no_passwords(options)),
                        objective,
                        direction,
                        now,
                        now,
                        socket.gethostname(),
                        os.getpid(),
                        _json(searcher_state),
                    ),
                ).rowcount
                == 1
            )

    def begin_study(self, study_id: str, **settings: Any) -> None:
        """A new study, or one of that name running again."""
        if not self.create_study(study_id, **settings):
            self.reopen_study(study_id)

    def reopen_study(self, study_id: str) -> None:
        """A study continued (--resume-study): running again."""
        with self._write() as conn:
            conn.execute(
                "UPDATE studies SET status = 'running', ended = NULL, heartbeat = ?, host = ?, pid = ? WHERE id = ?",
                (time.time(), socket.gethostname(), os.getpid(), study_id),
            )

    @contextmanager
    def coordinate(self, study_id: str) -> Iterator[RunStore]:
        """A transaction holding the study's lock: what a coordinator reads and writes in it
        (the searcher's state, trial rows) no other coordinator changes meanwhile."""
        with self._write() as db:
            db.lock_study(study_id)
            yield self

    def save_searcher_state(self, study_id: str, state: Any) -> None:
        with self._write() as conn:
            conn.execute(
                "UPDATE studies SET searcher_state = ?, heartbeat = ? WHERE id = ?",
                (_json(state), time.time(), study_id),
            )

    def end_study(self, study_id: str, status: str) -> None:
        with self._write() as conn:
            conn.execute("UPDATE studies SET status = ?, ended = ? WHERE id = ?", (status, time.time(), study_id))

    def study(self, study_id: str) -> dict[str, Any]:
        cursor = self._db.execute("SELECT * FROM studies WHERE id = ?", (study_id,))
        row = cursor.fetchone()
        if row is None:
            raise StoreError(f"no study {study_id!r} in the store {self.label}")
        study = dict(zip([d[0] for d in cursor.description], row, strict=True))
        for key in ("space", "options", "searcher_state"):
            study[key] = _loads(study[key], None)
        return study

    def studies(self) -> list[dict[str, Any]]:
        ids = [r[0] for r in self._db.execute("SELECT id FROM studies ORDER BY started DESC")]
        return [self.study(i) for i in ids]

    # -- the jobs (coordinators) of a study ----------------------------------------------
    def join_study(self, study_id: str, job: str) -> None:
        now = time.time()
        with self._write() as conn:
            conn.execute(
                "INSERT INTO study_jobs (study, job, host, pid, started, heartbeat) VALUES (?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (study, job) DO UPDATE SET heartbeat = excluded.heartbeat, ended = NULL",
                (study_id, job, socket.gethostname(), os.getpid(), now, now),
            )

    def study_heartbeat(self, study_id: str, job: str) -> None:
        with self._write() as conn:
            conn.execute(
                "UPDATE study_jobs SET heartbeat = ? WHERE study = ? AND job = ?", (time.time(), study_id, job)
            )

    def leave_study(self, study_id: str, job: str) -> None:
        with self._write() as conn:
            conn.execute("UPDATE study_jobs SET ended = ? WHERE study = ? AND job = ?", (time.time(), study_id, job))

    def live_jobs(self, study_id: str, stale_after: float = STALE_SECONDS) -> set[str]:
        """The study's jobs that have not ended and whose coordinator is alive (same host:
        its process is there; any host: its heartbeat is recent)."""
        here, now = socket.gethostname(), time.time()
        rows = self._db.execute(
            "SELECT job, host, pid, heartbeat FROM study_jobs WHERE study = ? AND ended IS NULL", (study_id,)
        )
        return {
            job
            for job, host, pid, beat in rows
            if not (host == here and pid and not _process_alive(pid)) and (beat or 0) >= now - stale_after
        }

    def claim_trial(self, study_id: str, number: int, job: str, previous: str | None) -> bool:
        """Take over a running trial from `previous` (a job that is gone); False when
        another job took it first."""
        with self._write() as conn:
            return (
                conn.execute(
                    "UPDATE trials SET owner = ? WHERE study = ? AND number = ? AND state = 'running' "
                    "AND COALESCE(owner, '') = ?",
                    (job, study_id, int(number), previous or ""),
                ).rowcount
                == 1
            )

    def record_trial(
        self,
        study_id: str,
        number: int,
        *,
        params: dict[str, Any],
        state: str,
        fom: float | None = None,
        fom_std: float | None = None,
        folds: list[float] | None = None,
        generation: int | None = None,
        group: int | None = None,
        error: str | None = None,
        started: float | None = None,
        ended: float | None = None,
        owner: str | None = None,
        goal_reached: bool = False,
        epochs: int | None = None,
        values: list[float] | None = None,
    ) -> None:
        """Insert a trial or replace what is known of it (a running trial that completed)."""
        with self._write() as conn:
            conn.execute(
                """INSERT INTO trials (study, number, params, state, fom, fom_std, folds, generation, grp,
                                       error, started, ended, owner, goal_reached, epochs, obj_values)
                   VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
                   ON CONFLICT (study, number) DO UPDATE SET params = excluded.params,
                       state = excluded.state, fom = excluded.fom, fom_std = excluded.fom_std,
                       folds = excluded.folds, generation = excluded.generation, grp = excluded.grp,
                       error = excluded.error, started = COALESCE(trials.started, excluded.started),
                       ended = excluded.ended, owner = COALESCE(excluded.owner, trials.owner),
                       goal_reached = excluded.goal_reached,
                       epochs = COALESCE(excluded.epochs, trials.epochs),
                       obj_values = COALESCE(excluded.obj_values, trials.obj_values)""",
                (
                    study_id,
                    int(number),
                    _json(params),
                    state,
                    fom,
                    fom_std,
                    _json(folds or []),
                    generation,
                    group,
                    error,
                    started,
                    ended,
                    owner,
                    int(goal_reached),
                    epochs,
                    None if values is None else _json(values),
                ),
            )

    def trials(self, study_id: str) -> list[TrialRow]:
        rows = self._db.execute(
            "SELECT study, number, params, state, fom, fom_std, folds, generation, grp, error, started, ended, owner, "
            "goal_reached, epochs, obj_values FROM trials WHERE study = ? ORDER BY number",
            (study_id,),
        )
        return [
            TrialRow(
                s, n, json.loads(p), st, f, fs, _loads(fo, []), g, gr, e, t0, t1, o, bool(goal), ep, _loads(v, None)
            )
            for s, n, p, st, f, fs, fo, g, gr, e, t0, t1, o, goal, ep, v in rows
        ]

    def study_digest(self, study_id: str) -> tuple:
        """A summary of the study's trial rows, of its trial events and its status, which
        changes when a trial is added or changes state, value, epochs, group, end or the
        length of its parameters' text (PBT, which changes a running trial's parameters,
        writes an exploit event with them), and when an event is added or written again.
        A reader that polls (the dashboard) reads the rows themselves only when it changed."""
        states = " ".join(f"WHEN '{s}' THEN {i}" for i, s in enumerate(TRIAL_STATES, start=1))
        trials = self._db.execute(
            f"SELECT COUNT(*), SUM((CASE state {states} ELSE 0 END) * (number + 1)), SUM(fom), SUM(epochs), "
            "SUM(grp * (number + 1)), SUM(LENGTH(params)), MAX(ended) FROM trials WHERE study = ?",
            (study_id,),
        ).fetchone()
        events = self._db.execute(
            "SELECT COUNT(*), MAX(time) FROM trial_events WHERE study = ?", (study_id,)
        ).fetchone()
        status = self._db.execute("SELECT status FROM studies WHERE id = ?", (study_id,)).fetchone()
        return tuple(trials), tuple(events), status[0] if status else None

    # -- notes on a study and its trials (the study dashboard writes them) -----------------
    def save_note(self, study_id: str, text: str, *, trial: int | None = None) -> None:
        """Keep `text` as the study's note (or trial `trial`'s), replacing the one before;
        an empty text removes it."""
        number = -1 if trial is None else int(trial)
        with self._write() as conn:
            if text.strip():
                conn.execute(
                    "INSERT INTO notes (study, number, text, time) VALUES (?, ?, ?, ?) "
                    "ON CONFLICT (study, number) DO UPDATE SET text = excluded.text, time = excluded.time",
                    (study_id, number, text, time.time()),
                )
            else:
                conn.execute("DELETE FROM notes WHERE study = ? AND number = ?", (study_id, number))

    def notes(self, study_id: str) -> dict[int | None, str]:
        """The study's notes: None -> the study's own, a trial number -> that trial's."""
        rows = self._db.execute("SELECT number, text FROM notes WHERE study = ? ORDER BY number", (study_id,))
        return {(None if n < 0 else n): text for n, text in rows}

    # -- what happened to each trial on the way (schedulers, PBT) -------------------------
    def record_trial_events(self, study_id: str, events: Iterable[tuple[int, str, int, dict[str, Any]]]) -> None:
        """(trial number, kind, epoch, data) rows: an intermediate 'value', 'pruned',
        'paused', 'promoted', 'exploit' (PBT: the state it took and its new parameters),
        'params' (the parameters it trains with from that epoch on). One row per (trial,
        kind, epoch): written again, it is replaced (a resumed study repeats a segment)."""
        rows = [(study_id, int(n), kind, int(epoch), time.time(), _json(data)) for n, kind, epoch, data in events]
        if not rows:
            return
        with self._write() as conn:
            conn.executemany(
                "INSERT INTO trial_events (study, number, kind, epoch, time, data) VALUES (?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (study, number, kind, epoch) DO UPDATE SET time = excluded.time, data = excluded.data",
                rows,
            )

    def trial_events(
        self, study_id: str, *, number: int | None = None, kind: str | None = None, after: float | None = None
    ) -> list[dict[str, Any]]:
        """The study's trial events (all, or one trial's, or one kind's, or those written
        after the time `after`: a reader polling for new ones), by trial, epoch and kind."""
        sql = "SELECT number, kind, epoch, time, data FROM trial_events WHERE study = ?"
        args: list[Any] = [study_id]
        if after is not None:
            sql, args = sql + " AND time > ?", [*args, float(after)]
        if number is not None:
            sql, args = sql + " AND number = ?", [*args, int(number)]
        if kind is not None:
            sql, args = sql + " AND kind = ?", [*args, kind]
        rows = self._db.execute(sql + " ORDER BY number, epoch, kind", tuple(args))
        return [{"number": n, "kind": k, "epoch": e, "time": t, "data": _loads(d, {})} for n, k, e, t, d in rows]
