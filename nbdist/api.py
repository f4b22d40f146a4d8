"""The Python API: the same options as the command line and the magics, as keywords."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nbdist.errors import OptionsError
from nbdist.options import STUDY_SKIPS, StudyOptions, TrainOptions, saved_run_options
from nbdist.store import RunStore, is_url, place_store, store_path
from nbdist.train.definition import ModelDefinition, definition_of
from nbdist.train.progress import RunResult

if TYPE_CHECKING:
    from nbdist.cluster import Cluster
    from nbdist.hpo.runner import StudyResult
    from nbdist.job import Job
    from nbdist.notebook_study import Study
    from nbdist.scaling.sweep import ScaleResult

__all__ = ["train", "submit", "study", "submit_study", "scale"]


def train(
    model: Callable[[], Any] | str | Path,
    *,
    data: Any = None,
    loss: Any = None,
    metric: Any = "accuracy",
    comm: Any = None,
    cluster: Cluster | None = None,
    block: bool = False,
    **options: Any,
) -> RunResult | Job | None:
    """Train a model on MPI ranks.

    Under mpiexec (no `cluster`), every rank calls this; it trains on the ranks of `comm`
    and returns the run's result on the run's leader, None elsewhere. From a notebook,
    `cluster=` trains on the cluster's engines and returns a Job at once; `model`, `loss`
    and `data` are then sent to every engine, which builds its own model and loads its own
    data.

    Args:
        model: A function that builds a fresh `torch.nn.Module` or `keras.Model` (with
            `gan=True`: an `nbdist.gan.GanModel`), or the path of a model file.
        data: A function returning an `nbdist.data.ArrayData` (default: digits); under
            mpiexec it may also be the ArrayData itself.
        loss: The loss (default: cross-entropy; a compiled Keras model's own loss).
        metric: `"accuracy"`, a callable `(output, target) -> float`, or None.
        comm: Under mpiexec, the MPI communicator to train on (default COMM_WORLD).
        cluster: An `nbdist.Cluster` whose engines train it, from a notebook.
        block: With `cluster`, wait until the job ends before returning.
        **options: The command-line options with underscores (`topology="allreduce"`,
            `epochs=5`, `worker_optimizer="adam(lr=1e-3)"`); the options reference lists
            them all.

    Returns:
        Under mpiexec, the `RunResult` (`run_dir`, `history`, `final` metrics,
        `weights_path`) on the run's leader and None on the other ranks; with `cluster`,
        the `Job` (already ended when `block=True`).

    Raises:
        OptionsError: An unknown option or a bad value, before any rank starts.

    Example:
        Saved as `train_digits.py` and run with `mpiexec -n 2 python train_digits.py`::

            import nbdist
            from torch import nn

            def build_model():
                return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))

            result = nbdist.train(build_model, topology="allreduce", epochs=3)
            if result:  # the run's leader
                print(result.final["val_acc"], result.weights_path)
    """
    opts = _options(options)
    if cluster is not None:
        return submit(cluster, opts, model=model, loss=loss, metric=metric, data=data, block=block)
    from nbdist.roles.runner import run_rank

    if isinstance(model, (str, Path)):
        opts = opts.replace(model=str(model))
    return run_rank(opts, definition_of(model, loss=loss, metric=metric, data=data), comm)


def _options(options: dict[str, Any]) -> TrainOptions:
    try:
        return TrainOptions.from_dict(options).validate().refuse_pipeline_options(options)
    except TypeError as exc:
        raise OptionsError(str(exc)) from None


def _absolute(patterns: str) -> str:
    """Comma-separated paths or globs, made absolute from the notebook's directory."""
    return ",".join(os.path.abspath(os.path.expanduser(p.strip())) for p in patterns.split(",") if p.strip())


def _for_the_engines(options: TrainOptions, *, cell: str | None, model: Any, data: Any) -> tuple[TrainOptions, Any]:
    """The options and the model as the engines need them: paths made absolute from the
    notebook's directory (the engines may run elsewhere), a model file named once."""
    from nbdist.data.base import Data

    if data is not None and isinstance(data, Data):
        raise OptionsError(
            "with a cluster, pass data as a function that loads it (each engine "
            "loads its own shard), not as arrays: data=lambda: nbdist.datasets.digits()"
        )
    if cell is None and model is None and not options.model:
        raise OptionsError(
            "nothing to train: give a model function, a --model file or a cell that defines build_model() or model"
        )
    if isinstance(model, Path):
        model = str(model)
    if model is None and options.model:
        model = options.model
    if isinstance(model, str):
        model = str(Path(model).resolve())
        options = options.replace(model=model)
    options = options.replace(runs_dir=str(Path(options.runs_dir).resolve()))
    if (
        store_path(options.store, options.runs_dir) is not None
        and options.store is not None
        and not is_url(options.store)
    ):
        options = options.replace(store=str(Path(options.store).resolve()))
    if options.resume:
        saved_run_options(options.resume)  # a missing or wrong directory is an error now, in the cell
        options = options.replace(resume=str(Path(options.resume).resolve()))
    for name in ("train", "val", "cache_dir"):
        if getattr(options, name):
            options = options.replace(**{name: _absolute(getattr(options, name))})
    return options, model


