"""Which workers share an epoch's data when some have been dropped.

Every worker of a master owns one shard of each epoch's plan (nbdist.data.sharding). When
an asynchronous master drops a worker (it died or froze), the run goes on without it, and
from the next epoch on its shard is split among the workers that are left, so every
sample is still seen once per epoch. The master decides each epoch's members once, the
first time a worker reaches that epoch, and tells every worker in the reply that ends its
previous epoch; a worker dropped after that point takes the rest of its share of that
epoch with it (the epoch's record says how many samples were lost).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["EpochMembers", "batches_for"]


class EpochMembers:
    """The master's record: epoch -> the workers (client indices) that share its data."""

    __slots__ = ("workers", "fixed")

    def __init__(self, workers: int):
        self.workers = workers
        self.fixed: dict[int, tuple[int, ...]] = {}

    def of(self, epoch: int, live: set[int]) -> tuple[int, ...]:
        """The members of `epoch`, fixed now from the `live` workers if not yet fixed."""
        if epoch not in self.fixed:
            self.fixed[epoch] = tuple(sorted(w for w in live if w < self.workers))
        return self.fixed[epoch]

    def forget_before(self, epoch: int) -> None:
        for old in [e for e in self.fixed if e < epoch]:
            del self.fixed[old]

    def to_json(self) -> dict[str, list[int]]:
        return {str(epoch): list(members) for epoch, members in self.fixed.items()}

    def load_json(self, data: dict[str, list[int]]) -> None:
        self.fixed = {int(epoch): tuple(int(w) for w in members) for epoch, members in data.items()}


def batches_for(shard_batches: Sequence[Sequence[np.ndarray]], me: int, members: Sequence[int]) -> list[np.ndarray]:
    """Worker `me`'s batches of an epoch: its own shard's, then its part of every shard
    whose worker is not a member (each such shard dealt out round-robin among the
    members, so their batch counts differ by at most one per missing shard).

    `shard_batches[w]` are the batches of worker w's shard (plan.epoch(epoch, shard of w)).
    """
    own = list(shard_batches[me])
    if len(members) == len(shard_batches) or me not in members:
        return own
    position, count = members.index(me), len(members)
    for missing in range(len(shard_batches)):
        if missing not in members:
            own.extend(shard_batches[missing][position::count])
    return own
