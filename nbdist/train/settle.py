"""Every check of a run's set-up, as one rank makes it, before any rank trains: the
options, the layout, the rules, the model and its data, the optimisers, the metrics
named. No MPI: train/context.py's prepare() runs settle() on every rank and the ranks
agree on the first mistake; `python -m nbdist slurm-script` runs it for rank 0 before the
job waits in a queue."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nbdist.algorithms import Algorithm
from nbdist.backends import Backend, DeviceRequest, backend_for, configure_frameworks, making_models
from nbdist.backends.base import ModelError
from nbdist.data.base import Data
from nbdist.errors import UserError
from nbdist.gan import gan_backend
from nbdist.layout import Layout, Role
from nbdist.options import TrainOptions
from nbdist.specs import Spec
from nbdist.train.asynchrony import Notice, optimisers_for_asynchrony
from nbdist.train.batchnorm import convert_for_sync
from nbdist.train.checkpoint import Checkpoints
from nbdist.train.data_checks import batch_notices, check_data_size, check_labels
from nbdist.train.definition import ModelDefinition
from nbdist.train.lr import LrPlan, combined_workers, plan_learning_rates
from nbdist.train.measures import MODEL_MEASURES
from nbdist.train.progress import reported_metrics
from nbdist.train.relayout import check_resumable
from nbdist.train.rules import check_gan, check_windows, resolve_compression, resolve_rules
from nbdist.train.run_dir import check_run_dir_writable, find_resume
from nbdist.train.trial import TrialTag, check_metric_names
from nbdist.transport.reducers import choose as choose_reducer
from nbdist.transport.reducers import libnbc_note

__all__ = ["Settled", "settle", "SAMPLE_ROWS"]

# Input rows a backend may look at when it is built (Keras builds weights on a first
# call; a GAN fixes its MMD kernel's width from them).
SAMPLE_ROWS = 256


@dataclass
class Settled:
    """What a rank's set-up found, every input checked (settle())."""

    options: TrainOptions
    layout: Layout
    role: Role
    algorithm: Algorithm | None
    sync_every: int
    worker_optimizer: Spec | None
    master_optimizer: Spec | None
    compression: Spec | None
    notices: list[Notice]
    resume_from: Path | None
    damaged: list[str]
    data: Data
    backend: Backend
    make_replica: Callable[[], Backend]
    worker_lr: LrPlan | None
    master_lr: LrPlan | None
    initial_loss: float | None  # the untrained model's loss on rank 0's probe (None elsewhere)
    measures: dict[str, Callable[[Any], float]] = field(default_factory=dict)  # the model file's `objectives`


