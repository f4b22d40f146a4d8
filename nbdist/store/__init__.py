"""The run store: every run, its metric records, checkpoints and study trials in one
SQLite file or one PostgreSQL database (several jobs), written by one writer per run and
read by the dashboard while runs train."""

from nbdist.store.dialects import is_url, mask_url, missing_directory, store_label
from nbdist.store.ingest import LogFollower, RunFeed, RunRecorder, import_run
from nbdist.store.location import (
    OFF,
    STORE_FILE,
    check_store,
    network_store_problem,
    place_store,
    sqlite_file,
    store_path,
)
from nbdist.store.runstore import STALE_SECONDS, RunRow, RunStore, TrialRow
from nbdist.store.schema import SCHEMA_VERSION, StoreError

__all__ = [
    "RunStore",
    "RunRow",
    "TrialRow",
    "RunFeed",
    "RunRecorder",
    "LogFollower",
    "import_run",
    "StoreError",
    "SCHEMA_VERSION",
    "STALE_SECONDS",
    "store_path",
    "is_url",
    "mask_url",
    "store_label",
    "check_store",
    "missing_directory",
    "network_store_problem",
    "sqlite_file",
    "place_store",
    "OFF",
    "STORE_FILE",
]
