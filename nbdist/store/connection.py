"""One connection to a run store: the dialect opened, the schema checked or made, and the
transaction every write goes through. The run store's tables of runs and of studies
(nbdist.store.runstore, nbdist.store.studies) build on it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from nbdist.store.dialects import Dialect, StoreError, open_dialect
from nbdist.store.schema import prepare_schema

__all__ = ["StoreConnection"]

_Store = TypeVar("_Store", bound="StoreConnection")  # the class of the store opened (3.10: no Self)


class StoreConnection:
    """One connection to a store (a file path, sqlite:///PATH or postgresql://...); use
    one per thread."""

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

    def __enter__(self: _Store) -> _Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def _write(self) -> Iterator[Dialect]:
        with self._db.transaction():
            yield self._db
