"""The Python API: the same options as the command line and the magics, as keywords."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from nbdist.errors import OptionsError
from nbdist.options import TrainOptions
from nbdist.train.definition import ModelDefinition, load_model_file
from nbdist.train.progress import RunResult

if TYPE_CHECKING:
    from nbdist.cluster import Cluster
    from nbdist.job import Job

__all__ = ["train", "submit"]


def train(model: "Callable[[], Any] | str | Path", *, data: Any = None, loss: Any = None,
          metric: Any = "accuracy", comm: Any = None, cluster: "Cluster | None" = None,
          block: bool = False, **options: Any) -> "RunResult | Job | None":
    """Train a model on MPI ranks.

    Under mpiexec (no `cluster`), every rank calls this; it trains on the ranks of `comm`
    (default COMM_WORLD) and returns the RunResult on the run's leader, None elsewhere.

    From a notebook, `cluster=` (an nbdist.Cluster) trains on its engines and returns a
    Job at once (`block=True` waits for it); `model`, `loss` and `data` are then sent to
    every engine, which builds its own model and loads its own data.

    `model` is a function that builds a fresh torch.nn.Module or keras.Model (with
    gan=True: an nbdist.gan.GanModel), or the path of a model file. `data` is a function
    returning an ArrayData (default: digits); under mpiexec it may also be the ArrayData
    itself. Keywords are the command-line options with
    underscores: `train(build, topology="allreduce", epochs=5, worker_optimizer="adam(lr=1e-3)")`.
    """
    opts = _options(options)
    if cluster is not None:
        return submit(cluster, opts, model=model, loss=loss, metric=metric, data=data, block=block)
    from nbdist.train.runner import run_rank

    if isinstance(model, (str, Path)):
        definition: ModelDefinition | Callable[[], ModelDefinition] = lambda: load_model_file(model)  # noqa: E731
        opts = opts.replace(model=str(model))
    else:
        definition = ModelDefinition(build_model=model, loss=loss, metric=metric, data=data,
                                     source=getattr(model, "__name__", "model"))
    return run_rank(opts, definition, comm)


def _options(options: dict[str, Any]) -> TrainOptions:
    try:
        return TrainOptions.from_dict(options).validate()
    except TypeError as exc:
        raise OptionsError(str(exc)) from None


def _absolute(patterns: str) -> str:
    """Comma-separated paths or globs, made absolute from the notebook's directory."""
    return ",".join(os.path.abspath(os.path.expanduser(p.strip())) for p in patterns.split(",") if p.strip())


def submit(cluster: "Cluster", options: TrainOptions, *, cell: str | None = None, model: Any = None,
           loss: Any = None, metric: Any = "accuracy", data: Any = None, block: bool = False,
           show_progress: bool = True) -> "Job":
    """Start a training on every engine of `cluster`; the magics and train() end here."""
    from nbdist import engine
    from nbdist.data.base import Data
    from nbdist.job import Job
    from nbdist.store import RunStore, store_path

    if data is not None and isinstance(data, Data):
        raise OptionsError("with a cluster, pass data as a function that loads it (each engine "
                           "loads its own shard), not as arrays: data=lambda: nbdist.datasets.digits()")
    if cell is None and model is None and not options.model:
        raise OptionsError("nothing to train: give a model function, a --model file or a cell that "
                           "defines build_model() or model")
    if isinstance(model, Path):
        model = str(model)
    if model is None and options.model:
        model = options.model
    if isinstance(model, str):
        model = str(Path(model).resolve())
        options = options.replace(model=model)
    # Paths as the notebook sees them: the engines may run in another directory.
    options = options.replace(runs_dir=str(Path(options.runs_dir).resolve()))
    if store_path(options.store, options.runs_dir) is not None and options.store is not None:
        options = options.replace(store=str(Path(options.store).resolve()))
    if options.resume:
        options = options.replace(resume=str(Path(options.resume).resolve()))
    for name in ("train", "val", "cache_dir"):
        if getattr(options, name):
            options = options.replace(**{name: _absolute(getattr(options, name))})
    cluster.check_alive()
    # Checked here, before any engine is busy, with the rules the ranks apply.
    from nbdist.layout import Layout

    options.validate()
    layout = Layout.for_world(cluster.n, workers=options.workers, masters=options.masters,
                              procs_per_worker=options.procs_per_worker, topology=options.topology)
    database = store_path(options.store, options.runs_dir)
    if database is not None:
        RunStore(database).close()  # a store that cannot be used is an error now, in the cell
    async_result = cluster.view.apply_async(
        engine.run_training, options.to_dict(), cell=cell, model=model, loss=loss, metric=metric, data=data,
    )
    job = Job(cluster, async_result, options, layout=layout.to_dict(), store=database, show_progress=show_progress)
    return job.wait() if block else job
