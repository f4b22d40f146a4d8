"""A study's options as given, saved and resumed, and its name.

The options of a resumed study are those it was started with (its space, groups, budget,
...), with what is given anew over them.
"""

from __future__ import annotations

import time
from typing import Any

from nbdist.errors import UserError
from nbdist.options import StudyOptions, TrainOptions
from nbdist.specs import parse_spec
from nbdist.store import RunStore, store_path

__all__ = ["StudyError", "resolve_options", "saved_options", "new_study_name", "scheduler_spec"]


class StudyError(UserError):
    pass


def resolve_options(study: dict[str, Any], train: dict[str, Any]) -> tuple[StudyOptions, TrainOptions]:
    """The options of a study from those given: over the defaults, or over the saved
    options of the study that --resume-study names (its budget, space, groups, ...)."""
    try:
        base_study, base_train = StudyOptions(), TrainOptions()
        if study.get("resume_study"):
            given_train = base_train.replace(**train)
            base_study, base_train = saved_options(
                store_path(given_train.store, given_train.runs_dir), study["resume_study"]
            )
        return base_study.replace(**study), base_train.replace(**train).refuse_pipeline_options(train)
    except TypeError as exc:
        raise StudyError(str(exc)) from None


def saved_options(store: str | None, name: str) -> tuple[StudyOptions, TrainOptions]:
    """The options a study was started with (a resumed study keeps them unless given anew)."""
    if store is None:
        raise StudyError("--resume-study needs the run store the study was recorded in (not --store off)")
    with RunStore(store, create=False) as opened:
        saved = opened.study(name)["options"] or {}
    if "study" not in saved:
        raise StudyError(f"study {name!r} in {store} has no saved options: it cannot be resumed")
    known = set(StudyOptions.__dataclass_fields__)
    return StudyOptions.from_dict({k: v for k, v in saved["study"].items() if k in known}), TrainOptions.from_dict(
        saved["train"]
    )


def new_study_name(options: StudyOptions) -> str:
    return options.study_name or f"{time.strftime('%Y%m%d-%H%M%S')}-{options.searcher.split('(')[0]}"


def scheduler_spec(options: StudyOptions) -> str:
    """--scheduler, or the median pruner that --prune asks for."""
    name = parse_spec(options.scheduler, what="--scheduler").name
    if options.prune and name == "fifo":
        return f"median(warmup_trials={options.prune_warmup})"
    return options.scheduler
