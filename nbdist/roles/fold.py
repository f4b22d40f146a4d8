"""A trial as its ranks train it: every fold of the trial is one ordinary training run
(runner.run_rank) on that fold's communicator, with the trial's parameters applied and
the fold's share of the data. Batch studies (batch_study.py, study.py) and notebook
studies (engine.py) both end here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from nbdist.errors import UserError
from nbdist.hpo.runner import FoldOutcome
from nbdist.hpo.trial import fold_split, run_name, trial_options, watched_metrics, with_params
from nbdist.metrics.log import RecordSink
from nbdist.options import StudyOptions, TrainOptions
from nbdist.roles.runner import run_rank
from nbdist.train.context import MetricNameError, TrialTag
from nbdist.train.definition import ModelDefinition
from nbdist.train.stopping import StopFlag

__all__ = ["train_fold", "trial_definition"]


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
) -> FoldOutcome:
    """Collective over `comm` (the fold's ranks). The fold leader's outcome carries the
    run's final metrics; an error that every rank agreed on comes back on every rank.
    Anything else (a crash on one rank only) is raised: the caller decides."""

    def build() -> ModelDefinition:
        base = definition() if callable(definition) else definition
        return trial_definition(base, params, fold, options.folds, train.seed)

    try:
        run_options = trial_options(train, params).replace(run_name=run_name(study, number, fold), quiet=True)
        result = run_rank(
            run_options, build, comm, stop, sink, record, TrialTag(study, number, watched_metrics(options))
        )
    except MetricNameError as exc:  # every trial would fail the same way
        return FoldOutcome(error=str(exc), ends_study=True)
    except UserError as exc:
        return FoldOutcome(error=str(exc))
    if result is None:
        return FoldOutcome()
    return FoldOutcome(final=dict(result.final), stop_reason=result.stop_reason, run_id=result.run_dir.name)