def settle(
    options: TrainOptions,
    definition: ModelDefinition | Callable[[], ModelDefinition],
    ranks: int,
    rank: int,
    device: DeviceRequest,
    trial: TrialTag | None = None,
    restart_of: Path | None = None,
    *,
    here: bool = True,
    run: TrainOptions | None = None,
) -> Settled:
    """Every check of a run's set-up as rank `rank` of `ranks` makes it: the options, the
    layout, the rules, the model and its data, the optimisers, the metrics named; one
    UserError for the first mistake. No MPI: prepare() runs it on every rank, and
    `python -m nbdist slurm-script` runs it for rank 0 before the job waits in a queue
    (`here=False`: away from the nodes that train, so the model is built on this CPU and
    what depends on those nodes, their GPUs and the runs directory, is left to them).
    `run`: the whole run's options where `options` are a phase's (a warm start's first,
    synchronous one)."""
    options = options.validate()
    # A run laid out anew (a resume, a restart on the ranks left) takes the masters that
    # fit its ranks; a fresh one gets exactly what it asked for, or an error.
    lay_out = Layout.fitting if options.resume or restart_of is not None else Layout.for_world
    layout = lay_out(
        ranks,
        workers=options.workers,
        masters=options.masters,
        procs_per_worker=options.procs_per_worker,
        topology=options.topology,
    )
    role = layout.role(rank)
    # The user's code first: a model file (or cell) may register its own update rule
    # (docs/howto/custom-rule.md). The frameworks are configured before and after it:
    # the same seed on every rank gives identical initial replicas even before the first sync.
    configure_frameworks(options.threads, options.seed)
    definition = definition() if callable(definition) else definition
    configure_frameworks(options.threads, options.seed)
    options = check_gan(options)
    algorithm, sync_every, worker_opt, master_opt = resolve_rules(options)
    check_windows(algorithm, run or options)
    compression = resolve_compression(options, algorithm)
    notices, stale_lr = [], False
    if algorithm is not None:
        # Every worker of the run moves the one centre, through its master or a
        # sub-master's merged push: a synchronous round of EASGD under sub-masters
        # then pulls the centre exactly as far as one master with all the workers would.
        # Asynchronous, they all add to the momentum the centre moves with.
        workers = combined_workers(layout)
        algorithm.bind(workers)
        algorithm.asynchronous = not options.synchronous
        asynchrony = optimisers_for_asynchrony(
            algorithm, master_opt, worker_opt, workers, options.synchronous, options.momentum_correction
        )
        master_opt, stale_lr, notices = asynchrony.optimizer, asynchrony.stale_lr, asynchrony.notices
        if asynchrony.stale_updates:
            algorithm.discount_stale = True  # ADAG, GEM: DynSGD's discount (train/asynchrony.py)
    resume_from, damaged = (
        find_resume(options) if restart_of is None else Checkpoints(restart_of).latest_intact(check_resumable)
    )
    data = _make_data(options, definition)
    try:
        check_data_size(data, layout, options)
        notices += batch_notices(data, layout, options)
        sample, sample_labels = data.train_batch(np.arange(min(SAMPLE_ROWS, data.n_train)))
        # A master keeps its centre in host memory (numpy): only workers go to a device.
        make_replica = _replica_factory(definition, options, sample, device if role.kind != "master" else None)
        # A pipeline's stage process holds its own stage only; its master holds (and
        # probes, for every rank) the whole model.
        stage_process = options.worker_parallel == "pipeline" and role.kind == "worker"
        backend = _stage_backend(definition, options, role, device) if stage_process else make_replica()
        notices += convert_for_sync(options, layout, backend)
        worker_start_lr, master_start_lr = (
            backend.check_optimizer(spec) if spec is not None else None for spec in (worker_opt, master_opt)
        )
        worker_lr, master_lr = plan_learning_rates(
            options, layout, algorithm, backend, worker_start_lr, master_start_lr, master_stale_lr=stale_lr
        )
        initial_loss = None
        if rank == 0:  # the run leader: labels against the whole model, and its loss before training
            whole = make_replica() if stage_process else backend
            if not options.gan:  # a GAN's labels are real/fake, not classes of its outputs
                check_labels(data, whole, sample[:2], definition.source)
            initial_loss = _probe(whole, sample, sample_labels, definition.source)
        elif not stage_process:
            _probe(backend, *data.train_batch(np.arange(min(2, data.n_train))), definition.source)
        if here and options.topology == "allreduce":  # e.g. nccl for a model on the CPU: one error, here
            reducer = choose_reducer(options.allreduce_backend, backend.rule_grads, compressed=compression is not None)
            note = libnbc_note(reducer, ranks)
            notices += [Notice(note, warning=False)] if note else []
        reported = reported_metrics(backend.metric_name, staleness=algorithm is not None)
        check_metric_names(options, trial, [*reported, *MODEL_MEASURES, *definition.objectives])
        if here and rank == 0:  # the run leader, who writes the run directory (last: it may create --runs-dir)
            check_run_dir_writable(options)
    except BaseException:
        data.close()  # its cache copies and reading thread
        raise
    return Settled(
        options,
        layout,
        role,
        algorithm,
        sync_every,
        worker_opt,
        master_opt,
        compression,
        notices,
        resume_from,
        damaged,
        data,
        backend,
        make_replica,
        worker_lr,
        master_lr,
        initial_loss,
        definition.objectives,
    )


def _probe(backend: Backend, x: Any, y: Any, source: str) -> float:
    """A forward pass on a few samples, so a model that cannot take the data fails here,
    clearly; returns their loss."""
    try:
        return backend.evaluate(x, y).loss
    except UserError:
        raise
    except Exception as exc:
        raise ModelError(
            f"{source}: the model cannot take the data (features {tuple(x.shape[1:])}, "
            f"labels {y.dtype}): {type(exc).__name__}: {exc}"
        ) from None


def _make_data(options: TrainOptions, definition: ModelDefinition) -> Data:
    """--train/--val files when given (they replace the model's load_data), else the model's."""
    if not options.train:
        return definition.make_data()
    from nbdist.data.files import HDF5Data

    return HDF5Data(
        options.train, options.val, keys=[k.strip() for k in options.data_keys.split(",")], cache_dir=options.cache_dir
    )


def _replica_factory(
    definition: ModelDefinition, options: TrainOptions, sample: Any, device: DeviceRequest | None
) -> Callable[[], Backend]:
    def make() -> Backend:
        if options.gan:
            return gan_backend(definition.make_gan(options.d_steps), sample)
        with making_models(options.precision):
            model = _whole_model(definition, options)
        return backend_for(
            model, definition.loss, definition.metric, sample=sample, precision=options.precision, device=device
        )

    return make


def _whole_model(definition: ModelDefinition, options: TrainOptions) -> Any:
    """The model a rank holds whole: build_model()'s, or for a pipeline its stages in a row
    whatever build_model says (the stages' buffers together must be its buffer)."""
    if options.worker_parallel != "pipeline":
        return definition.make_model()
    from nbdist.backends.stages import stage_model  # torch only when a pipeline runs

    return stage_model(definition.make_stages(options.procs_per_worker))


def _stage_backend(definition: ModelDefinition, options: TrainOptions, role: Role, device: DeviceRequest) -> Backend:
    """A pipeline worker's process: its own stage of the model (--worker-parallel pipeline)."""
    from nbdist.backends.stages import TorchStage, check_stages  # torch only when a pipeline runs

    stages = definition.make_stages(options.procs_per_worker)
    check_stages(stages)
    backend = TorchStage(stages[role.proc_index], role.proc_index, len(stages), definition.loss, definition.metric)
    backend.place(device)
    return backend
