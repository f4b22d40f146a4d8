"""Which samples a worker trains on, batch by batch, epoch by epoch.

Every rank computes the same plan from (seed, epoch) alone, so no indices travel over
MPI. Each epoch is a fresh permutation of the whole training set cut into
`shards x batches_per_epoch` nearly equal batches: every sample is seen exactly once
per epoch, every shard gets the same number of batches (synchronous modes step in
lock-step), and at a given step the shards' batch sizes differ by at most one.
"""

from __future__ import annotations

import math

import numpy as np


class ShardPlan:
    __slots__ = ("n_samples", "shards", "batch_size", "seed", "batches_per_epoch")

    def __init__(self, n_samples: int, shards: int, batch_size: int, seed: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch size must be at least 1, got {batch_size}")
        if shards < 1:
            raise ValueError(f"the number of workers (shards) must be at least 1, got {shards}")
        self.n_samples = int(n_samples)
        self.shards = int(shards)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.batches_per_epoch = max(1, math.ceil(self.n_samples / (self.shards * self.batch_size)))
        if self.n_samples < self.shards * self.batches_per_epoch:
            raise ValueError(
                f"{self.n_samples} training samples are too few for {self.shards} workers "
                f"with batches of {self.batch_size}"
            )

    def _batches(self, epoch: int) -> list[np.ndarray]:
        order = np.random.default_rng([self.seed, epoch]).permutation(self.n_samples)
        return np.array_split(order, self.shards * self.batches_per_epoch)

    def epoch(self, epoch: int, shard: int) -> list[np.ndarray]:
        """The batches (index arrays) of `shard` in `epoch`, in training order."""
        # Batch k of every shard comes from the same stretch of the split, so at step k
        # the shards' batch sizes are equal up to one sample.
        return self._batches(epoch)[shard :: self.shards]

    def step_sizes(self, epoch: int) -> np.ndarray:
        """(batches_per_epoch, shards) array of batch sizes, for sample-weighted averages."""
        sizes = np.array([len(b) for b in self._batches(epoch)])
        return sizes.reshape(self.batches_per_epoch, self.shards)


def split_evenly(indices: np.ndarray, parts: int, part: int) -> np.ndarray:
    """`part` of `parts` nearly equal pieces of `indices` (processes of one worker, val shards)."""
    return np.array_split(indices, parts)[part]
