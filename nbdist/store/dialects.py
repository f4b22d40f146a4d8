"""The two databases a run store can live in, behind one small interface.

    --store runs/nbdist.db                          SQLite file (the default: one machine)
    --store sqlite:///runs/nbdist.db                the same, as a URL
    --store postgresql://me@dbhost:5432/nbdist      PostgreSQL (several jobs, NFS/Lustre)

The store's SQL is written once, with `?` parameters and the few spellings both
databases accept (`ON CONFLICT ... DO NOTHING/UPDATE`); a dialect turns it into what its
driver takes, and adds what only it knows: how a write transaction starts, how a study
is locked while one coordinator claims trials, where the schema version is kept, the
column types of the migrations. Values always travel as parameters, never in the SQL.

PostgreSQL credentials come from the URL or from libpq's usual places (PGPASSWORD,
~/.pgpass, PGUSER, ...): psycopg hands the URL to libpq as it is. A password is never
shown: every message names the store by `mask_url(url)`.

A PostgreSQL connection that is lost (the server restarted, the backend was terminated,
the network dropped) is made again, trying for RECONNECT_SECONDS. The statement that
found it lost runs again only when nothing of a write had been sent (a read outside a
transaction, or a transaction's BEGIN); a write transaction cut in the middle or at its
COMMIT was rolled back by the server, or may have been committed: it is reported as one
StoreError, never replayed, and the next call uses the new connection.
"""

from __future__ import annotations

import os
import sqlite3
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from nbdist.durable import private_fd
from nbdist.errors import UserError

__all__ = [
    "Dialect",
    "SQLiteDialect",
    "PostgresDialect",
    "StoreError",
    "open_dialect",
    "is_url",
    "mask_url",
    "store_label",
    "url_password",
    "missing_directory",
    "check_scheme",
    "POSTGRES_SCHEMES",
    "SCHEMES",
    "RECONNECT_SECONDS",
]

POSTGRES_SCHEMES = ("postgresql", "postgres")
SCHEMES = ("sqlite", *POSTGRES_SCHEMES)
_FORMS = "a SQLite file path, sqlite:///PATH, or postgresql://USER@HOST:PORT/DATABASE"
# Any fixed number: the advisory lock that lets one process at a time migrate a database.
_MIGRATION_LOCK = 0x6E62_6469
RECONNECT_SECONDS = 60.0  # how long a lost PostgreSQL connection is tried again
CONNECT_SECONDS = 15  # libpq's connect_timeout, per attempt
SQLITE_TIMEOUT_SECONDS = 30.0  # how long a SQLite connection waits for another writer's lock


class StoreError(UserError):
    """The run store cannot be opened or used as asked; the message says why."""


def is_url(store: str | Path) -> bool:
    return isinstance(store, str) and "://" in store


def mask_url(url: str, mask: str | None = "***") -> str:
    """The URL with its password (in the authority or a password= parameter) as `mask`;
    `mask` None: without it (what libpq then looks up in PGPASSWORD or ~/.pgpass)."""
    if not is_url(url):
        return url
    try:
        parts = urlsplit(url)
    except ValueError:
        return url.split("://", 1)[0] + "://***"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        if ":" in userinfo:
            user = userinfo.split(":", 1)[0]
            netloc = f"{user}:{mask}@{host}" if mask is not None else f"{user}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode(
            [(k, mask) if k.lower() == "password" else (k, v) for k, v in pairs if mask or k.lower() != "password"],
            safe="*",
        )
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def store_label(store: str | Path) -> str:
    """How a store is named to people: a path as given, a URL without its password."""
    return mask_url(store) if isinstance(store, str) else str(store)


