"""Small in-place sums over a communicator, from inside a model's forward and backward
passes: synchronised BatchNorm's batch statistics and their gradient terms
(--sync-batchnorm).

Each array is a layer's own flat float32 buffer, reduced with one polled allreduce (a
deadline, failed or frozen ranks named, as every collective of a run) through a Staging
made once per buffer: zero-copy on the host, the device buffer itself or a pinned copy
on a GPU. No pickling, one message per call.
"""

from __future__ import annotations

from typing import Any

from nbdist.transport.collectives import Collectives
from nbdist.transport.staging import Staging

__all__ = ["SumOverRanks"]


class SumOverRanks:
    """Called with a flat float32 array (numpy, or a tensor where the model lives): sums it
    in place over `comm`."""

    __slots__ = ("comm", "collectives", "copier", "what", "_stagings")

    def __init__(
        self,
        comm: Any,
        collectives: Collectives,
        copier: Any = None,
        what: str = "the synchronised BatchNorm statistics",
    ):
        self.comm, self.collectives, self.copier, self.what = comm, collectives, copier, what
        self._stagings: dict[int, Staging] = {}

    def __call__(self, array: Any) -> None:
        staging = self._stagings.get(id(array))
        if staging is None or staging.device is not array:  # kept alive by its staging: the id is its own
            staging = self._stagings[id(array)] = Staging(array, self.copier)
        self.collectives.allreduce(self.comm, staging, self.what)
