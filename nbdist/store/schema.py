"""The run store's tables, and the version check that guards them.

The schema version lives in SQLite's `user_version`. A store written by a newer nbdist
may hold tables or meanings this one does not know: it is refused with a clear error
rather than misread. An older store is upgraded in place by the migrations below, each
a list of statements, applied in one transaction.
"""

from __future__ import annotations

import sqlite3

from nbdist.errors import UserError

__all__ = ["SCHEMA_VERSION", "StoreError", "prepare_schema"]

SCHEMA_VERSION = 1


class StoreError(UserError):
    """The run store cannot be opened or used as asked; the message says why."""


# Version 0 -> 1: the first schema. `records` keeps its implicit rowid, so a reader can
# ask for "everything after the last row I saw" cheaply; (run, rank, seq) names a record
# once, whoever writes it.
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
            started REAL,
            ended REAL,
            heartbeat REAL,
            host TEXT,
            pid INTEGER
        )""",
        """CREATE TABLE records (
            run TEXT NOT NULL,
            rank INTEGER NOT NULL,
            seq INTEGER NOT NULL,
            trial INTEGER,
            role TEXT,
            kind TEXT NOT NULL,
            step INTEGER,
            epoch INTEGER,
            time REAL NOT NULL,
            "values" TEXT NOT NULL,
            UNIQUE (run, rank, seq)
        )""",
        # Index entries sort by (run, rowid): "this run, after row N" is one range scan.
        "CREATE INDEX records_by_run ON records (run)",
        """CREATE TABLE checkpoints (
            run TEXT NOT NULL,
            label TEXT NOT NULL,
            path TEXT NOT NULL,
            time REAL,
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
            started REAL,
            ended REAL,
            heartbeat REAL,
            host TEXT,
            pid INTEGER
        )""",
        """CREATE TABLE trials (
            study TEXT NOT NULL,
            number INTEGER NOT NULL,
            params TEXT NOT NULL,
            state TEXT NOT NULL,
            fom REAL,
            fom_std REAL,
            folds TEXT,
            generation INTEGER,
            grp INTEGER,
            error TEXT,
            started REAL,
            ended REAL,
            PRIMARY KEY (study, number)
        )""",
    ],
]
assert len(_MIGRATIONS) == SCHEMA_VERSION


def prepare_schema(conn: sqlite3.Connection, path: str) -> None:
    """Create or upgrade the tables; refuse a store from a newer nbdist."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"the run store {path} was written by a newer nbdist (schema {version}; this nbdist "
            f"reads up to {SCHEMA_VERSION}): upgrade nbdist, or give another --store"
        )
    if version == SCHEMA_VERSION:
        return
    # The connection is in autocommit mode (isolation_level=None); BEGIN IMMEDIATE takes
    # the write lock first, so two processes opening a new store at once do not both migrate.
    conn.execute("BEGIN IMMEDIATE")
    try:
        current = conn.execute("PRAGMA user_version").fetchone()[0]
        for statements in _MIGRATIONS[current:]:
            for statement in statements:
                conn.execute(statement)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")
