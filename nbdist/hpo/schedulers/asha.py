"""Multi-fidelity schedulers: asynchronous successive halving (ASHA, Li et al. 2018,
"A System for Massively Parallel Hyperparameter Tuning") and asynchronous Hyperband.

ASHA's rungs are min_epochs, min_epochs x reduction, min_epochs x reduction^2, ... and
max_epochs last. A new trial trains to the first rung and pauses there, keeping its
checkpoint. Whenever a group is free, the scheduler looks from the highest rung down for
a paused trial in the best 1/reduction of those that reached its rung and were not
promoted yet; that trial resumes from its checkpoint to the next rung (its epochs are not
trained again). With none to promote, a new trial starts. Trials never promoted end
"stopped" at their rung, with their value there.

Hyperband (Li et al. 2017) hedges over how aggressive the halving is: brackets of ASHA,
the first starting at min_epochs, each next one at `reduction` times the last's first
rung; new trials go to the brackets in the proportions of Hyperband's plan (many at the
cheapest rung, a few trained long from the start). Whatever searcher proposes the trials
(`bayes` or Optuna's TPE under hyperband is BOHB, Falkner et al. 2018).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from nbdist.hpo.schedulers.base import PAUSED, SCHEDULERS, Scheduler, SchedulerError, Setting, Work

__all__ = ["ASHA", "Hyperband", "rungs"]


def rungs(min_epochs: int, max_epochs: int, reduction: int) -> list[int]:
    """min_epochs x reduction^k below max_epochs, then max_epochs."""
    out, epochs = [], min_epochs
    while epochs < max_epochs:
        out.append(epochs)
        epochs *= reduction
    return [*out, max_epochs]


def _check(min_epochs: Any, max_epochs: Any, reduction: Any, name: str) -> None:
    for what, value, least in (("min_epochs", min_epochs, 1), ("reduction", reduction, 2)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise SchedulerError(f"{name} {what} must be an integer >= {least}, got {value!r}")
    if max_epochs is not None and (isinstance(max_epochs, bool) or not isinstance(max_epochs, int)):
        raise SchedulerError(f"{name} max_epochs must be an integer (default: --epochs), got {max_epochs!r}")


def _fit(name: str, min_epochs: int, max_epochs: int | None, setting: Setting) -> int:
    """max_epochs (default --epochs), checked against the study's epochs and min_epochs."""
    top = setting.epochs if max_epochs is None else max_epochs
    if top > setting.epochs:
        raise SchedulerError(
            f"{name}(max_epochs={top}): the trials train at most --epochs {setting.epochs}; give "
            f"max_epochs <= {setting.epochs} or --epochs {top}"
        )
    if min_epochs >= top:
        raise SchedulerError(
            f"{name}(min_epochs={min_epochs}) leaves no rung below max_epochs={top}: the rungs are "
            f"min_epochs x reduction^k up to max_epochs; give min_epochs < {top} (e.g. min_epochs=1) or "
            f"more --epochs"
        )
    return top


