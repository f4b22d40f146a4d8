"""Engine side of the live stream: a rank's flushed record batches go to the client.

ipyparallel's data publication merges each published dict into the task's `data` on
the client; every batch gets its own key, so a client that reads less often than the
engines publish still sees every batch (the collector removes the keys it has read).
Publishing is a zmq send queued on the engine's socket: it never waits for the client.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DataPublisher"]


class DataPublisher:
    __slots__ = ("prefix", "sequence", "_publish")

    def __init__(self, prefix: str):
        from ipyparallel.datapub import publish_data

        self.prefix = prefix
        self.sequence = 0
        self._publish = publish_data

    def __call__(self, records: list[dict[str, Any]]) -> None:
        self._publish({f"{self.prefix}{self.sequence:09d}": records})
        self.sequence += 1

    def close(self) -> None:
        """Nothing buffered here: the RunLog flushes its last batch when it closes."""
