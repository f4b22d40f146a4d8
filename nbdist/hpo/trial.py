"""One trial: its parameters applied to a training run, its folds, its figure of merit.

A trial's parameters reach the training three ways:
- every parameter goes to the model's builders that take an argument:
  `def build_model(params): ... params["hidden"] ...` (build_generator and
  build_discriminator likewise; a builder without an argument ignores them);
- a parameter named like a training option sets it for the trial (`batch_size`,
  `epochs`, `sync_every`, `algorithm`, `worker_optimizer`, ...);
- a parameter named like one of the update rule's (`elastic_force` of easgd) sets it;
- `optimizer`, `lr` and `momentum` go to the part that trains with them: the workers'
  optimiser (allreduce, EASGD, ADAG, DynSGD, Downpour with local steps), the master's
  for Downpour pushing every batch, and for GEM, which has no optimiser, its own `lr`
  and `momentum` (`--algorithm "gem(lr=..., momentum=...)"`; an `optimizer` parameter
  is an error there). What the study does not set keeps the options' value; another
  optimiser starts from its own defaults. An optimiser without momentum (adam) given
  `momentum` fails its trials with the optimiser's error, which names both.

K-fold cross-validation splits the training set into `folds` parts, stratified by label
for classification; fold f validates on part f and trains on the rest. The validation
set the data came with is left for the user's final evaluation.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import re
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nbdist.algorithms import RULES, Algorithm
from nbdist.errors import UserError
from nbdist.hpo.space_input import parse_space
from nbdist.layout import Layout
from nbdist.options import StudyOptions, TrainOptions, parse_target
from nbdist.specs import parse_spec
from nbdist.store import store_path
from nbdist.train.stopping import PAUSED_AT, pause_reason


def exploit_label(epoch: int) -> str:
    """The checkpoint that a trial's run takes another trial's state into (PBT)."""
    return f"exploit-{epoch:04d}"


__all__ = [
    "Trial",
    "Segment",
    "TrialError",
    "PAUSED_AT",
    "pause_reason",
    "exploit_label",
    "changeable",
    "CHANGEABLE_HELP",
    "trial_options",
    "with_params",
    "takes_params",
    "study_layout",
    "fold_split",
    "fold_fom",
    "run_name",
    "fold_of_run",
    "watched_metrics",
    "check_study",
]

OPTIMIZER_PARAMS = ("optimizer", "lr", "momentum")
# The numeric ones, passed as arguments of the optimiser (or of GEM).
STEP_PARAMS = ("lr", "momentum")


class TrialError(UserError):
    """A study's settings that cannot make a trial (the message says which)."""


@dataclass(slots=True)
class Trial:
    number: int
    params: dict[str, Any]
    generation: int | None = None
    group: int | None = None
    started: float | None = None
    # Per epoch, per fold: the objective as the trial went (the scheduler's evidence).
    curve: dict[int, dict[int, float]] = field(default_factory=dict)
    pruned_at: int | None = None  # the epoch after which the scheduler stopped it
    stop_reason: str = ""  # why the study stopped it ('' while nothing did)
    epochs: int = 0  # the epochs it trained, as its checkpoint holds them
    value: float | None = None  # the objective after `epochs`, mean over its folds
    runs: dict[int, str] = field(default_factory=dict)  # fold -> its run's directory name
    asked: dict[str, Any] | None = None  # the parameters the searcher gave (PBT changes `params`)

    @property
    def placed(self) -> int:
        """The group the trial runs or last ran on (a trial started has one)."""
        if self.group is None:
            raise RuntimeError(f"trial {self.number} has not run on a group")
        return self.group

    def mean_at(self, epoch: int) -> float | None:
        values = self.curve.get(epoch)
        return statistics.fmean(values.values()) if values else None


@dataclass(slots=True)
class Segment:
    """What a group trains of a trial: from its checkpoint after `start` epochs (0: from
    scratch) until `pause_at` (None: its last epoch, `epochs`), answering to the study at
    each epoch when `gated`. PBT's exchange: first take the state of the trial
    `receive_from` = (group, trial) as it was after `exchange_epoch`, or send this trial's
    to the groups `send_to`."""

    start: int
    epochs: int
    pause_at: int | None = None
    gated: bool = False
    runs: dict[int, str] = field(default_factory=dict)  # fold -> the run directory to resume
    receive_from: tuple[int, int] | None = None
    send_to: list[int] = field(default_factory=list)
    exchange_epoch: int | None = None
    receivers: list[int] = field(default_factory=list)  # the trials of the groups `send_to`

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Segment:
        values = dict(values)
        values["runs"] = {int(f): r for f, r in values.get("runs", {}).items()}
        if values.get("receive_from") is not None:
            values["receive_from"] = tuple(values["receive_from"])
        return cls(**values)