class Dialect(ABC):
    """One open connection to a store's database (one per thread), in autocommit mode:
    reads see what is committed; writes go in `transaction()`."""

    label: str  # the store as shown to people (never with a password)
    rowid: str  # the column that numbers `records` rows in the order they were stored
    errors: tuple[type[BaseException], ...]  # the driver's errors
    types: dict[str, str]  # the migrations' {placeholders}: column types, the records id
    begin = "BEGIN"  # the statement that opens a write transaction
    _conn: Any  # the driver's connection
    _depth = 0

    @abstractmethod
    def execute(self, sql: str, args: Sequence[Any] = ()) -> Any:
        """Run one statement with `?` parameters; returns a cursor."""

    @abstractmethod
    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> int:
        """Run one statement per row; returns how many rows it changed."""

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """A write transaction; nested ones join the outer one."""
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self._begin()
        self._depth = 1
        try:
            yield
        except BaseException:
            self._depth = 0
            self._rollback()
            raise
        self._depth = 0
        self._commit()

    def _begin(self) -> None:
        self._conn.execute(self.begin)

    def _commit(self) -> None:
        self._conn.execute("COMMIT")

    def _rollback(self) -> None:
        self._conn.execute("ROLLBACK")

    @abstractmethod
    def lock_study(self, study_id: str) -> None:
        """Inside a transaction: no other coordinator of this study writes until it ends."""

    @abstractmethod
    def lock_schema(self) -> None:
        """Inside a transaction: no other process migrates the schema until it ends."""

    @abstractmethod
    def has_table(self, name: str) -> bool: ...

    def legacy_version(self) -> int:
        """The schema version of a store from before the version table (0: a new store)."""
        return 0

    def after_version(self, version: int) -> None:  # noqa: B027
        """Anything else that should know the version (SQLite's user_version). By default
        the version table is all."""

    def lock_wait(self, seconds: float) -> None:  # noqa: B027 - optional, a no-op where the server decides
        """How long a write waits for another writer's lock before it fails (SQLite's busy
        timeout; a PostgreSQL server queues row locks by itself)."""

    def close(self) -> None:
        self._conn.close()


class SQLiteDialect(Dialect):
    rowid = "rowid"
    types = {"real": "REAL", "big": "INTEGER", "record_id": "", "records_key": "run"}
    # BEGIN IMMEDIATE takes the database's write lock at once: a transaction never
    # starts reading and then finds another writer in its way.
    begin = "BEGIN IMMEDIATE"

    def __init__(self, path: Path, *, create: bool):
        self.path = Path(path)
        self.label = str(path)
        self.errors = (sqlite3.Error,)
        if not create and not self.path.exists():
            raise StoreError(f"no run store at {self.label}")
        missing = missing_directory(self.path)  # a typo's directory is not made: the store would be lost
        if missing:
            raise StoreError(missing)
        try:
            if create:
                # The owner's alone (0600, whatever the umask): SQLite gives its -wal and
                # -shm files the mode of the database file.
                os.close(private_fd(self.path, os.O_RDWR | os.O_CREAT))
            self._conn = sqlite3.connect(
                str(self.path), timeout=SQLITE_TIMEOUT_SECONDS, isolation_level=None, check_same_thread=False
            )
        except (OSError, sqlite3.Error) as exc:
            raise StoreError(f"cannot open the run store {self.label}: {exc}") from None
        try:
            self._wal_mode()
            self._conn.execute("PRAGMA synchronous=NORMAL")
        except sqlite3.DatabaseError as exc:
            self._conn.close()
            raise StoreError(f"{self.label} is not an nbdist run store ({exc})") from None

    def _wal_mode(self) -> None:
        """Switch to write-ahead logging. The switch takes the file's exclusive lock, and
        SQLite answers "database is locked" at once, without its busy handler, while
        another process opens the same new store (or converts it) at that moment: two
        coordinators of one study started together. So it is retried until the connect
        timeout, as any other locked write waits that long."""
        deadline = time.monotonic() + SQLITE_TIMEOUT_SECONDS
        while True:
            try:
                self._conn.execute("PRAGMA journal_mode=WAL")
                return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Any:
        return self._conn.execute(sql, tuple(args))

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> int:
        return self._conn.executemany(sql, rows).rowcount

    def lock_study(self, study_id: str) -> None:
        """BEGIN IMMEDIATE already holds the whole file's write lock."""

    def lock_schema(self) -> None:
        """BEGIN IMMEDIATE already holds the whole file's write lock."""

    def has_table(self, name: str) -> bool:
        return (
            self._conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)).fetchone()
            is not None
        )

    def lock_wait(self, seconds: float) -> None:
        self._conn.execute(f"PRAGMA busy_timeout = {int(seconds * 1000)}")

    def legacy_version(self) -> int:
        # Stores of schema 1 kept their version in SQLite's user_version only.
        return self._conn.execute("PRAGMA user_version").fetchone()[0]

    def after_version(self, version: int) -> None:  # noqa: B027 - a hook: most dialects need nothing
        # Kept in step, so that an nbdist from before the version table refuses this store.
        self._conn.execute(f"PRAGMA user_version = {int(version)}")