def _store_for(options: TrainOptions) -> str | None:
    """The run store the job is recorded in; one that cannot be used is an error now, in the cell.
    The notebook records it: one host writes it."""
    database = place_store(options.store, options.runs_dir, several_hosts=False)
    if database is not None:
        RunStore(database).close()
    return database


def submit(
    cluster: Cluster,
    options: TrainOptions,
    *,
    cell: str | None = None,
    model: Any = None,
    loss: Any = None,
    metric: Any = "accuracy",
    data: Any = None,
    block: bool = False,
    show_progress: bool = True,
) -> Job:
    """Start a training on every engine of `cluster`; the magics and train() end here."""
    from nbdist import engine
    from nbdist.job import Job
    from nbdist.layout import Layout

    options, model = _for_the_engines(options, cell=cell, model=model, data=data)
    cluster.check_alive()
    # Checked here, before any engine is busy, with the rules the ranks apply.
    options.validate()
    # A resume lays the run out anew on this cluster, as its ranks will (train/settle.py).
    layout = (Layout.fitting if options.resume else Layout.for_world)(
        cluster.n,
        workers=options.workers,
        masters=options.masters,
        procs_per_worker=options.procs_per_worker,
        topology=options.topology,
    )
    database = _store_for(options)
    async_result = cluster.view.apply_async(
        engine.run_training,
        options.to_dict(),
        cell=cell,
        model=model,
        loss=loss,
        metric=metric,
        data=data,
    )
    job = Job(cluster, async_result, options, layout=layout.to_dict(), store=database, show_progress=show_progress)
    return job.wait() if block else job


def study(
    model: Callable[..., Any] | str | Path | None = None,
    *,
    data: Any = None,
    loss: Any = None,
    metric: Any = "accuracy",
    comm: Any = None,
    cluster: Cluster | None = None,
    block: bool = False,
    show_progress: bool = True,
    **options: Any,
) -> Study | StudyResult | None:
    """A hyper-parameter study: a searcher proposes parameters, groups of ranks train them.

    Under mpiexec, every rank calls this: rank 0 coordinates and the others form the
    study's groups (1 + groups x folds x the ranks of one run in all). From a notebook,
    `cluster=` runs the trials on its engines (groups x folds x the ranks of one run) and
    returns a Study at once. The parameters of each trial also set the training options
    they name, and `optimizer`/`lr` the optimiser (`nbdist.hpo.trial`).

    Args:
        model: A function `build_model(params)` that builds a fresh model from a dict of
            parameters, or the path of a model file that defines it.
        data: A function returning an `nbdist.data.ArrayData` (default: digits).
        loss: The loss (default: cross-entropy).
        metric: `"accuracy"`, a callable `(output, target) -> float`, or None.
        comm: Under mpiexec, the MPI communicator of the study (default COMM_WORLD).
        cluster: An `nbdist.Cluster` whose engines train the trials, from a notebook.
        block: With `cluster`, wait until the study ends before returning.
        show_progress: With `cluster`, show a live line per trial under the cell.
        **options: The options of `python -m nbdist study` with underscores: the study's
            (`space`, `searcher`, `trials`, `groups`, `folds`, `objective`, `goal`, ...)
            and the training options every trial uses (`workers`, `epochs`, ...).

    Returns:
        Under mpiexec, the `StudyResult` (`trials`, `best_params`, `best_fom`, ...) on
        rank 0 and None on the other ranks; with `cluster`, the `Study`.

    Raises:
        OptionsError: An unknown option, a bad value or a malformed space, before any
            trial starts.

    Example:
        Saved as `study_digits.py` and run with `mpiexec -n 3 python study_digits.py`
        (a coordinator and 2 groups of one rank)::

            import nbdist
            from torch import nn

            def build_model(params):
                hidden = params["hidden"]
                return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))

            result = nbdist.study(build_model, space="lr=log(1e-3,0.3) hidden=int(16,128)",
                                  searcher="random", trials=4, groups=2,
                                  topology="allreduce", workers=1, epochs=2)
            if result:  # the coordinator
                print(result.best_params, result.best_fom)
    """
    study_options, train_options = _study_options(options)
    if cluster is not None:
        from nbdist.notebook_study import Study

        train_options, model = _for_the_engines(train_options, cell=None, model=model, data=data)
        handle = Study(
            cluster,
            study_options,
            train_options,
            store=_store_for(train_options),
            what=dict(model=model, loss=loss, metric=metric, data=data),
            show_progress=show_progress,
        )
        return handle.wait() if block else handle
    from nbdist.roles.batch_study import run_study

    if isinstance(model, (str, Path)):
        train_options = train_options.replace(model=str(model))
    return run_study(study_options, train_options, definition_of(model, loss=loss, metric=metric, data=data), comm)


