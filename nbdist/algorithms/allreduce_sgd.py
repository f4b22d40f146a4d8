"""Synchronous SGD for the allreduce topology.

Each rank scales its mean-loss gradient by its share of the step's samples before the
sum-allreduce, so the reduced gradient is the gradient of the mean loss over the
concatenated batch even when batch sizes differ by one; then every rank steps the same
optimiser on the same gradient and the replicas stay identical.
"""

from __future__ import annotations

import numpy as np

from nbdist.algorithms.arrays import Array
from nbdist.algorithms.base import RULES, Rule
from nbdist.backends.base import FlatOptimizer


@RULES.register
class SynchronousSGD(Rule):
    """Every rank steps the same optimiser on the gradient of the whole step's batch,
    summed by allreduce (--topology allreduce; the optimiser is --worker-optimizer)."""

    name = "sgd"
    topologies = ("allreduce",)

    @staticmethod
    def sample_share(sizes: np.ndarray, index: int) -> float:
        """The weight of shard `index` in a step whose shards have `sizes` samples."""
        return float(sizes[index]) / float(sizes.sum())

    @staticmethod
    def apply(opt: FlatOptimizer, reduced_grad: Array) -> None:
        opt.step(reduced_grad)


# What the allreduce topology calls (roles/allreduce.py).
sample_share = SynchronousSGD.sample_share
apply = SynchronousSGD.apply
