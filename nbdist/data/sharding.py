"""Which samples a worker trains on, batch by batch, epoch by epoch.

Every rank computes the same plan from (seed, epoch) alone, so no indices travel over
MPI. Each epoch is a fresh permutation of the whole training set cut into
`shards x batches_per_epoch` nearly equal batches: every sample is seen exactly once
per epoch, every shard gets the same number of batches (synchronous modes step in
lock-step), and at a given step the shards' batch sizes differ by at most one.
FilePlan keeps these promises for samples stored in files, read a piece at a time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import NamedTuple

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

    def every_shard(self, epoch: int) -> list[list[np.ndarray]]:
        """The batches of every shard in `epoch` (a worker taking over a dropped worker's
        share reads them; unlike `epoch`, this schedules no reading ahead)."""
        batches = self._batches(epoch)
        return [batches[shard :: self.shards] for shard in range(self.shards)]

    def step_sizes(self, epoch: int) -> np.ndarray:
        """(batches_per_epoch, shards) array of batch sizes, for sample-weighted averages."""
        sizes = np.array([len(b) for b in self._batches(epoch)])
        return sizes.reshape(self.batches_per_epoch, self.shards)


def split_evenly(indices: np.ndarray, parts: int, part: int) -> np.ndarray:
    """`part` of `parts` nearly equal pieces of `indices` (processes of one worker, val shards)."""
    return np.array_split(indices, parts)[part]


class Piece(NamedTuple):
    """Rows [start, stop) of file number `file`: what a worker reads in one go."""

    file: int
    start: int
    stop: int

    def covers(self, file: int, lo: int, hi: int) -> bool:
        return self.file == file and self.start <= lo and hi <= self.stop


class FilePlan(ShardPlan):
    """A ShardPlan for samples stored in files, which are read a piece at a time.

    Drawing samples anywhere, as ShardPlan does, would make every worker read every file
    every epoch. Instead the files are concatenated in an order fixed by the seed and
    cut into `shards` stretches of equal size (+-1 sample; a file on a boundary is
    shared by two shards): a worker reads the same files every epoch, so a node-local
    cache copy is read again rather than copied again. Each epoch a shard visits its
    pieces in a new order, in windows of `mix` pieces whose samples are shuffled
    together, so batches mix files while only the window in use (and the next one,
    prefetched) is in memory. Batches are indices into the concatenation of the files in
    their given order (`offsets`).

    `on_epoch(windows)` is called by `epoch()` with the shard's windows for that epoch,
    followed by the first window of the next: the reader's prefetch schedule.
    """

    __slots__ = ("offsets", "mix", "pieces", "on_epoch")

    def __init__(
        self,
        sizes: Sequence[int],
        shards: int,
        batch_size: int,
        seed: int = 0,
        *,
        mix: int = 2,
        on_epoch: Callable[[list[list[Piece]]], None] | None = None,
    ):
        if mix < 1:
            raise ValueError(f"files mixed per window must be at least 1, got {mix}")
        file_sizes = np.asarray(sizes, np.int64)
        super().__init__(int(file_sizes.sum()), shards, batch_size, seed)
        self.offsets = np.concatenate([[0], np.cumsum(file_sizes)])
        self.mix = int(mix)
        self.on_epoch = on_epoch
        order = np.random.default_rng([self.seed, _FILE_ORDER]).permutation(len(file_sizes))
        starts = np.cumsum(file_sizes[order]) - file_sizes[order]  # where each file begins in that order
        q, r = divmod(self.n_samples, self.shards)
        bounds = [s * q + min(s, r) for s in range(self.shards + 1)]
        self.pieces: list[list[Piece]] = []
        for lo, hi in pairwise(bounds):
            mine = []
            for file, begin in zip(order, starts, strict=True):
                a, b = max(lo, begin), min(hi, begin + file_sizes[file])
                if a < b:
                    mine.append(Piece(int(file), int(a - begin), int(b - begin)))
            self.pieces.append(mine)

    def windows(self, epoch: int, shard: int) -> list[list[Piece]]:
        """The shard's pieces in this epoch's order, grouped `mix` at a time."""
        pieces = self.pieces[shard]
        order = np.random.default_rng([self.seed, epoch, shard]).permutation(len(pieces))
        ordered = [pieces[i] for i in order]
        return [ordered[i : i + self.mix] for i in range(0, len(ordered), self.mix)]

    def shard_order(self, epoch: int, shard: int) -> np.ndarray:
        """Every sample of the shard once, window after window, shuffled within each."""
        rng = np.random.default_rng([self.seed, epoch, shard, _WITHIN_WINDOW])
        parts = []
        for window in self.windows(epoch, shard):
            rows = np.concatenate(
                [np.arange(self.offsets[p.file] + p.start, self.offsets[p.file] + p.stop) for p in window]
            )
            parts.append(rng.permutation(rows))
        return np.concatenate(parts)

    def _batches(self, epoch: int) -> list[np.ndarray]:
        # Step-major like ShardPlan's (batch k of every shard side by side), so epoch()
        # and step_sizes() read it the same way; sizes at a step differ by at most one.
        per_shard = [np.array_split(self.shard_order(epoch, s), self.batches_per_epoch) for s in range(self.shards)]
        return [per_shard[s][k] for k in range(self.batches_per_epoch) for s in range(self.shards)]

    def epoch(self, epoch: int, shard: int) -> list[np.ndarray]:
        if self.on_epoch is not None:
            self.on_epoch(self.windows(epoch, shard) + self.windows(epoch + 1, shard)[:1])
        return super().epoch(epoch, shard)


# Stream keys of the plan's random generators, apart from the epochs' own streams.
_FILE_ORDER, _WITHIN_WINDOW = 1 << 20, 1 << 21
