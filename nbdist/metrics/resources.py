"""What a rank costs its node: CPU and memory, sampled from the training loop's thread.

psutil reads /proc: a sample costs microseconds, so the RunLog takes one about once a
second when it emits, and never from a thread of its own (a thread per rank would be
one more thing competing for the cores the ranks train on).
"""

from __future__ import annotations

from typing import Any

__all__ = ["ResourceSampler"]


class ResourceSampler:
    __slots__ = ("_process", "_cores")

    def __init__(self) -> None:
        import psutil

        self._process = psutil.Process()
        self._process.cpu_percent(None)  # starts the interval the first sample measures
        self._cores = psutil.cpu_count() or 1

    def sample(self) -> dict[str, Any]:
        """CPU use since the previous sample (percent of one core) and resident memory."""
        with self._process.oneshot():
            cpu = self._process.cpu_percent(None)
            rss = self._process.memory_info().rss
        return {"cpu_percent": cpu, "rss_mb": rss / 2**20, "node_cores": self._cores}