class PostgresDialect(Dialect):
    rowid = "id"
    types = {
        "real": "DOUBLE PRECISION",
        "big": "BIGINT",
        "record_id": "id BIGSERIAL PRIMARY KEY,",
        "records_key": "run, id",
    }

    def __init__(self, url: str, *, create: bool):
        self.label = mask_url(url)
        try:
            import psycopg
        except ImportError:
            raise StoreError(
                f"--store {self.label} needs psycopg: pip install 'nbdist[postgresql]' (psycopg[binary]==3.3.9)"
            ) from None
        self._psycopg, self._url = psycopg, url
        self.errors = (psycopg.Error,)
        try:
            self._conn = self._connect()
        except psycopg.Error as exc:
            raise StoreError(f"cannot connect to the run store {self.label}: {_first_line(exc, url)}") from None
        self._sql: dict[str, str] = {}

    def _connect(self) -> Any:
        return self._psycopg.connect(self._url, autocommit=True, connect_timeout=CONNECT_SECONDS)

    def _run(self, statement: Callable[[], Any], *, again: bool) -> Any:
        """`statement()`; when it finds the connection lost: connect again, then run it
        once more (`again`: nothing of a write was sent) or report the write as lost."""
        try:
            return statement()
        except (self._psycopg.OperationalError, self._psycopg.InterfaceError) as exc:
            if not self._lost(exc):
                raise  # an error of the statement, on a connection that is still there
            lost = _first_line(exc, self._url)
        self._reconnect(lost)
        if not again:
            raise StoreError(
                f"the connection to the run store {self.label} was lost during a write ({lost}): "
                f"the write was not repeated (it may not have been made); connected again"
            )
        return statement()

    def _lost(self, exc: Exception) -> bool:
        """Whether `exc` says the connection is gone, not that the statement failed:
        psycopg closed it, or the error has no SQLSTATE, the server's code for its own
        errors. A connection's socket found closed while psycopg waited on it (the server
        ended the session as a statement went out) is such an error, on a connection that
        psycopg still counts as open."""
        return self._conn.closed or getattr(exc, "sqlstate", None) is None

    def _reconnect(self, lost: str) -> None:
        with suppress(self._psycopg.Error, OSError):
            self._conn.close()  # what is left of it: its socket, if still open
        deadline, pause = time.monotonic() + RECONNECT_SECONDS, 0.2
        while True:
            try:
                self._conn = self._connect()
                return
            except self._psycopg.Error as exc:
                if time.monotonic() + pause > deadline:
                    raise StoreError(
                        f"the connection to the run store {self.label} was lost ({lost}) and could "
                        f"not be made again in {RECONNECT_SECONDS:.0f} s: "
                        f"{_first_line(exc, self._url)}"
                    ) from None
            time.sleep(pause)
            pause = min(2 * pause, 5.0)

    def _begin(self) -> None:
        self._run(lambda: self._conn.execute(self.begin), again=True)

    def _commit(self) -> None:
        self._run(lambda: self._conn.execute("COMMIT"), again=False)

    def _rollback(self) -> None:
        if self._conn.closed:  # a lost connection's transaction is gone with it
            return
        try:
            self._conn.execute("ROLLBACK")
        except (self._psycopg.OperationalError, self._psycopg.InterfaceError) as exc:
            if not self._lost(exc):
                raise

    def _translate(self, sql: str) -> str:
        # Our own constant SQL only: `?` becomes psycopg's %s (and a literal % is doubled).
        out = self._sql.get(sql)
        if out is None:
            out = self._sql[sql] = sql.replace("%", "%%").replace("?", "%s")
        return out

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Any:
        query, values = self._translate(sql), tuple(args)
        return self._run(lambda: self._conn.execute(query, values), again=not self._depth)

    def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> int:
        query, values = self._translate(sql), list(rows)

        def statement() -> int:
            with self._conn.cursor() as cursor:
                cursor.executemany(query, values)
                return cursor.rowcount

        return self._run(statement, again=not self._depth)

    def lock_study(self, study_id: str) -> None:
        self.execute("SELECT id FROM studies WHERE id = ? FOR UPDATE", (study_id,))

    def lock_schema(self) -> None:
        self.execute("SELECT pg_advisory_xact_lock(?)", (_MIGRATION_LOCK,))

    def has_table(self, name: str) -> bool:
        # A query of the catalog, not to_regclass(): that one answers from a cache that may
        # not yet know of a table another process created while this one waited for the lock.
        return (
            self.execute(
                "SELECT 1 FROM information_schema.tables WHERE table_schema = current_schema() AND table_name = ?",
                (name,),
            ).fetchone()
            is not None
        )


