"""The run store: every run, its metric records, checkpoints and study trials in one
SQLite file or one PostgreSQL database (several jobs), written by one writer per run and
read by the dashboard while runs train."""

from pathlib import Path

from nbdist.store.dialects import is_url, mask_url, store_label
from nbdist.store.ingest import LogFollower, RunFeed, RunRecorder, import_run
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
]

STORE_FILE = "nbdist.db"
OFF = ("off", "none", "")


def store_path(store: str | None, runs_dir: str) -> str | None:
    """Where a run is recorded: --store (a file or a URL), else RUNS_DIR/nbdist.db; None
    when --store off."""
    if store is None:
        return str(Path(runs_dir) / STORE_FILE)
    return None if store.strip().lower() in OFF else store