def run_name(study: str, number: int, fold: int) -> str:
    return f"{study}-trial{number:04d}-fold{fold}"


_FOLD = re.compile(r"-trial(\d+)-fold(\d+)(?:-\d+)?$")


def fold_of_run(run_id: str) -> tuple[int, int] | None:
    """(trial, fold) of a study's run, from its name (a re-run gets a -N suffix)."""
    match = _FOLD.search(run_id)
    return (int(match.group(1)), int(match.group(2))) if match else None


def watched_metrics(options: StudyOptions) -> tuple[tuple[str, str], ...]:
    """The metrics the study reads from its runs, with the options that name them: each
    run checks during set-up that it reports them (nbdist.train.trial.check_metric_names)."""
    watched = [(f"--objective {options.objective}", name) for name in options.objectives]
    if options.goal:
        watched.append((f"--goal {options.goal!r}", parse_target(options.goal, "--goal").metric))
    return tuple(watched)


def trial_options(options: TrainOptions, params: dict[str, Any]) -> TrainOptions:
    """The training options of one trial: `options` with the parameters that name them."""
    names = {f.name for f in dataclasses.fields(TrainOptions)}
    changes = {k: v for k, v in params.items() if k in names}
    own = {k: v for k, v in params.items() if k in _rule_parameters(options.replace(**changes))}
    if own:
        spec = parse_spec(str(options.replace(**changes).algorithm), what="--algorithm")
        args = ", ".join(f"{k}={v!r}" for k, v in {**spec.kwargs, **own}.items())
        changes["algorithm"] = f"{spec.name}({args})"
    if any(k in params for k in OPTIMIZER_PARAMS):
        trial = options.replace(**changes)
        target = _optimizer_option(trial)
        if target == "algorithm":
            changes[target] = _rule_with_params(str(trial.algorithm), params)
        else:
            current = getattr(trial, target) or _default_optimizer(target)
            spec = parse_spec(current, what=f"--{target.replace('_', '-')}")
            name = str(params.get("optimizer", spec.name))
            kwargs = {} if name != spec.name else dict(spec.kwargs)  # another optimiser: its own defaults
            changes[target] = _spec_text(name, kwargs, params)
    return options.replace(**changes)


def _rule_parameters(options: TrainOptions) -> set[str]:
    """The update rule's own parameters that a study's parameter may set (not GEM's lr and
    momentum, which go with the optimiser parameters)."""
    if options.topology != "master-worker" or not options.algorithm:
        return set()
    name = parse_spec(options.algorithm, what="--algorithm").name
    rule = RULES.get(name) if name in RULES else None
    if rule is None or not issubclass(rule, Algorithm):
        return set()
    return set(inspect.signature(rule.__init__).parameters) - {"self", "params", *STEP_PARAMS}


# What PBT may change while a trial trains: the weights it copies must fit the receiver.
CHANGEABLE_HELP = "lr, momentum, dropout (any parameter whose name says dropout) and the update rule's own parameters"


def changeable(name: str, options: TrainOptions) -> bool:
    """Whether parameter `name` can change between two segments of a run: it sets the
    optimiser's step, the rule's own parameters or a dropout rate, none of which shapes
    the weights, the optimiser's state or the data's order."""
    return name in STEP_PARAMS or "dropout" in name.lower() or name in _rule_parameters(options)


def _spec_text(name: str, kwargs: dict[str, Any], params: dict[str, Any]) -> str:
    kwargs = {**kwargs, **{k: float(params[k]) for k in STEP_PARAMS if k in params}}
    args = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
    return f"{name}({args})"


def _rule_with_params(algorithm: str, params: dict[str, Any]) -> str:
    """GEM's own lr and momentum: it has no optimiser to take them."""
    spec = parse_spec(algorithm, what="--algorithm")
    if "optimizer" in params:
        raise TrialError(
            f"the study's parameter 'optimizer' does not apply to {spec.name}: its workers take no "
            f"optimizer but step with its own lr and momentum; tune those (e.g. --space "
            f'"lr=log(1e-3,1e-1) momentum=real(0.5,0.99)")'
        )
    return _spec_text(spec.name, dict(spec.kwargs), params)


