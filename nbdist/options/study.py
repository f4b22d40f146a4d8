"""StudyOptions: a hyper-parameter study's own options, beside the TrainOptions each of
its trials trains with."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

from nbdist.errors import OptionsError
from nbdist.options.fields import _opt, check_types, flag
from nbdist.options.target import parse_target

__all__ = ["StudyOptions", "DIRECTIONS"]

DIRECTIONS = ("minimize", "maximize")


@dataclass
class StudyOptions:
    """A study's own options; each trial trains with the TrainOptions given beside them
    (the parameters named like TrainOptions fields override those per trial)."""

    space: str | None = _opt(
        None,
        'the search space, e.g. "lr=log(1e-4,1e-1) hidden=int(16,256) '
        'optimizer=cat(adam,sgd,rmsprop)"; kinds: real/uniform, log, int, logint, cat',
    )
    searcher: str = _opt(
        "bayes",
        "how the trials' points are chosen, optionally with parameters, e.g. 'evolution(population=20)'",
        registry="searcher",  # nbdist.hpo.searcher.SEARCHERS (nbdist.hpo imports the options)
        listed_default="bayes",
    )
    trials: int = _opt(20, "trials in all (the study's budget)")
    groups: int = _opt(1, "trials trained at once, each on its own group of ranks")
    folds: int = _opt(1, "K-fold cross-validation: folds per trial, trained in parallel, fom = their mean")
    objective: str = _opt(
        "val_loss",
        "the figure of merit: a metric of the trial's last epoch; several, comma-separated, make a "
        "multi-objective study (val_acc,params) whose result is a Pareto front: any recorded metric, params "
        "(the model's parameter count) or a function of the trained model in the model file's `objectives` dict",
    )
    direction: str | None = _opt(
        None,
        "minimize or maximize the objective (default: maximize accuracies and AUCs, minimize the rest); "
        "one per objective, comma-separated, in a multi-objective study",
    )
    goal: str | None = _opt(None, "stop the study when a trial reaches this, e.g. 'val_acc > 0.98'")
    prune: bool = _opt(
        False, "median pruner: stop a trial that is worse than the median of earlier trials at the same epoch"
    )
    prune_warmup: int = _opt(3, "trials that must have finished before the pruner stops any")
    scheduler: str = _opt(
        "fifo",
        "how the trials share the groups' epochs: fifo (each trains all its epochs), "
        "median(warmup_trials=3, warmup_epochs=1) (what --prune sets), asha(min_epochs=1, max_epochs=--epochs, "
        "reduction=3), hyperband(min_epochs=1, max_epochs=--epochs, reduction=3), pbt(interval=1, "
        "quantile=0.25, perturb=0.2, resample=0.25) or pb2(interval=1, quantile=0.25)",
    )
    budget_epochs: int | None = _opt(
        None, "the study's budget in training epochs, over all its trials: no trial starts or goes on past it"
    )
    budget_time: float | None = _opt(
        None, "the study's budget in seconds: no trial starts after it, and the running ones stop"
    )
    study_name: str | None = _opt(None, "the study's name in the run store (default: time and searcher)")
    resume_study: str | None = _opt(
        None, "a study to continue (its name): unfinished trials are trained again, finished ones are kept"
    )

    def validate(self) -> StudyOptions:
        check_types(self)
        if not self.space and not self.resume_study:
            raise OptionsError('a study needs --space, e.g. --space "lr=log(1e-4,1e-1) hidden=int(16,256)"')
        for name in ("trials", "groups", "folds"):
            if int(getattr(self, name)) < 1:
                raise OptionsError(f"{flag(name)} must be at least 1, got {getattr(self, name)}")
        if self.prune_warmup < 1:
            raise OptionsError(f"--prune-warmup must be at least 1, got {self.prune_warmup}")
        if self.budget_epochs is not None and self.budget_epochs < 1:
            raise OptionsError(f"--budget-epochs must be at least 1, got {self.budget_epochs}")
        if self.budget_time is not None and self.budget_time <= 0:
            raise OptionsError(f"--budget-time must be a number of seconds above 0, got {self.budget_time}")
        scheduler = self.scheduler.split("(")[0].strip().lower()
        if self.prune and scheduler not in ("fifo", "median"):
            raise OptionsError(
                f"--prune sets the median pruner, and --scheduler {scheduler} stops trials itself: drop --prune"
            )
        objectives = self.objectives
        if len(set(objectives)) != len(objectives) or not all(objectives):
            raise OptionsError(f"--objective {self.objective!r}: name each objective once, e.g. val_acc,params")
        if self.direction is not None:
            given = [d.strip() for d in self.direction.split(",")]
            wrong = [d for d in given if d not in DIRECTIONS]
            if wrong:
                raise OptionsError(f"--direction must be minimize or maximize, got {wrong[0]!r}")
            if len(given) != len(objectives):
                example = ",".join(_direction_of(o) for o in objectives)
                raise OptionsError(
                    f"--direction {self.direction!r} gives {len(given)} direction{'s' if len(given) > 1 else ''} "
                    f"for {len(objectives)} objective{'s' if len(objectives) > 1 else ''} "
                    f"({', '.join(objectives)}): give one per objective, e.g. --direction {example}"
                )
        if self.goal is not None:
            parse_target(self.goal, "--goal")
        if self.study_name is not None and "/" in self.study_name:
            raise OptionsError(
                f"--study-name {self.study_name!r}: its trials' run directories are named after it; "
                f"give a name without '/'"
            )
        return self

    @property
    def objectives(self) -> list[str]:
        """--objective's names (several: a multi-objective study)."""
        return [name.strip() for name in self.objective.split(",")]

    @property
    def resolved_directions(self) -> list[str]:
        """Each objective's direction: as given, or by its name."""
        if self.direction:
            return [d.strip() for d in self.direction.split(",")]
        return [_direction_of(name) for name in self.objectives]

    @property
    def resolved_direction(self) -> str:
        return ",".join(self.resolved_directions)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> StudyOptions:
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise OptionsError(f"unknown study option(s): {', '.join(unknown)}")
        return cls(**values)

    def replace(self, **changes: Any) -> StudyOptions:
        return dataclasses.replace(self, **changes)


def _direction_of(objective: str) -> str:
    name = objective.lower()
    return "maximize" if "acc" in name or name.endswith("auc") else "minimize"
