"""Set-up checks of a run's data against its layout and its model: the batch size a
worker's share of the samples allows, and class labels the model's outputs can score.
Pure functions of the data, the layout and the backend (no MPI): train/settle.py runs
them during set-up, on every rank or on the run leader.
"""

from __future__ import annotations

from typing import Any

from nbdist.backends import Backend
from nbdist.backends.base import ModelError
from nbdist.data.base import Data, DataError
from nbdist.data.sharding import ShardPlan
from nbdist.layout import Layout
from nbdist.options import TrainOptions
from nbdist.train.asynchrony import Notice

__all__ = ["shards_of", "batch_notices", "check_labels", "check_data_size", "IGNORED_LABEL"]


def shards_of(layout: Layout, options: TrainOptions) -> int:
    """How many shares the training set is cut into: each worker takes its own
    (master-worker); in allreduce every rank does, but the stages of a pipeline replica share one."""
    if layout.masters:
        return layout.workers * layout.masters
    return layout.workers if options.worker_parallel == "pipeline" else layout.n_ranks


def batch_notices(data: Data, layout: Layout, options: TrainOptions) -> list[Notice]:
    """A warning when --batch-size is larger than a worker's share of the training data:
    the run trains, as PyTorch's DataLoader and Keras' fit would, with the smaller batch
    that the share makes (one per worker and epoch), which the user should know of: the
    learning rate and --lr-scaling were chosen for the batch asked for."""
    shards = shards_of(layout, options)
    share = data.n_train // shards
    if options.batch_size <= share:
        return []
    workers = f"over {shards} workers" if shards > 1 else "for 1 worker"
    return [
        Notice(
            f"--batch-size {options.batch_size} is larger than a worker's share of the training data ({share} "
            f"of {data.n_train} samples {workers}): each worker trains on one batch of about {share} samples "
            f"per epoch; give --batch-size {share} or less for the batch size to hold",
            warning=True,
        )
    ]


# PyTorch's cross-entropy leaves out the samples labelled -100 (its ignore_index).
IGNORED_LABEL = -100


def check_labels(data: Data, backend: Backend, x: Any, source: str) -> None:
    """Class labels (integers, one per sample) that the data's classes and the model's
    outputs hold: a label beyond them fails in the loss, mid-training, with an index error."""
    found = data.label_range()
    if found is None:
        return
    low, high = found

    def beyond(classes: int) -> bool:
        return high >= classes or (low < 0 and low != IGNORED_LABEL)

    declared = getattr(data, "num_classes", None)
    if declared is not None and beyond(declared):
        raise DataError(
            f"{source}: the labels of its data run from {low} to {high}, outside the data's {declared} classes "
            f"(num_classes={declared}: labels 0 to {declared - 1}): fix the labels, or num_classes"
        )
    outputs = backend.class_count(x)
    if outputs is not None and beyond(outputs):
        raise ModelError(
            f"{source}: the labels run from {low} to {high}, but the model scores {outputs} classes "
            f"(labels 0 to {outputs - 1}): make its last layer give {high + 1} outputs, or relabel the data"
        )


def check_data_size(data: Data, layout: Layout, options: TrainOptions) -> None:
    """Samples for every worker's batches at every step (as the topologies' ShardPlan
    cuts them), and some to validate on."""
    for count, which, flag in ((data.n_train, "training", "--train"), (data.n_val, "validation", "--val")):
        if count == 0:
            raise DataError(
                f"the {which} set is empty ({data.n_train} training and {data.n_val} validation "
                f"samples): give the model's data {which} samples, or {flag} files that hold some"
            )
    shards = shards_of(layout, options)
    # A master-worker worker of several processes splits each of its batches between them.
    procs = layout.procs_per_worker if layout.masters else 1
    try:
        plan = ShardPlan(data.n_train, shards, options.batch_size, options.seed)
        smallest = data.n_train // (shards * plan.batches_per_epoch)
    except ValueError:
        smallest = 0
    if smallest < procs:
        raise DataError(_too_few_samples(data.n_train, shards, procs, options.batch_size))


def _too_few_samples(samples: int, shards: int, procs: int, batch_size: int) -> str:
    """What to change when `samples` cannot give each of `shards` workers (of `procs`
    processes each) at least one sample per process at every step."""
    each = f"at least {procs} samples (one per process)" if procs > 1 else "a batch"
    if samples < shards * procs:
        most = samples // procs
        fix = f"use at most {most} worker{'s' if most > 1 else ''}" if most else "use fewer processes per worker"
        fix += ", or give more training samples"
    else:  # one batch per worker per epoch always fits: batches of ceil(samples / shards)
        fix = f"use --batch-size {-(-samples // shards)} or more, or fewer workers"
    return (
        f"too few training samples for {shards} workers: {samples} with --batch-size {batch_size} leave a "
        f"worker without {each} at some step; {fix}"
    )
