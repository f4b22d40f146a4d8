"""A trial as its ranks train it: every fold of the trial is one ordinary training run
(runner.run_rank) on that fold's communicator, with the trial's parameters applied and
the fold's share of the data. Batch studies (batch_study.py, study.py) and notebook
studies (engine.py) both end here.

A trial trained in segments (a scheduler paused it at a rung, or between PBT intervals)
goes on in the same run directory, from its checkpoint: the run resumes as `--resume`
would, so its epochs are never trained twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nbdist.errors import UserError
from nbdist.hpo.executor import FoldOutcome
from nbdist.hpo.trial import Segment, fold_split, run_name, trial_options, watched_metrics, with_params
from nbdist.metrics.log import RecordSink
from nbdist.options import StudyOptions, TrainOptions
from nbdist.roles.runner import run_rank
from nbdist.train.checkpoint import Checkpoints
from nbdist.train.context import MetricNameError, TrialTag
from nbdist.train.definition import ModelDefinition
from nbdist.train.stopping import StopFlag

__all__ = ["train_fold", "trial_definition", "fold_run_dir"]


def trial_definition(
    base: ModelDefinition, params: dict[str, Any], fold: int, folds: int, seed: int
) -> ModelDefinition:
    """The user's definition with the trial's parameters in its builders and the fold's
    data (the same split for every trial, so that their figures of merit compare)."""

    def data() -> Any:
        return fold_split(base.make_data(), fold, folds, seed)

    return dataclasses.replace(
        base,
        build_model=with_params(base.build_model, params),
        build_generator=with_params(base.build_generator, params),
        build_discriminator=with_params(base.build_discriminator, params),
        data=data if folds > 1 else base.data,
    )


def train_fold(
    study: str,
    number: int,
    params: dict[str, Any],
    train: TrainOptions,
    options: StudyOptions,
    definition: ModelDefinition | Callable[[], ModelDefinition],
    comm: Any,
    fold: int,
    stop: StopFlag,
    sink: RecordSink | None = None,
    record: bool = True,
    segment: Segment | None = None,
    ask: Callable[[int, dict], str] | None = None,
    asks: bool = False,
    keep: Callable[[str, dict, dict], None] | None = None,
) -> FoldOutcome:
    """Collective over `comm` (the fold's ranks). The fold leader's outcome carries the
    run's final metrics; an error that every rank agreed on comes back on every rank.
    Anything else (a crash on one rank only) is raised: the caller decides. `segment`:
    how far to train, and the run to go on from; `ask`: the fold leader's line to the
    study at each epoch's end, and `asks` on every rank whether the leader has one; `keep`:
    gets this rank's checkpoint shares."""

    def build() -> ModelDefinition:
        base = definition() if callable(definition) else definition
        return trial_definition(base, params, fold, options.folds, train.seed)

    segment = segment or Segment(start=0, epochs=train.epochs)
    try:
        run_options = trial_options(train, params).replace(
            run_name=run_name(study, number, fold), quiet=True, epochs=segment.epochs
        )
        resume = fold_run_dir(train, segment, fold)
        if resume is not None:
            run_options = run_options.replace(resume=str(resume))
        tag = TrialTag(
            study,
            number,
            watched_metrics(options),
            pause_at=segment.pause_at,
            asks=asks,
            ask=ask,
            keep=keep,
        )
        result = run_rank(run_options, build, comm, stop, sink, record, tag)
    except MetricNameError as exc:  # every trial would fail the same way
        return FoldOutcome(error=str(exc), ends_study=True)
    except UserError as exc:
        return FoldOutcome(error=str(exc))
    if result is None:
        return FoldOutcome()
    return FoldOutcome(final=dict(result.final), stop_reason=result.stop_reason, run_id=result.run_dir.name)


def fold_run_dir(train: TrainOptions, segment: Segment, fold: int) -> Path | None:
    """The run directory the fold goes on in: its run's, when it has a checkpoint."""
    name = segment.runs.get(fold)
    if not name:
        return None
    path = Path(train.runs_dir) / name
    return path if Checkpoints(path).latest() is not None else None
