"""One note when checkpoints take a large share of short epochs.

Checkpoints are written on a thread beside training (train/writer.py), but that thread
still takes CPU time, and the interpreter for parts of it, from the training loop. Against
epochs of seconds that is nothing; against epochs of tens of milliseconds (a small model on
a GPU) a checkpoint every epoch, the default, slows the loop by a large part (a quarter of
the digits CNN's epochs on an H200: bench/results/2026-11-28-step-costs.md). Nothing else
tells the user, so the run's leader compares the CPU time its writer spends on the
checkpoints taken since the first epoch with those epochs' time and says so, once, with
the --checkpoint-every that would make the share small. The writer's CPU time is what it
could take from the loop at most: where cores are free, the loop loses less.
"""

from __future__ import annotations

import math

__all__ = ["CheckpointCost", "NOTE_SHARE", "AIM_SHARE"]

# How many checkpoints, written after the first epoch, are measured before the share is judged.
CHECKPOINTS_MEASURED = 3
# The share of the epochs' time at which the note is given.
NOTE_SHARE = 0.20
# The share the --checkpoint-every it offers brings the writer's CPU time to, at most.
AIM_SHARE = 0.05


class CheckpointCost:
    """`every`: --checkpoint-every (0: only at the end: nothing to note); `epochs`: the run's."""

    __slots__ = ("every", "epochs", "first", "at_first", "seconds", "done")

    def __init__(self, every: int, epochs: int):
        self.every, self.epochs = every, epochs
        self.first = 0  # the first epoch this run trained (a resumed run's is not 1)
        self.at_first = (0.0, 0, 0)  # the writer's CPU seconds, shares written and shares taken then
        self.seconds = 0.0  # of the epochs measured, those after the first
        self.done = every == 0

    def check(
        self, epoch: int, seconds: float, writer_cpu: float, shares_written: int, shares_taken: int
    ) -> str | None:
        """After epoch `epoch` (1-based) of `seconds`, before its checkpoint: the note, once.
        `writer_cpu`: the CPU seconds the writer's jobs have taken so far; `shares_written`,
        `shares_taken`: the checkpoint shares it has written so far, and those handed to it
        (written or queued). The run's first epoch (the warm-up) is left out.

        Each checkpoint taken since is charged what those written cost on average, over
        the epochs' time: a writer that lags behind (its disk's syncs slower than the
        epochs) writes the queued ones during the training all the same, so what it has
        written so far would understate them, the more so on a busy disk. A master whose
        snapshots wait for one another (asynchronous runs) takes fewer checkpoints than
        epochs and is charged for those it takes."""
        if self.done:
            return None
        if not self.first:
            self.first, self.at_first = epoch, (writer_cpu, shares_written, shares_taken)
            return None
        self.seconds += seconds
        written = shares_written - self.at_first[1]
        if written < CHECKPOINTS_MEASURED:
            return None
        self.done = True
        per_checkpoint = (writer_cpu - self.at_first[0]) / written
        taken = shares_taken - self.at_first[2]
        share = per_checkpoint * taken / self.seconds if self.seconds > 0 else math.inf
        if share < NOTE_SHARE:
            return None
        return self._words(per_checkpoint, self.seconds / (epoch - self.first), share)

    def _words(self, per_checkpoint: float, per_epoch: float, share: float) -> str:
        every = self._every_to_aim(per_checkpoint, per_epoch, share)
        if every is not None and every < self.epochs:
            remedy = f"--checkpoint-every {every} brings that to {AIM_SHARE:.0%} or less (0: only at the end)"
        else:
            remedy = "--checkpoint-every 0 writes one at the end only"
        return (
            f"writing a checkpoint takes {per_checkpoint * 1e3:.1f} ms of CPU beside the training, {share:.0%} of "
            f"its time (epochs of {per_epoch * 1e3:.1f} ms): with epochs this short, checkpoints slow the training; "
            f"{remedy}"
        )

    def _every_to_aim(self, per_checkpoint: float, per_epoch: float, share: float) -> int | None:
        """The fewest epochs between checkpoints that bring their cost to AIM_SHARE of the
        epochs', if the loop loses the writer's whole CPU time: the epochs measured then
        took that share longer than epochs without checkpoints. None: the writer's time is
        more than the epochs', so how long an epoch without checkpoints takes is unknown."""
        if share >= 1:
            return None
        bare_epoch = per_epoch * (1 - share)
        # (less a rounding error: 12.000000001 epochs is 12)
        return max(self.every + 1, math.ceil(per_checkpoint / (AIM_SHARE * bare_epoch) - 1e-9))