def submit_study(
    cluster: Cluster, study_options: StudyOptions, train_options: TrainOptions, *, cell: str, show_progress: bool = True
) -> Study:
    """A study whose model is a notebook cell (the %%distnn study magic)."""
    from nbdist.notebook_study import Study

    train_options, _ = _for_the_engines(train_options, cell=cell, model=None, data=None)
    return Study(
        cluster,
        study_options,
        train_options,
        store=_store_for(train_options),
        what=dict(cell=cell),
        show_progress=show_progress,
    )


def _study_options(options: dict[str, Any]) -> tuple[StudyOptions, TrainOptions]:
    from nbdist.hpo.runner import resolve_options

    study_names = {f.name for f in fields(StudyOptions)}
    train_names = {f.name for f in fields(TrainOptions)} - set(STUDY_SKIPS)
    unknown = sorted(set(options) - study_names - train_names)
    if unknown:
        raise OptionsError(f"unknown option(s) for a study: {', '.join(unknown)}")
    study, train = resolve_options(
        {k: v for k, v in options.items() if k in study_names}, {k: v for k, v in options.items() if k in train_names}
    )
    return study.validate(), train.validate()


def scale(
    model: Callable[[], Any] | str | Path | None = None,
    *,
    data: Any = None,
    loss: Any = None,
    metric: Any = "accuracy",
    comm: Any = None,
    cluster: Cluster | None = None,
    **options: Any,
) -> ScaleResult | None:
    """A scaling study: calibrate the performance model on the ranks at hand, measure a
    sweep of set-ups and rank counts, predict to many ranks, recommend a set-up.

    Keywords are the options of `python -m nbdist scale` with underscores:
    `scale("examples/digits_cnn.py", quick=True, setups="allreduce downpour", max_ranks=256)`.
    Under mpiexec every rank calls it (on the ranks of `comm`, default COMM_WORLD) and rank
    0 gets the ScaleResult (its `text` is the report), the others None. From a notebook,
    `cluster=` runs it on the cluster's engines (a model file then: each engine loads it),
    waits, prints the report and returns the ScaleResult.

    Example (under `python -m nbdist launch -n 4 python script.py`):

        result = nbdist.scale("examples/digits_cnn.py", quick=True)
        if result is not None:
            print(result.analysis.recommendation["label"])
    """
    from nbdist.scaling.options import ScaleOptions

    if isinstance(model, (str, Path)):
        options["model"] = str(model)
    elif model is not None:
        options.setdefault("model", getattr(model, "__name__", "model"))
    try:
        opts = ScaleOptions.from_dict(options).validate()
    except TypeError as exc:
        raise OptionsError(str(exc)) from None
    if cluster is not None:
        return _scale_on(cluster, opts, model)
    from nbdist.scaling.sweep import run_scale

    definition = None
    if model is not None and not isinstance(model, (str, Path)):
        made = definition_of(model, loss=loss, metric=metric, data=data)
        definition = made if isinstance(made, ModelDefinition) else made()
    return run_scale(opts, definition, comm)


def _scale_on(cluster: Cluster, options: Any, model: Any) -> ScaleResult:
    """The study on a notebook cluster's engines; the report printed here."""
    from nbdist import engine
    from nbdist.errors import UserError

    if model is not None and not isinstance(model, (str, Path)):
        raise OptionsError("with a cluster, give the model as a file (each engine loads it): scale('model.py', ...)")
    changes = {"model": str(Path(str(options.model)).resolve()), "runs_dir": str(Path(options.runs_dir).resolve())}
    if (
        options.store is not None
        and store_path(options.store, options.runs_dir) is not None
        and not is_url(options.store)
    ):
        changes["store"] = str(Path(options.store).resolve())
    options = options.replace(**changes)
    cluster.check_alive()
    outcomes = cluster.view.apply_async(engine.run_scaling, options.to_dict()).get()
    failed = sorted((o for o in outcomes if o.error and not o.abandoned), key=lambda o: o.failed_at or 0.0)
    if failed:
        raise UserError(failed[0].error if failed[0].user_error else f"rank {failed[0].rank}: {failed[0].error}")
    result = next(o.result for o in outcomes if o.rank == 0)
    print(result.text, flush=True)
    return result
