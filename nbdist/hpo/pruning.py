"""The median pruner: stop a trial that is doing worse than the median of the trials that
finished before it, at the same epoch (Golovin et al. 2017, "Google Vizier"; optuna's
MedianPruner). The evidence is the objective measured at each epoch, averaged over the
trial's folds once every fold has reported that epoch.
"""

from __future__ import annotations

import statistics

__all__ = ["MedianPruner"]


class MedianPruner:
    def __init__(self, *, maximize: bool, warmup_trials: int = 3, warmup_epochs: int = 1):
        self.maximize = maximize
        self.warmup_trials = warmup_trials
        self.warmup_epochs = warmup_epochs
        self._finished: list[dict[int, float]] = []  # per finished trial: epoch -> value

    def finished(self, curve: dict[int, float]) -> None:
        """A trial completed (pruned trials do not count: their curves stop early)."""
        if curve:
            self._finished.append(dict(curve))

    def should_prune(self, epoch: int, value: float) -> bool:
        """Whether a running trial whose objective is `value` after `epoch` epochs is
        worse than the median of the finished trials at that epoch."""
        if epoch < self.warmup_epochs:
            return False
        earlier = [curve[epoch] for curve in self._finished if epoch in curve]
        if len(earlier) < self.warmup_trials:
            return False
        median = statistics.median(earlier)
        return value < median if self.maximize else value > median

    def state(self) -> list[dict[str, float]]:
        return [{str(e): v for e, v in curve.items()} for curve in self._finished]

    def load_state(self, state: list[dict[str, float]]) -> None:
        self._finished = [{int(e): float(v) for e, v in curve.items()} for curve in state]
