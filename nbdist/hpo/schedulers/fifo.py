"""The schedulers that train each trial in one go: `fifo` to its last epoch, `median` unless
it falls behind (Golovin et al. 2017, "Google Vizier"; Optuna's MedianPruner): a trial whose
objective after some epoch is worse than the median of the trials that finished before it,
at the same epoch, is stopped right after that epoch. The evidence is the objective at each
epoch, averaged over the trial's folds once every fold has reported that epoch.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from nbdist.hpo.schedulers.base import COMPLETE, SCHEDULERS, Scheduler, SchedulerError, Setting, Work, better

__all__ = ["FIFO", "Median"]


@SCHEDULERS.register
class FIFO(Scheduler):
    """Every trial trains all its epochs, in the order the searcher proposes them."""

    name = "fifo"

    def next(self, new_allowed: bool, epochs_left: float) -> Work | None:
        return Work(None, None) if new_allowed and self.epochs <= epochs_left else None


@SCHEDULERS.register
class Median(FIFO):
    """Stop a trial right after an epoch where it is worse than the median of the finished trials."""

    name = "median"
    parameter_help = {
        "warmup_trials": "trials that must have finished before any is stopped",
        "warmup_epochs": "epochs every trial trains before it may be stopped",
    }
    decides_each_epoch = True

    def __init__(self, warmup_trials: int = 3, warmup_epochs: int = 1):
        for what, value in (("warmup_trials", warmup_trials), ("warmup_epochs", warmup_epochs)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise SchedulerError(f"median {what} must be an integer >= 1, got {value!r}")
        self.warmup_trials, self.warmup_epochs = warmup_trials, warmup_epochs
        self.finished: list[dict[int, float]] = []  # per finished trial: epoch -> value
        self.curves: dict[int, dict[int, float]] = {}  # running trials' curves

    def bind(self, setting: Setting) -> None:
        super().bind(setting)
        self.maximize = setting.maximize

    def notes(self) -> list[str]:
        trials, epochs = self.setting.trials, self.setting.epochs
        why = []
        if trials <= self.warmup_trials:
            why.append(
                f"it stops none before {self.warmup_trials} trials have finished and the study has {trials}: "
                f"give --trials {self.warmup_trials + 1} or more, or a lower warmup_trials (--prune-warmup)"
            )
        if self.warmup_epochs >= epochs:
            fix = f"give warmup_epochs below {epochs}" if epochs > 1 else "a trial of 1 epoch has none to save"
            why.append(f"it judges a trial after its epoch {self.warmup_epochs} and trials train {epochs}: {fix}")
        median = f"median(warmup_trials={self.warmup_trials}, warmup_epochs={self.warmup_epochs})"
        return [f"{median} will save no epoch: {reason}" for reason in why]

    def on_epoch(self, number: int, epoch: int, value: float) -> str:
        self.curves.setdefault(number, {})[epoch] = value
        if epoch < self.warmup_epochs:
            return ""
        earlier = [curve[epoch] for curve in self.finished if epoch in curve]
        if len(earlier) < self.warmup_trials:
            return ""
        median = statistics.median(earlier)
        if better(median, value, self.maximize):
            return f"pruned: worse than the median of {len(earlier)} finished trials at epoch {epoch}"
        return ""

    def reached(self, number: int, epochs: int, value: float | None, outcome: str) -> None:
        curve = self.curves.pop(number, {})
        # Only trials that trained to their end are the yardstick: stopped curves end early.
        if outcome == COMPLETE and curve:
            self.finished.append(curve)

    def state(self) -> dict[str, Any]:
        return {"finished": [{str(e): v for e, v in curve.items()} for curve in self.finished]}

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.finished = [{int(e): float(v) for e, v in curve.items()} for curve in state.get("finished", [])]