def _optimizer_option(options: TrainOptions) -> str:
    """Which part trains with the optimiser parameters: a rule without optimisers (GEM)
    itself, Downpour pushing every batch its master's optimiser, else the workers'."""
    if options.topology != "master-worker":
        return "worker_optimizer"
    name = parse_spec(options.algorithm or "downpour", what="--algorithm").name
    rule = RULES.get(name) if name in RULES else None
    if rule is None or not issubclass(rule, Algorithm):  # the run's set-up names the valid ones
        return "worker_optimizer"
    if not (rule.uses_worker_optimizer or rule.uses_master_optimizer):
        return "algorithm"
    if rule.uses_master_optimizer and (options.sync_every or rule.default_sync_every) == 1:
        return "master_optimizer"
    return "worker_optimizer"


def _default_optimizer(option: str) -> str:
    from nbdist.train.context import DEFAULT_MASTER_OPTIMIZER, DEFAULT_WORKER_OPTIMIZER

    return DEFAULT_MASTER_OPTIMIZER if option == "master_optimizer" else DEFAULT_WORKER_OPTIMIZER


def takes_params(build: Callable[..., Any]) -> bool:
    """Whether a model builder takes an argument: the trial's parameters."""
    try:
        return len(inspect.signature(build).parameters) > 0
    except (TypeError, ValueError):  # a builtin or a class without a signature
        return False


def with_params(build: Callable[..., Any] | None, params: dict[str, Any]) -> Callable[[], Any] | None:
    """A no-argument builder that passes `params` to `build` when it takes an argument."""
    if build is None:
        return None
    return (lambda: build(params)) if takes_params(build) else build


def fold_split(data: Any, fold: int, folds: int, seed: int) -> Any:
    """Fold `fold` of `folds` over the training set: train on the other parts, validate on this one."""
    from nbdist.data.arrays import ArrayData

    if folds == 1:
        return data
    if not isinstance(data, ArrayData):
        raise TrialError(
            f"K-fold cross-validation (--folds {folds}) needs data in memory (load_data() returning "
            f"an ArrayData); with --train files, use --folds 1"
        )
    y = data.y_train
    classes = np.issubdtype(y.dtype, np.integer) and y.ndim == 1
    if classes:
        from sklearn.model_selection import StratifiedKFold

        splitter: Any = StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)
    else:
        from sklearn.model_selection import KFold

        splitter = KFold(n_splits=folds, shuffle=True, random_state=seed)
    try:
        train, val = list(splitter.split(data.x_train, y if classes else None))[fold]
    except ValueError as exc:
        raise TrialError(f"cannot split {data.n_train} training samples into {folds} folds: {exc}") from None
    return ArrayData(
        data.x_train[train],
        y[train],
        data.x_train[val],
        y[val],
        name=f"{data.name} fold {fold + 1}/{folds}",
        num_classes=data.num_classes,
    )


def fold_fom(final: dict[str, Any], objective: str) -> float:
    """The objective in a fold run's final metrics (a missing or non-finite one fails the fold)."""
    if objective not in final:
        known = ", ".join(sorted(k for k in final if k.startswith(("val_", "train_")))) or "none"
        raise TrialError(
            f"the objective {objective!r} is not a metric of the runs (they have: {known}); choose one with --objective"
        )
    value = final[objective]
    if value is None or not math.isfinite(float(value)):
        raise TrialError(f"the objective {objective} is {value}")
    return float(value)


def study_layout(study: StudyOptions, train: TrainOptions, ranks: int) -> Layout:
    """The layout of a batch study on `ranks` MPI ranks: rank 0 coordinates, the others
    train in groups x folds runs (LayoutError when `ranks` cannot hold them)."""
    return Layout.for_world(
        ranks,
        workers=train.workers,
        masters=train.masters,
        procs_per_worker=train.procs_per_worker,
        topology=train.topology,
        groups=study.groups,
        folds=study.folds,
        coordinator=True,
    )


def check_study(study: StudyOptions, train: TrainOptions) -> None:
    """What can be wrong before any rank trains (every rank checks the same)."""
    study.validate()
    train.validate()
    if study.space:
        parse_space(study.space)
    if study.folds > 1 and train.train:
        raise TrialError(
            f"K-fold cross-validation (--folds {study.folds}) needs data in memory; with --train files, use --folds 1"
        )
    if study.resume_study and store_path(train.store, train.runs_dir) is None:
        raise TrialError("--resume-study needs the run store the study was recorded in (not --store off)")
