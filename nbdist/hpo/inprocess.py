"""Studies of a Python function, in this process: the same coordinator, searchers,
pruner, run store and dashboard as a study of trainings, for an objective that is cheap
to evaluate (or to try a searcher).

    result = nbdist.hpo.optimize(lambda p: (p["x"] - 2) ** 2, space="x=real(-5,5)", trials=30)

The objective takes the trial's parameters and returns the figure of merit, or a
sequence of values, one per epoch (a learning curve), whose last is the figure of merit;
a curve is reported an epoch at a time, so the median pruner can stop it early.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from nbdist.hpo.runner import EpochReport, FoldOutcome, StudyResult, StudyRunner, TrialExecutor, TrialFinished
from nbdist.hpo.trial import Trial
from nbdist.options import StudyOptions, TrainOptions

__all__ = ["FunctionExecutor", "optimize"]


class FunctionExecutor(TrialExecutor):
    """One group: the calling process. Each poll advances the running trial by one epoch."""

    groups = 1

    def __init__(self, objective: Callable[[dict[str, Any]], Any], objective_name: str):
        self.objective, self.name = objective, objective_name
        self._trial: Trial | None = None
        self._curve: list[float] = []
        self._epoch = 0
        self._error: str | None = None
        self._stop = False

    def start(self, group: int, trial: Trial) -> None:
        self._trial, self._epoch, self._stop, self._error = trial, 0, False, None
        try:
            value = self.objective(dict(trial.params))
            self._curve = [float(v) for v in value] if isinstance(value, Sequence) else [float(value)]
        except Exception as exc:  # the user's objective failed: the trial fails
            self._curve, self._error = [], f"{type(exc).__name__}: {exc}"

    def poll(self, timeout: float) -> list[EpochReport | TrialFinished]:
        trial = self._trial
        if trial is None:
            return []
        if self._error is None and not self._stop and self._epoch < len(self._curve):
            self._epoch += 1
            return [EpochReport(trial.number, 0, self._epoch, {self.name: self._curve[self._epoch - 1]})]
        self._trial = None
        final = {self.name: self._curve[self._epoch - 1]} if self._epoch else {}
        if final and not math.isfinite(final[self.name]):
            self._error = f"the objective is {final[self.name]}"
        return [
            TrialFinished(
                trial.number,
                {0: FoldOutcome(final=final, error=self._error, stop_reason="pruned" if self._stop else "")},
            )
        ]

    def prune(self, group: int) -> None:
        self._stop = True


def optimize(
    objective: Callable[[dict[str, Any]], Any],
    *,
    space: str,
    searcher: str = "bayes",
    trials: int = 20,
    objective_name: str = "fom",
    direction: str = "minimize",
    prune: bool = False,
    prune_warmup: int = 3,
    goal: str | None = None,
    store: str | None = None,
    study_name: str | None = None,
    resume_study: str | None = None,
    seed: int = 0,
    say: Callable[[str], None] = print,
) -> StudyResult:
    """Minimise (or maximise) `objective` over `space`; trials are recorded in `store`
    (an SQLite run store) when given, and the study resumes with `resume_study`."""
    options = StudyOptions(
        space=space,
        searcher=searcher,
        trials=trials,
        objective=objective_name,
        direction=direction,
        prune=prune,
        prune_warmup=prune_warmup,
        goal=goal,
        study_name=study_name,
        resume_study=resume_study,
    )
    runner = StudyRunner(options, TrainOptions(seed=seed), FunctionExecutor(objective, objective_name), store, say)
    return runner.run()
