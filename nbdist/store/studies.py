"""A study's rows in the run store: the study itself (its searcher's state), the jobs
(coordinators) that share it, its trials, the events on each trial's way (intermediate
values, rungs, PBT's exploits), a digest that tells a poller when to read them again,
and the notes written on the study dashboard.

Every change to a study's searcher and trials is made inside `coordinate(study)`, which
holds the study's lock, so that two coordinators never hand out the same trial.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from nbdist.store.connection import StoreConnection
from nbdist.store.dialects import StoreError
from nbdist.store.rows import (
    STALE_SECONDS,
    TRIAL_STATES,
    TrialRow,
    from_json,
    json_text,
    process_alive,
    without_passwords,
)

__all__ = ["StudyTables"]

_Store = TypeVar("_Store", bound="StudyTables")


class StudyTables(StoreConnection):
    """The study tables of a run store (nbdist.store.RunStore has them)."""

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
                        json_text(space),
                        json_text(without_passwords(options)),
                        objective,
                        direction,
                        now,
                        now,
                        socket.gethostname(),
                        os.getpid(),
                        json_text(searcher_state),
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
    def coordinate(self: _Store, study_id: str) -> Iterator[_Store]:
        """A transaction holding the study's lock: what a coordinator reads and writes in it
        (the searcher's state, trial rows) no other coordinator changes meanwhile."""
        with self._write() as db:
            db.lock_study(study_id)
            yield self

    def save_searcher_state(self, study_id: str, state: Any) -> None:
        with self._write() as conn:
            conn.execute(
                "UPDATE studies SET searcher_state = ?, heartbeat = ? WHERE id = ?",
                (json_text(state), time.time(), study_id),
            )

    def end_study(self, study_id: str, status: str) -> None:
        with self._write() as conn:
            conn.execute("UPDATE studies SET status = ?, ended = ? WHERE id = ?", (status, time.time(), study_id))

    def study(self, study_id: str) -> dict[str, Any]:
        cursor = self._db.execute("SELECT * FROM studies WHERE id = ?", (study_id,))
        row = cursor.fetchone()
        if row is None:
            # The newest first, a few: a name mistyped is usually one of those.
            known = [r[0] for r in self._db.execute("SELECT id FROM studies ORDER BY started DESC LIMIT 6")]
            listed = ", ".join(known[:5]) + (", ..." if len(known) > 5 else "") if known else "none yet"
            raise StoreError(f"no study {study_id!r} in the store {self.label} (its studies: {listed})")
        study = dict(zip([d[0] for d in cursor.description], row, strict=True))
        for key in ("space", "options", "searcher_state"):
            study[key] = from_json(study[key], None)
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
            if not (host == here and pid and not process_alive(pid)) and (beat or 0) >= now - stale_after
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
                    json_text(params),
                    state,
                    fom,
                    fom_std,
                    json_text(folds or []),
                    generation,
                    group,
                    error,
                    started,
                    ended,
                    owner,
                    int(goal_reached),
                    epochs,
                    None if values is None else json_text(values),
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
                s,
                n,
                json.loads(p),
                st,
                f,
                fs,
                from_json(fo, []),
                g,
                gr,
                e,
                t0,
                t1,
                o,
                bool(goal),
                ep,
                from_json(v, None),
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
        rows = [(study_id, int(n), kind, int(epoch), time.time(), json_text(data)) for n, kind, epoch, data in events]
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
        return [{"number": n, "kind": k, "epoch": e, "time": t, "data": from_json(d, {})} for n, k, e, t, d in rows]
