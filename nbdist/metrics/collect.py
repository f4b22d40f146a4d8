"""Client side of the live stream: gather the record batches every rank publishes.

The batches land in the task's per-engine `data` dicts (ipyparallel's client thread
merges them in as they arrive); `LiveRecords.poll()` moves the new ones into one list.
Reading pops the keys, so each batch is taken once and the dicts do not grow.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["LiveRecords"]


class LiveRecords:
    def __init__(self, async_result: Any, prefix: str):
        self._result = async_result
        self._prefix = prefix
        self._lock = threading.Lock()
        self.records: list[dict[str, Any]] = []

    def _engine_dicts(self) -> list[dict[str, Any]]:
        data = self._result.data
        return data if isinstance(data, list) else [data]

    def poll(self) -> list[dict[str, Any]]:
        """The records that arrived since the last poll (also appended to .records)."""
        with self._lock:
            new: list[dict[str, Any]] = []
            for published in self._engine_dicts():
                for key in sorted(k for k in list(published) if k.startswith(self._prefix)):
                    new.extend(published.pop(key))
            self.records.extend(new)
            return new
