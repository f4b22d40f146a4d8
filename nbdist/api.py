"""The Python API: the same options as the command line and the magics, as keywords."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from nbdist.errors import OptionsError
from nbdist.options import TrainOptions
from nbdist.train.definition import ModelDefinition, load_model_file
from nbdist.train.progress import RunResult

__all__ = ["train"]


def train(model: "Callable[[], Any] | str | Path", *, data: Any = None, loss: Any = None,
          metric: Any = "accuracy", comm: Any = None, **options: Any) -> RunResult | None:
    """Train on the MPI ranks of `comm` (default COMM_WORLD); every rank calls this.

    `model` is a function that builds a fresh torch.nn.Module (each rank builds its own)
    or the path of a model file. `data` is an ArrayData or a function returning one
    (default: digits). Keywords are the command-line options with underscores:
    `train(build, topology="allreduce", epochs=5, worker_optimizer="adam(lr=1e-3)")`.
    Returns the RunResult on the run's leader rank, None on the others.
    """
    from nbdist.train.runner import run_rank

    try:
        opts = TrainOptions.from_dict(options)
    except TypeError as exc:
        raise OptionsError(str(exc)) from None
    if isinstance(model, (str, Path)):
        definition: ModelDefinition | Callable[[], ModelDefinition] = lambda: load_model_file(model)  # noqa: E731
        opts = opts.replace(model=str(model))
    else:
        definition = ModelDefinition(build_model=model, loss=loss, metric=metric, data=data,
                                     source=getattr(model, "__name__", "model"))
    return run_rank(opts, definition, comm)
