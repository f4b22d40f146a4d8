"""The options of a training run: one typed config behind the CLI, the magics and the API.

Each field carries its flag and help; `add_arguments` builds the argparse parser from
them, so `python -m nbdist train`, `%%distnn train` and `nbdist.train(...)` take the same
names with the same meaning. Validation that needs no model happens here, at the edge.

The options that name an extension (--algorithm, --compression, --allreduce-backend,
--searcher) list its registry's entries in their help, made when the parser is built
(nbdist.registry): a rule registered by the user's code is listed too.

The modules: fields.py (how an option is declared), training.py (TrainOptions),
study.py (StudyOptions), target.py (--target conditions), arguments.py (the command
line). Every name other modules import is re-exported here.
"""

from __future__ import annotations

from nbdist.options.arguments import STUDY_SKIPS as STUDY_SKIPS
from nbdist.options.arguments import (
    add_arguments,
    add_study_arguments,
    options_from_args,
    require_model,
    saved_run_options,
    study_options_from_args,
)
from nbdist.options.arguments import model_file as model_file
from nbdist.options.fields import _opt as _opt
from nbdist.options.fields import check_types as check_types
from nbdist.options.fields import field_kind as field_kind
from nbdist.options.fields import flag as flag
from nbdist.options.study import DIRECTIONS as DIRECTIONS
from nbdist.options.study import StudyOptions
from nbdist.options.target import Target, parse_target
from nbdist.options.training import BUSY_POLLS as BUSY_POLLS
from nbdist.options.training import DEFAULT_LR_SCALING as DEFAULT_LR_SCALING
from nbdist.options.training import DEVICES as DEVICES
from nbdist.options.training import LR_SCALINGS as LR_SCALINGS
from nbdist.options.training import MOMENTUM_CORRECTIONS as MOMENTUM_CORRECTIONS
from nbdist.options.training import PIPELINE_SCHEDULES as PIPELINE_SCHEDULES
from nbdist.options.training import PRECISIONS as PRECISIONS
from nbdist.options.training import TOPOLOGIES as TOPOLOGIES
from nbdist.options.training import WORKER_PARALLELS as WORKER_PARALLELS
from nbdist.options.training import TrainOptions
from nbdist.options.training import allreduce_backends as allreduce_backends

__all__ = [
    "TrainOptions",
    "StudyOptions",
    "add_arguments",
    "add_study_arguments",
    "options_from_args",
    "require_model",
    "saved_run_options",
    "study_options_from_args",
    "Target",
    "parse_target",
]