def check_scheme(url: str) -> None:
    """One StoreError for a URL of a database that is no run store (mysql://...)."""
    scheme = url.split("://", 1)[0].lower()
    if scheme not in SCHEMES:
        raise StoreError(f"--store {mask_url(url)}: unknown scheme {scheme!r}; a run store is {_FORMS}")


def missing_directory(path: str | Path) -> str | None:
    """Why a SQLite store cannot be made at `path`: its directory does not exist (or is a
    file); None when it can."""
    directory = Path(path).expanduser().parent
    if directory.is_dir():
        return None
    problem = "is not a directory" if directory.exists() else "does not exist"
    return (
        f"--store {path}: the directory {directory} {problem}; create it first, or give a store in an "
        f"existing directory (a store is not made where a typo points: its runs would seem lost)"
    )


def _first_line(exc: BaseException, url: str) -> str:
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    password = url_password(url)
    return text.replace(password, "***") if password else text


def url_password(url: str) -> str | None:
    """The password a store URL carries (USER:PASSWORD@ or ?password=), if any."""
    try:
        parts = urlsplit(url)
        return parts.password or dict(parse_qsl(parts.query)).get("password") or None
    except ValueError:  # a malformed URL: open_dialect says what is wrong with it
        return None


def open_dialect(store: str | Path, *, create: bool = True) -> Dialect:
    """The database `store` names: a file path, sqlite:///PATH or postgresql://..."""
    if not is_url(store):
        return SQLiteDialect(Path(store), create=create)
    label = mask_url(str(store))
    check_scheme(str(store))
    scheme = str(store).split("://", 1)[0].lower()
    try:
        parts = urlsplit(str(store))
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError as exc:
        raise StoreError(f"--store {label}: {exc}; a run store is {_FORMS}") from None
    if scheme == "sqlite":
        # sqlite:///relative/path and sqlite:////absolute/path, as SQLAlchemy spells them.
        if parts.netloc or not parts.path.lstrip("/"):
            raise StoreError(f"--store {label}: a SQLite URL is sqlite:///PATH (three slashes, then the file)")
        return SQLiteDialect(Path(parts.path[1:]), create=create)
    if not parts.path.strip("/"):
        raise StoreError(
            f"--store {label}: no database name; a PostgreSQL store is postgresql://USER@HOST:PORT/DATABASE"
        )
    return PostgresDialect(str(store), create=create)
