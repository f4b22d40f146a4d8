"""What `--store` may name, checked where the option comes in, before any run starts.

    off                                   record nothing
    runs/nbdist.db, ./mystore, ~/nb.sqlite a SQLite file: a .db/.sqlite name or a path
                                          with a directory, in a directory that exists
    sqlite:///PATH                        the same, as a URL
    postgresql://USER@HOST:PORT/DB        PostgreSQL, without a password

A bare word is none of these: `--store of` is a typo of `off` far more often than a wish
for a store file named `of` in the working directory. A directory that does not exist is
a typo too (a new, empty store elsewhere, and runs that seem lost), so it is not created.

A password is refused in the URL: every user of the machine reads command lines (`ps`
showed it in every rank of a job), and the URL is saved with the run's options, in
checkpoints and in the store, so that `--resume` can reconnect. libpq takes it from
PGPASSWORD, ~/.pgpass (chmod 600) or a service file (PGSERVICE, ~/.pg_service.conf)
instead; nbdist passes the environment on to its ranks untouched.

A SQLite store on a network file system (mounts.py) is refused for a job whose ranks
span several hosts, and warned about for one host.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from nbdist.durable import make_dir
from nbdist.specs import did_you_mean
from nbdist.store.dialects import StoreError, check_scheme, is_url, mask_url, missing_directory, url_password
from nbdist.store.mounts import network_mount

__all__ = [
    "OFF",
    "STORE_FILE",
    "place_store",
    "store_path",
    "SQLITE_SUFFIXES",
    "PASSWORD_ADVICE",
    "check_store",
    "network_store_problem",
    "sqlite_file",
]

OFF = ("off", "none", "")
STORE_FILE = "nbdist.db"
SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3", ".db3")
PASSWORD_ADVICE = (
    "give the URL without it and the password through PGPASSWORD, ~/.pgpass (chmod 600) "
    "or a service file (PGSERVICE=NAME, ~/.pg_service.conf)"
)
_FORMS = (
    "'off' (record nothing), a SQLite file (a name ending in .db or .sqlite, or a path with "
    "a directory such as ./NAME), sqlite:///PATH or postgresql://USER@HOST:PORT/DATABASE"
)


def check_store(store: str | Path | None) -> None:
    """One StoreError for a --store that is none of the forms above, or a URL with a
    password; nothing for None (the default store) and the forms that are fine."""
    if store is None or isinstance(store, Path):
        return
    text = store.strip()
    if text.lower() in OFF:
        return
    if is_url(text):
        check_scheme(text)  # before its password: a database no store can be in
        if url_password(text):
            raise StoreError(
                f"--store {mask_url(text)} holds a password, which every user of this machine can "
                f"read on a command line (ps) and which would be saved with the run: {PASSWORD_ADVICE}"
            )
        return
    if Path(text).suffix.lower() in SQLITE_SUFFIXES or os.path.dirname(text):
        return
    raise StoreError(f"--store {text!r} is not a run store: give {_FORMS}{did_you_mean(text.lower(), ['off'])}")


def store_path(store: str | None, runs_dir: str) -> str | None:
    """Where a run is recorded: --store (a file or a URL), else RUNS_DIR/nbdist.db; None
    when --store off."""
    if store is None:
        return str(Path(runs_dir) / STORE_FILE)
    return None if store.strip().lower() in OFF else store


def place_store(store: str | None, runs_dir: str, *, several_hosts: bool) -> str | None:
    """The store a job records in (store_path), ready to open: RUNS_DIR made (private) for
    the default one; one StoreError for a SQLite file in a directory that does not exist,
    or on a network file system that `several_hosts` write; a warning printed for a
    network file system written from one host."""
    database = store_path(store, runs_dir)
    sqlite = sqlite_file(database) if database is not None else None
    if database is None or sqlite is None:
        return database
    if store is None:
        make_dir(Path(runs_dir))
    missing = missing_directory(sqlite)
    if missing:
        raise StoreError(missing)
    warning = network_store_problem(database, several_hosts)
    if warning:
        print(f"nbdist: warning: {warning}", file=sys.stderr, flush=True)
    return database


def sqlite_file(store: str | Path) -> Path | None:
    """The SQLite file a store names (a path or sqlite:///PATH); None for PostgreSQL."""
    if not is_url(str(store)):
        return Path(store).expanduser()
    scheme, _, rest = str(store).partition("://")
    return Path(rest[1:]) if scheme.lower() == "sqlite" else None


def network_store_problem(store: str | Path, several_hosts: bool, table: str | None = None) -> str | None:
    """A SQLite store on a network file system: StoreError when several hosts write it (a
    job whose ranks span nodes), else the warning to show (None: a local file system, or
    not SQLite). `table`: the mount table (default: this machine's /proc/mounts)."""
    path = sqlite_file(store)
    mount = network_mount(path, table) if path is not None else None
    if mount is None:
        return None
    if several_hosts:
        raise StoreError(
            f"the run store {store} is a SQLite file on a network file system ({mount}) and this job's "
            f"ranks span several hosts: SQLite's locks do not hold between hosts there, and the store "
            f"could be corrupted; use PostgreSQL (--store postgresql://USER@HOST/DB), or a store on a "
            f"local disk of the first node"
        )
    return (
        f"the run store {store} is a SQLite file on a network file system ({mount}): fine from this "
        f"host alone, but no job or dashboard on another host may use it at the same time "
        f"(PostgreSQL may: --store postgresql://USER@HOST/DB)"
    )