@SCHEDULERS.register
class ASHA(Scheduler):
    """Asynchronous successive halving: trials pause at rungs, the best 1/reduction resume."""

    name = "asha"
    parameter_help = {
        "min_epochs": "the first rung: every trial trains this many epochs",
        "max_epochs": "the last rung (default: --epochs)",
        "reduction": "the best 1/reduction of a rung's trials go on to the next, reduction times longer",
    }
    pauses = True

    def __init__(self, min_epochs: int = 1, max_epochs: int | None = None, reduction: int = 3):
        _check(min_epochs, max_epochs, reduction, self.name)
        self.min_epochs, self.max_epochs, self.reduction = min_epochs, max_epochs, reduction
        self.ladder: list[int] = []
        self.values: list[dict[int, float]] = []  # per rung: trial -> its value there
        self.promoted: list[set[int]] = []  # per rung: trials that went on from it
        self.done: set[int] = set()  # trials that failed or were stopped: never promoted

    def bind(self, setting: Setting) -> None:
        super().bind(setting)
        top = _fit(self.name, self.min_epochs, self.max_epochs, setting)
        self._ladder(rungs(self.min_epochs, top, self.reduction))

    def _ladder(self, ladder: list[int]) -> None:
        self.ladder = ladder
        self.values = [{} for _ in ladder]
        self.promoted = [set() for _ in ladder]

    @property
    def epochs(self) -> int:
        return self.ladder[-1]

    def promotable(self, epochs_left: float) -> Work | None:
        """The paused trial to promote, from the highest rung down, if any."""
        for k in range(len(self.ladder) - 2, -1, -1):
            if self.ladder[k + 1] - self.ladder[k] > epochs_left:
                continue
            reached = self.values[k]
            best = sorted(reached, key=lambda n: reached[n], reverse=self.setting.maximize)
            for number in best[: len(reached) // self.reduction]:
                if number not in self.promoted[k] and number not in self.done:
                    self.promoted[k].add(number)
                    return Work(number, self._pause_after(k + 1))
        return None

    def _pause_after(self, k: int) -> int | None:
        return self.ladder[k] if k < len(self.ladder) - 1 else None

    def next(self, new_allowed: bool, epochs_left: float) -> Work | None:
        fits = new_allowed and self.ladder[0] <= epochs_left
        return self.promotable(epochs_left) or (Work(None, self._pause_after(0)) if fits else None)

    def reached(self, number: int, epochs: int, value: float | None, outcome: str) -> None:
        if outcome != PAUSED:
            self.done.add(number)
            return
        if value is not None and epochs in self.ladder:
            self.values[self.ladder.index(epochs)][number] = value

    def describe(self, number: int, epochs: int) -> str:
        return f"rung {self.ladder.index(epochs)} (epoch {epochs})" if epochs in self.ladder else f"epoch {epochs}"

    def notes(self) -> list[str]:
        # A rung passes on floor(reached / reduction) trials, so of n trials n // reduction^k
        # reach rung k: the last rung needs reduction^(rungs - 1) trials for one to get there.
        trials, needed = self.setting.trials, self.reduction ** (len(self.ladder) - 1)
        if trials >= needed:
            return []
        ladder = ", ".join(map(str, self.ladder))
        fewer = [
            m for m in self.ladder[1:-1] if self.reduction ** (len(rungs(m, self.epochs, self.reduction)) - 1) <= trials
        ]
        instead = f", or fewer rungs: asha(min_epochs={fewer[0]})" if fewer else ""
        return [
            f"asha(min_epochs={self.min_epochs}, reduction={self.reduction}) over rungs {ladder} with {trials} "
            f"trials: none can reach the last rung, so no trial will train all {self.epochs} epochs (a rung "
            f"passes on its best 1/{self.reduction}: the last needs {needed} trials); give --trials {needed}{instead}"
        ]

    def state(self) -> dict[str, Any]:
        return {
            "values": [{str(n): v for n, v in rung.items()} for rung in self.values],
            "promoted": [sorted(rung) for rung in self.promoted],
            "done": sorted(self.done),
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        values, promoted = state.get("values", []), state.get("promoted", [])
        for k in range(min(len(self.ladder), len(values))):
            self.values[k] = {int(n): float(v) for n, v in values[k].items()}
            self.promoted[k] = {int(n) for n in promoted[k]}
        self.done = {int(n) for n in state.get("done", [])}


@SCHEDULERS.register
class Hyperband(Scheduler):
    """Asynchronous Hyperband: brackets of ASHA, from aggressive halving to none."""

    name = "hyperband"
    parameter_help = ASHA.parameter_help
    pauses = True

    def __init__(self, min_epochs: int = 1, max_epochs: int | None = None, reduction: int = 3):
        _check(min_epochs, max_epochs, reduction, self.name)
        self.min_epochs, self.max_epochs, self.reduction = min_epochs, max_epochs, reduction
        self.brackets: list[ASHA] = []
        self.weights: list[int] = []  # Hyperband's trials per bracket
        self.bracket_of: dict[int, int] = {}
        self.counts: list[int] = []  # trials started per bracket

    def bind(self, setting: Setting) -> None:
        super().bind(setting)
        top = _fit(self.name, self.min_epochs, self.max_epochs, setting)
        s_max = int(math.floor(math.log(top / self.min_epochs, self.reduction) + 1e-9))
        self.brackets = []
        for s in range(s_max + 1):
            bracket = ASHA(self.min_epochs, top, self.reduction)
            Scheduler.bind(bracket, setting)
            start = self.min_epochs * self.reduction**s
            bracket._ladder([e for e in rungs(self.min_epochs, top, self.reduction) if e >= start])
            self.brackets.append(bracket)
            # Hyperband's n for the bracket whose first budget is R / reduction^(s_max - s).
            self.weights.append(math.ceil((s_max + 1) / (s_max - s + 1) * self.reduction ** (s_max - s)))
        self.counts = [0] * len(self.brackets)

    @property
    def epochs(self) -> int:
        return self.brackets[0].epochs

    def next(self, new_allowed: bool, epochs_left: float) -> Work | None:
        for bracket in self.brackets:
            work = bracket.promotable(epochs_left)
            if work is not None:
                return work
        if not new_allowed:
            return None
        fitting = [b for b in range(len(self.brackets)) if self.brackets[b].ladder[0] <= epochs_left]
        if not fitting:
            return None
        chosen = self._behind(self.counts, fitting)
        return Work(None, self.brackets[chosen]._pause_after(0), tag=chosen)

    def _behind(self, counts: list[int], fitting: list[int]) -> int:
        """The bracket furthest behind its share of Hyperband's plan, given the trials started in each."""
        total, started = sum(self.weights), sum(counts) + 1
        lag = [w / total * started - c for w, c in zip(self.weights, counts, strict=True)]
        return max(fitting, key=lambda b: (lag[b], -b))

    def _fewest_trials_completing(self) -> int:
        """The fewest new trials that, shared out as `next` does, bring one to a bracket's
        last rung: trials are added one at a time until a bracket has reduction^(rungs - 1)."""
        counts = [0] * len(self.brackets)
        needed = [self.reduction ** (len(bracket.ladder) - 1) for bracket in self.brackets]
        every = list(range(len(self.brackets)))
        while not any(c >= n for c, n in zip(counts, needed, strict=True)):
            counts[self._behind(counts, every)] += 1
        return sum(counts)

    def notes(self) -> list[str]:
        trials, needed = self.setting.trials, self._fewest_trials_completing()
        if trials >= needed:
            return []
        return [
            f"hyperband(min_epochs={self.min_epochs}, reduction={self.reduction}) with {trials} trials: no bracket "
            f"gets enough of them for one to reach its last rung, so no trial will train all {self.epochs} epochs; "
            f"give --trials {needed}"
        ]

    def started(self, number: int, work: Work) -> None:
        if work.trial is None and work.tag is not None:
            self.bracket_of[number] = work.tag
            self.counts[work.tag] += 1

    def reached(self, number: int, epochs: int, value: float | None, outcome: str) -> None:
        bracket = self.bracket_of.get(number)
        if bracket is not None:
            self.brackets[bracket].reached(number, epochs, value, outcome)

    def describe(self, number: int, epochs: int) -> str:
        bracket = self.bracket_of.get(number)
        where = self.brackets[bracket].describe(number, epochs) if bracket is not None else f"epoch {epochs}"
        return f"bracket {bracket}, {where}" if bracket is not None else where

    def state(self) -> dict[str, Any]:
        return {
            "brackets": [b.state() for b in self.brackets],
            "bracket_of": {str(n): b for n, b in self.bracket_of.items()},
            "counts": list(self.counts),
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        for bracket, saved in zip(self.brackets, state.get("brackets", []), strict=False):
            bracket.load_state(saved)
        self.bracket_of = {int(n): int(b) for n, b in state.get("bracket_of", {}).items()}
        self.counts = [int(c) for c in state.get("counts", self.counts)]
