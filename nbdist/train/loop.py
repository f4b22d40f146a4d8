"""The training loop that the worker roles share (roles/worker.py, roles/allreduce.py):
the epochs and their batches from a start position, the check that the loss is still a
number, and the rank's interval 'train' records. Each role supplies its step (what it does
with a batch's gradient) and its end of an epoch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from nbdist.backends.base import BatchStats
from nbdist.errors import TrainingError

__all__ = ["run_epochs", "check_loss", "NonFiniteLoss", "LossGrowth", "TrainReport", "REPORT_EVERY"]

REPORT_EVERY = 0.5  # seconds between a rank's throughput/phase records


def run_epochs(
    start_epoch: int,
    start_step: int,
    epochs: int,
    begin_epoch: Callable[[int], Sequence],
    step: Callable[[int, int, Any, bool], bool | None],
    end_epoch: Callable[[int], bool | None],
) -> int:
    """Train epochs start_epoch..epochs-1, the first from batch `start_step` (a resume's
    position). `begin_epoch(epoch)` gives the epoch's batches; `step(epoch, step, batch,
    last)` and `end_epoch(epoch)` return True to stop the run there. Returns the epoch the
    loop was in last."""
    epoch = start_epoch
    for epoch in range(start_epoch, epochs):
        batches = begin_epoch(epoch)
        first = start_step if epoch == start_epoch else 0
        for index in range(first, len(batches)):
            if step(epoch, index, batches[index], index == len(batches) - 1):
                return epoch
        if end_epoch(epoch):
            return epoch
    return epoch


class NonFiniteLoss(TrainingError):
    """The training loss became NaN or infinite."""


def check_loss(stats: BatchStats, epoch: int, step: int, where: Callable[[], str] | None = None) -> None:
    """NonFiniteLoss naming the batch (and `where()`, the rank) once the loss is no number."""
    if not np.isfinite(stats.loss_sum):
        on = f" on {where()}" if where is not None else ""
        raise NonFiniteLoss(
            f"the loss became {stats.loss_sum / max(stats.n, 1)}{on} at epoch {epoch + 1}, "
            f"batch {step + 1}: lower the learning rate or check the data"
        )


# An epoch's training loss this many times the untrained model's (or, once above that,
# this many times the lowest epoch loss so far) is diverging, though still a number.
GROWTH_OVER_START = 100.0
GROWTH_OVER_BEST = 1000.0


class LossGrowth:
    """The epochs' training loss, watched for growth by orders of magnitude: a diverging
    run whose loss has not (yet) become NaN, which check_loss would stop. It warns once
    per run; the run goes on (a loss may recover, and the user decides)."""

    __slots__ = ("start", "since", "best", "warned")

    def __init__(self, start: float | None):
        # The untrained model's loss on a few samples (set-up's probe), if known and positive.
        self.start = start if start is not None and math.isfinite(start) and start > 0 else None
        self.since = "before training"
        self.best = math.inf
        self.warned = False

    def check(self, epoch: int, loss: float) -> str | None:
        """The warning for epoch `epoch`'s (1-based) training loss `loss`, once; else None."""
        if self.warned or not math.isfinite(loss):
            return None
        if self.start is None and loss > 0:
            self.start, self.since = loss, f"at epoch {epoch}"  # without a probe's loss, the first epoch's
        self.best = min(self.best, loss)
        start = self.start
        if start is None:
            return None
        if not (loss > GROWTH_OVER_START * start or (loss > start and loss > GROWTH_OVER_BEST * self.best)):
            return None
        self.warned = True
        lowest = f", lowest {self.best:.3g}" if self.best < start else ""
        return (
            f"the training loss grew to {loss:.3g} at epoch {epoch} (from {start:.3g} {self.since}{lowest}): "
            f"the training is diverging; lower the learning rate (e.g. ten times), or check the data and the loss"
        )


class TrainReport:
    """What a rank did since its last 'train' record: its samples, loss and metric, the
    seconds spent in each of its `phases` (recorded as `<phase>_s`), and the bytes it
    handed to MPI (`bytes_sent`: gradients, messages; --compression makes them fewer)."""

    __slots__ = ("ctx", "stats", "phases", "since", "bytes_sent")

    def __init__(self, ctx, phases: Sequence[str]):
        self.ctx = ctx
        self.stats = BatchStats()
        self.phases = dict.fromkeys(phases, 0.0)
        self.since = time.monotonic()
        self.bytes_sent = 0

    def add(self, stats: BatchStats) -> None:
        self.stats.add(stats)

    @property
    def due(self) -> bool:
        return time.monotonic() - self.since >= REPORT_EVERY

    def emit(self, epoch: int, step: int, **extra: float) -> None:
        """The record of the interval that ends now; the next interval starts."""
        ctx, stats = self.ctx, self.stats
        elapsed = time.monotonic() - self.since
        ctx.log.emit(
            "train",
            {
                "samples": stats.n,
                "samples_per_s": stats.n / elapsed if elapsed else 0.0,
                "loss": stats.loss,
                ctx.backend.metric_name or "metric": stats.metric,
                **{f"{phase}_s": seconds for phase, seconds in self.phases.items()},
                "bytes_sent": self.bytes_sent,
                **extra,
                **ctx.backend.train_extras(),
            },
            step=step,
            epoch=epoch,
        )
        self.stats, self.phases, self.bytes_sent = BatchStats(), dict.fromkeys(self.phases, 0.0), 0
        self.since = time.monotonic()
