"""The checks a launch runs before training, run where a job script is written.

`python -m nbdist slurm-script -n 8 ... -- train ...` promises that a bad option fails
when the script is written, not after the job waited in the queue. A launched command
checks its input in three places: the command line (cli.py's parser), a study's own
options and its layout on the ranks (`check_study`, `study_layout`, and the
unread-parameter check its coordinator makes), and every rank's set-up
(`nbdist.train.settle.settle`: the options, the layout against the rank count, the
rules, the model file, its data, the optimisers, the metrics named). This module calls
those same functions, for the job's rank count, in this process, as the job's rank 0
would: nothing is checked twice over in two ways.

The model is built on this machine's CPU, whatever --device says, and what depends on
the nodes that train (their GPUs, the runs directory) is left to them. Paths in the
command are read from the job's working directory, as the job will read them.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from nbdist.backends import DeviceRequest
from nbdist.errors import UserError
from nbdist.hpo.reads import check_space_is_read
from nbdist.hpo.runner import resolve_options
from nbdist.hpo.space_input import parse_space
from nbdist.hpo.trial import check_study, study_layout, trial_options, watched_metrics
from nbdist.options import model_file, options_from_args, study_options_from_args
from nbdist.roles.fold import trial_definition
from nbdist.train.context import TrialTag, settle
from nbdist.train.definition import load_model_file

__all__ = ["check_launched"]

# The model is built where the script is written: on the CPU (a login node has no GPU).
HERE = DeviceRequest("cpu", 0)


def check_launched(args: argparse.Namespace, ranks: int, workdir: Path) -> list[str]:
    """Run the set-up checks of the nbdist command `args` (parsed) on `ranks` ranks, from
    `workdir`; UserError for the first problem. Returns the warnings its set-up gives."""
    if not workdir.is_dir():
        raise UserError(f"--chdir {workdir}: no such directory; give the job's working directory")
    try:
        with _working_in(workdir):
            if args.command == "train":
                return _check_train(args, ranks)
            if args.command == "study":
                return _check_study(args, ranks)
            if args.command == "scale":
                return _check_scale(args, ranks)
            return []  # datasets: its options are all the parser's
    except UserError as exc:
        raise UserError(
            f"the job would fail before training (checked here, before it waits in the queue): {exc}"
        ) from None


def _check_train(args: argparse.Namespace, ranks: int) -> list[str]:
    options = options_from_args(args)
    model = model_file(options)
    settled = settle(options, lambda: load_model_file(model), ranks, 0, HERE, here=False)
    settled.data.close()
    return [n.text for n in settled.notices if n.warning]


def _check_scale(args: argparse.Namespace, ranks: int) -> list[str]:
    """What `scale` checks before it calibrates: its options and rank counts, the model
    file and its data, and the model built once as its ranks build it."""
    from nbdist.scaling.options import ScaleOptions
    from nbdist.scaling.probes import build_backend
    from nbdist.scaling.sweep import check_rank_counts, scaled_definition

    options = ScaleOptions.from_args(args).validate()
    check_rank_counts(options, ranks)
    definition = scaled_definition(options)
    data = definition.make_data()
    try:
        build_backend(definition, data, options.threads, options.seed)
    except UserError:
        raise
    except Exception as exc:  # the user's model code: named, as a run's set-up names it
        raise UserError(f"building the model failed: {type(exc).__name__}: {exc}") from None
    finally:
        data.close()
    return []


def _check_study(args: argparse.Namespace, ranks: int) -> list[str]:
    study, train = resolve_options(*study_options_from_args(args))
    model = model_file(train, "build_model(params)")
    check_study(study, train)
    layout = study_layout(study, train, ranks)
    definition = load_model_file(model)
    check_space_is_read(study, train, definition)
    if not study.space:
        return []
    # One trial's run, as its group's first rank sets it up: with a point of the space.
    point = parse_space(study.space).sample(np.random.default_rng(train.seed))
    settled = settle(
        trial_options(train, point),
        trial_definition(definition, point, 0, study.folds, train.seed),
        layout.ranks_per_run,
        0,
        HERE,
        TrialTag(study.study_name or "study", 0, watched_metrics(study)),
        here=False,
    )
    settled.data.close()
    return [n.text for n in settled.notices if n.warning]


@contextmanager
def _working_in(workdir: Path) -> Iterator[None]:
    """In `workdir` (the job's working directory) for the checks, then back."""
    before = os.getcwd()
    os.chdir(workdir)
    try:
        yield
    finally:
        os.chdir(before)
