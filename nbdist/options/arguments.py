"""The options on a command line: argparse flags made from the option fields, the
options read back from them, and the saved options a --resume continues with."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from nbdist.errors import OptionsError
from nbdist.options.fields import _registry_help, field_kind, flag
from nbdist.options.study import StudyOptions
from nbdist.options.training import TrainOptions
from nbdist.registry import Registry
from nbdist.store import mask_url

__all__ = [
    "add_arguments",
    "add_study_arguments",
    "options_from_args",
    "study_options_from_args",
    "require_model",
    "model_file",
    "saved_run_options",
    "STUDY_SKIPS",
]


def add_arguments(
    parser: argparse.ArgumentParser,
    *,
    skip: tuple[str, ...] = (),
    config: type | None = None,
    registries: Mapping[str, Registry[Any]] | None = None,
) -> None:
    """Add every field of `config` (TrainOptions by default) to `parser` as --kebab-case flags.
    `registries`: by kind, those a field names by kind (default: Registry.named(kind))."""
    for f in fields(config or TrainOptions):
        if f.name in skip:
            continue
        meta = dict(f.metadata)
        helptext = meta.pop("help")
        registry, listed_default = meta.pop("registry", None), meta.pop("listed_default", None)
        if isinstance(registry, str) and registry in (registries or {}):
            registry = (registries or {})[registry]
        if registry is not None:
            # argparse formats help with %: a docstring's % must stay itself.
            helptext += ": " + _registry_help(registry, listed_default).replace("%", "%%")
        kind, _ = field_kind(f)
        if kind is bool:
            parser.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, default=None, help=helptext)
            continue
        if listed_default is None:  # a registry's list marks its default itself
            helptext += f" (default: {f.default})"
        parser.add_argument(flag(f.name), type=kind, default=None, help=helptext, **meta)


def options_from_args(args: argparse.Namespace, base: TrainOptions | None = None) -> TrainOptions:
    """Options given on the command line over `base`: by default the saved options of
    the run named by --resume, else the defaults. A resume fills its own ranks: the
    saved worker count was the old job's size (train/relayout.py)."""
    if base is None and getattr(args, "resume", None):
        base = saved_run_options(args.resume).replace(workers=None)
    given = {f.name: getattr(args, f.name) for f in fields(TrainOptions) if getattr(args, f.name, None) is not None}
    return (base or TrainOptions()).replace(**given).refuse_pipeline_options(given)


def require_model(options: TrainOptions, defines: str = "build_model()") -> TrainOptions:
    """`options`, or one error when they name no model file (the command line's run needs one)."""
    model_file(options, defines)
    return options


def model_file(options: TrainOptions, defines: str = "build_model()") -> str:
    """The model file `options` name, or one error when they name none."""
    if not options.model:
        raise OptionsError(f"--model is required: a Python file that defines {defines}")
    return options.model


def saved_run_options(run_dir: str | Path) -> TrainOptions:
    """The options a run directory was trained with (what --resume continues), or one
    error saying why `run_dir` is not a run directory."""
    saved = Path(run_dir) / "options.json"
    if not saved.parent.is_dir():
        problem = "no such directory" if not saved.parent.exists() else "a file, not a directory"
        raise OptionsError(
            f"--resume {run_dir}: {problem}; give a run directory (the one a run printed as "
            f"'results in RUNS_DIR/<run>')"
        )
    try:
        options = TrainOptions.from_dict(json.loads(saved.read_text()))
        # Runs of older versions saved a store URL with its password masked as ***: the
        # URL without it connects (libpq finds the password in PGPASSWORD or ~/.pgpass).
        return options.replace(store=options.store and mask_url(options.store, None))
    except FileNotFoundError:
        raise OptionsError(f"--resume {run_dir}: not a run directory (no options.json in it)") from None
    except (OSError, ValueError, TypeError) as exc:
        raise OptionsError(f"--resume {run_dir}: its options.json cannot be read ({exc})") from None


# What a study's trials cannot take from the command line: each trial's run has its own
# directory and name, and a study resumes with --resume-study.
STUDY_SKIPS = ("resume", "run_name")


def add_study_arguments(parser: argparse.ArgumentParser, searchers: Registry[Any] | None = None) -> None:
    """The study's options, then every training option a trial uses. `searchers`: the
    registry --searcher lists (nbdist.hpo.SEARCHERS; the options may not import it)."""
    add_arguments(parser, config=StudyOptions, registries={"searcher": searchers} if searchers else None)
    add_arguments(parser, skip=STUDY_SKIPS)


def study_options_from_args(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """The study options and the training options given on the command line (only those
    given: a resumed study keeps its saved ones for the rest; nbdist.hpo.resolve_options)."""
    study = {f.name: getattr(args, f.name) for f in fields(StudyOptions) if getattr(args, f.name, None) is not None}
    train = {
        f.name: getattr(args, f.name)
        for f in fields(TrainOptions)
        if f.name not in STUDY_SKIPS and getattr(args, f.name, None) is not None
    }
    return study, train
