"""The run store's tables, and the version check that guards them.

The schema version lives in the table `schema_version` (stores of version 1, SQLite only,
kept it in SQLite's `user_version`, which is still kept in step). A store written by a
newer nbdist may hold tables or meanings this one does not know: it is refused with a
clear error rather than misread. An older store is upgraded in place by the migrations
below, each a list of statements, applied in one transaction that one process at a time
may run. The statements are written for both databases; `{real}`, `{big}`, `{record_id}`
and `{records_key}` are filled in by the dialect.
"""

from __future__ import annotations

from nbdist.store.dialects import Dialect, StoreError

__all__ = ["SCHEMA_VERSION", "StoreError", "prepare_schema"]

SCHEMA_VERSION = 5


# Version 0 -> 1: the first schema. `records` rows are numbered as stored (SQLite's
# implicit rowid, PostgreSQL's id), so a reader can ask for "everything after the last
# row I saw" cheaply; (run, rank, seq) names a record once, whoever writes it.
_MIGRATIONS: list[list[str]] = [
    [
        """CREATE TABLE runs (
            id TEXT PRIMARY KEY,
            kind TEXT NOT NULL DEFAULT 'train',
            status TEXT NOT NULL,
            reason TEXT,
            run_dir TEXT,
            options TEXT,
            layout TEXT,
            final TEXT,
            study TEXT,
            trial INTEGER,
            started {real},
            ended {real},
            heartbeat {real},
            host TEXT,
            pid {big}
        )""",
        """CREATE TABLE records (
            {record_id}
            run TEXT NOT NULL,
            rank INTEGER NOT NULL,
            seq {big} NOT NULL,
            trial INTEGER,
            role TEXT,
            kind TEXT NOT NULL,
            step {big},
            epoch INTEGER,
            time {real} NOT NULL,
            "values" TEXT NOT NULL,
            UNIQUE (run, rank, seq)
        )""",
        # Index entries sort by (run, row number): "this run, after row N" is one range scan.
        "CREATE INDEX records_by_run ON records ({records_key})",
        """CREATE TABLE checkpoints (
            run TEXT NOT NULL,
            label TEXT NOT NULL,
            path TEXT NOT NULL,
            time {real},
            PRIMARY KEY (run, label)
        )""",
        """CREATE TABLE studies (
            id TEXT PRIMARY KEY,
            status TEXT NOT NULL,
            searcher TEXT,
            space TEXT,
            options TEXT,
            objective TEXT,
            direction TEXT,
            searcher_state TEXT,
            started {real},
            ended {real},
            heartbeat {real},
            host TEXT,
            pid {big}
        )""",
        """CREATE TABLE trials (
            study TEXT NOT NULL,
            number INTEGER NOT NULL,
            params TEXT NOT NULL,
            state TEXT NOT NULL,
            fom {real},
            fom_std {real},
            folds TEXT,
            generation INTEGER,
            grp INTEGER,
            error TEXT,
            started {real},
            ended {real},
            PRIMARY KEY (study, number)
        )""",
    ],
    # Version 1 -> 2: a study shared by several jobs. Each coordinator is a row of
    # `study_jobs` (its heartbeat says it is alive); a trial row names the job that
    # trains it, so a trial of a job that died is taken over, once, by another.
    [
        "CREATE TABLE schema_version (version INTEGER NOT NULL)",
        "ALTER TABLE trials ADD COLUMN owner TEXT",
        """CREATE TABLE study_jobs (
            study TEXT NOT NULL,
            job TEXT NOT NULL,
            host TEXT,
            pid {big},
            started {real},
            heartbeat {real},
            ended {real},
            PRIMARY KEY (study, job)
        )""",
    ],
    # Version 2 -> 3: a trial that reached the study's --goal says so, so that every job
    # of a shared study stops, whichever trained it.
    [
        "ALTER TABLE trials ADD COLUMN goal_reached INTEGER NOT NULL DEFAULT 0",
    ],
    # Version 3 -> 4: schedulers and multi-objective studies. A trial says how many epochs
    # it trained (a trial stopped at a rung, pruned, or paused between PBT intervals) and
    # its values for each objective; `trial_events` keeps what happened to each trial on
    # the way, one row per (trial, kind, epoch), written again with the same key on a
    # resume: its intermediate values, where it was pruned, paused or promoted, and a PBT
    # member's exploits (whose state it took) and hyper-parameter schedule.
    [
        "ALTER TABLE trials ADD COLUMN epochs INTEGER",
        "ALTER TABLE trials ADD COLUMN obj_values TEXT",
        """CREATE TABLE trial_events (
            study TEXT NOT NULL,
            number INTEGER NOT NULL,
            kind TEXT NOT NULL,
            epoch INTEGER NOT NULL,
            time {real},
            data TEXT,
            PRIMARY KEY (study, number, kind, epoch)
        )""",
    ],
    # Version 4 -> 5: notes, written from the study dashboard: one per study (number -1)
    # and per trial, kept with the study so that every reader of the store sees them.
    [
        """CREATE TABLE notes (
            study TEXT NOT NULL,
            number INTEGER NOT NULL,
            text TEXT NOT NULL,
            time {real},
            PRIMARY KEY (study, number)
        )""",
    ],
]
assert len(_MIGRATIONS) == SCHEMA_VERSION


def schema_version(db: Dialect) -> int:
    # SQLite keeps the version in user_version too: whichever says more is the truth.
    legacy = db.legacy_version()
    if db.has_table("schema_version"):
        row = db.execute("SELECT version FROM schema_version").fetchone()
        return max(legacy, 0 if row is None else int(row[0]))
    return legacy


def prepare_schema(db: Dialect, *, create: bool = True) -> None:
    """Create or upgrade the tables; refuse a store from a newer nbdist."""
    version = schema_version(db)
    _check_not_newer(db, version)
    if version == SCHEMA_VERSION:
        return
    if version == 0 and not create:
        raise StoreError(f"no run store at {db.label} (it has no nbdist tables yet)")
    with db.transaction():
        db.lock_schema()
        current = schema_version(db)  # another process may have migrated meanwhile
        _check_not_newer(db, current)
        for statements in _MIGRATIONS[current:]:
            for statement in statements:
                db.execute(statement.format(**db.types))
        if current < SCHEMA_VERSION:
            db.execute("DELETE FROM schema_version")
            db.execute("INSERT INTO schema_version (version) VALUES (?)", (SCHEMA_VERSION,))
            db.after_version(SCHEMA_VERSION)


def _check_not_newer(db: Dialect, version: int) -> None:
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"the run store {db.label} was written by a newer nbdist (schema {version}; this nbdist "
            f"reads up to {SCHEMA_VERSION}): upgrade nbdist, or give another --store"
        )
