"""Synchronous SGD for the allreduce topology.

Each rank scales its mean-loss gradient by its share of the step's samples before the
sum-allreduce, so the reduced gradient is the gradient of the mean loss over the
concatenated batch even when batch sizes differ by one; then every rank steps the same
optimiser on the same gradient and the replicas stay identical.
"""

from __future__ import annotations

import numpy as np

from nbdist.algorithms.arrays import Array
from nbdist.backends.base import FlatOptimizer


def sample_share(sizes: np.ndarray, index: int) -> float:
    """The weight of shard `index` in a step whose shards have `sizes` samples."""
    return float(sizes[index]) / float(sizes.sum())


def apply(opt: FlatOptimizer, reduced_grad: Array) -> None:
    opt.step(reduced_grad)
