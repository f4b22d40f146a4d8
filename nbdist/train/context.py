"""Setting up one rank: options, layout, model, data, rule and run directory.

Everything that can be wrong with the user's input is checked here, on every rank,
before any rank starts to train; the ranks then agree (one small allgather) so that a
mistake becomes the same clear error everywhere instead of a hang or a traceback from
one rank.
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nbdist.algorithms import Algorithm, make_algorithm, rule_class
from nbdist.backends import Backend, DeviceRequest, backend_for, configure_frameworks, making_models
from nbdist.backends.base import ModelError
from nbdist.data.base import Data, DataError
from nbdist.data.sharding import ShardPlan
from nbdist.durable import make_dir, write_json, write_text
from nbdist.errors import OptionsError, UserError
from nbdist.gan import gan_backend
from nbdist.layout import Communicators, Layout, Role
from nbdist.metrics.log import RecordSink, RunLog
from nbdist.options import TrainOptions, parse_target
from nbdist.specs import Spec, did_you_mean, parse_spec
from nbdist.store import RunRecorder, RunStore, place_store, store_path
from nbdist.train.asynchrony import Notice, optimisers_for_asynchrony
from nbdist.train.batchnorm import convert_for_sync
from nbdist.train.checkpoint import CheckpointError, Checkpoints
from nbdist.train.data_checks import batch_notices, check_labels, shards_of
from nbdist.train.definition import ModelDefinition
from nbdist.train.history import HistoryFile
from nbdist.train.loop import LossGrowth
from nbdist.train.lr import LrPlan, combined_workers, plan_learning_rates
from nbdist.train.measures import MODEL_MEASURES
from nbdist.train.progress import reported_metrics
from nbdist.train.relayout import Share, centre_share, change_note, check_resumable, plan_shares, saved_layout
from nbdist.train.stopping import EarlyStopping, StopFlag, TrialStopping
from nbdist.transport.agreement import agree
from nbdist.transport.compression import make_codec, parse_compression
from nbdist.transport.interfaces import launch_spans_hosts
from nbdist.transport.node import local_rank, polling_suits_node
from nbdist.transport.peers import Peers
from nbdist.transport.reducers import choose as choose_reducer
from nbdist.transport.waiting import poll_without_sleeping

__all__ = [
    "RankContext",
    "TrialTag",
    "MetricNameError",
    "prepare",
    "agree",
    "check_metric_names",
    "check_data_size",
    "Settled",
    "settle",
]

# Workers explore with momentum (GEM's own default is the same); lr 0.05 because 0.1 with
# momentum 0.9 (a step of 1.0 in effect) made 8-worker allreduce collapse on the jet images
# (bench/results/2026-11-24-convergence.md). A Downpour master gets no momentum by default:
# asynchronous updates already act as momentum (train/asynchrony.py), and a momentum-0.9
# master corrected for it learned digits more slowly with few workers (the correction
# assumes staleness W - 1; it is less: the same file).
DEFAULT_WORKER_OPTIMIZER = "sgd(lr=0.05, momentum=0.9)"
DEFAULT_MASTER_OPTIMIZER = "sgd(lr=0.1)"
# What --algorithm may also say for the allreduce topology's rule (the registered "sgd").
ALLREDUCE_ALIAS = "allreduce"
# GANs: EASGD with RMSprop workers, as the 3D calorimeter GAN was trained (see
# gan/training.py for why only rules whose workers send their weights apply).
DEFAULT_GAN_ALGORITHM = "easgd"
DEFAULT_GAN_WORKER_OPTIMIZER = "rmsprop(lr=0.001)"
# Input rows a backend may look at when it is built (Keras builds weights on a first
# call; a GAN fixes its MMD kernel's width from them).
SAMPLE_ROWS = 256


class MetricNameError(OptionsError):
    """A metric named by an option (--monitor, --target, a study's --objective) that the
    run does not report: the same mistake for every run with these options."""


@dataclass(frozen=True, slots=True)
class TrialTag:
    """The study and trial a run trains for. `watched`: the metrics the study reads from
    the run's epochs, each with the option that names it, e.g. (("--objective val_acc", "val_acc"),).
    `pause_at`: the epoch after which the run stops, keeping its checkpoint, for the study
    to resume it (a rung, a PBT interval). `asks`: the run's leader tells the study each
    epoch and takes its word (`ask`, on the leader only: train/stopping.TrialStopping).
    `keep`: called with each share of a checkpoint this rank writes (label, arrays, scalars)."""

    study: str
    number: int
    watched: tuple[tuple[str, str], ...] = ()
    pause_at: int | None = None
    asks: bool = False
    ask: Callable[[int, dict], str] | None = None
    keep: Callable[[str, dict, dict], None] | None = None


@dataclass
class RankContext:
    options: TrainOptions
    layout: Layout
    role: Role
    comms: Communicators
    backend: Backend
    data: Data
    algorithm: Algorithm | None  # None in the allreduce topology
    sync_every: int
    worker_optimizer: Spec | None
    master_optimizer: Spec | None
    run_dir: Path
    run_id: str
    log: RunLog
    stop: StopFlag
    checkpoints: Checkpoints
    history_file: HistoryFile  # the run's epoch records, which checkpoints refer to
    resume_from: Path | None
    early: EarlyStopping
    is_leader: bool  # prints progress and writes run-level files
    make_replica: Callable[[], Backend]  # another copy of the model (background validation)
    peers: Peers  # the other ranks: who they are, how long to wait for them, how to tell them
    store_path: str | None = None  # the run store this run is recorded in by its leader (every rank knows)
    recorder: RunRecorder | None = None  # the leader's feed of the run store (batch runs)
    attempt: int = 0  # restarts of the run so far (--max-restarts)
    resume_rank: int | None = None  # whose share of resume_from this rank loads (None: nothing of its own)
    resume_partial: bool = False  # of that share only what twins hold alike (train/relayout.py)
    relayout: bool = False  # resumed on another layout: positions and tallies start at an epoch boundary
    resumed_layout: Layout | None = None  # the layout that wrote resume_from, when it says
    worker_lr: LrPlan | None = None  # the lr of workers' steps by position (train/lr.py); None: no such lr
    master_lr: LrPlan | None = None  # the lr of the master optimiser's steps
    compression: Spec | None = None  # --compression (None: none; transport/compression.py)
    loss_growth: LossGrowth | None = None  # the leader's watch on the training loss (None: a GAN's, not watched)
    keep_state: Callable[[str, dict, dict], None] | None = None  # a study's trial keeps its checkpoint shares
    measures: dict[str, Callable[[Any], float]] = field(default_factory=dict)  # the model file's `objectives`

    @property
    def rule(self) -> Algorithm:
        """The master/worker update rule (the roles of that topology use it; allreduce has none)."""
        if self.algorithm is None:
            raise RuntimeError("the allreduce topology has no master/worker update rule")
        return self.algorithm

    @property
    def resume_dir(self) -> Path:
        """The run directory this run resumes from (the code that calls this runs only then)."""
        if self.resume_from is None:
            raise RuntimeError("this run resumes from no checkpoint")
        return self.resume_from

    @property
    def old_layout(self) -> Layout:
        """The layout that wrote the checkpoint of a run laid out anew (train/relayout.py)."""
        if self.resumed_layout is None:
            raise RuntimeError("this run resumes from no checkpoint that records its layout")
        return self.resumed_layout

    @property
    def world_ranks(self) -> list[int]:
        """The COMM_WORLD rank of each rank of the run, in run order (checkpoints record
        it, so that a restart on fewer ranks can find each role's share)."""
        return [info.world_rank for info in self.peers.directory.infos.values()]

    def say(self, text: str) -> None:
        if self.is_leader and not self.options.quiet:
            print(text, flush=True)

    def warn(self, text: str) -> None:
        """What the user must hear of even with --quiet (a rank lost, a checkpoint skipped)."""
        import sys

        print(text, file=sys.stderr, flush=True)

    def watch_loss(self, metrics: dict[str, Any]) -> None:
        """After each epoch, on the run leader: one warning when the training loss has grown
        by orders of magnitude (train/loop.py's LossGrowth)."""
        if self.is_leader and self.loss_growth is not None and "train_loss" in metrics:
            warning = self.loss_growth.check(int(metrics["epoch"]), float(metrics["train_loss"]))
            if warning is not None:
                self.warn(f"nbdist: warning: {warning}")

    def checkpoint_due(self, epochs_done: int) -> bool:
        every = self.options.checkpoint_every
        return epochs_done == self.options.epochs or (every > 0 and epochs_done % every == 0)


def _check_gan(options: TrainOptions) -> TrainOptions:
    """A GAN's defaults, or one error for a combination that cannot train one."""
    if not options.gan:
        if options.d_steps != 1:
            raise OptionsError("--d-steps applies to GANs: add --gan")
        return options
    if options.topology == "allreduce" or options.procs_per_worker > 1:
        raise OptionsError(
            "--gan trains on the master-worker topology with one process per worker: a GAN step "
            "takes discriminator steps before the generator's gradient, which one gradient reduction "
            f"cannot carry (drop {'--topology allreduce' if options.topology == 'allreduce' else '--procs-per-worker'})"
        )
    if options.sync_batchnorm:
        raise OptionsError(
            "--sync-batchnorm does not apply to --gan: a GAN trains with one process per worker, "
            "whose BatchNorm layers already normalise over its whole batch; drop --sync-batchnorm"
        )
    algorithm = make_algorithm(parse_spec(options.algorithm or DEFAULT_GAN_ALGORITHM, what="--algorithm"))
    if not algorithm.carries_local_steps:
        raise OptionsError(
            f"--gan trains with easgd, adag or dynsgd, whose workers send their weights (generator and "
            f"discriminator together); {algorithm.name} sends gradients, which would leave the "
            f"discriminator untrained"
        )
    # A GAN's val_loss is its discriminator's, which says little about the samples:
    # early stopping and targets watch the samples' distance to the data unless told.
    monitor = "val_mmd" if options.monitor == TrainOptions.monitor else options.monitor
    return options.replace(
        algorithm=options.algorithm or DEFAULT_GAN_ALGORITHM,
        worker_optimizer=options.worker_optimizer or DEFAULT_GAN_WORKER_OPTIMIZER,
        monitor=monitor,
    )


def _resolve_rules(options: TrainOptions) -> tuple[Algorithm | None, int, Spec | None, Spec | None]:
    if options.topology == "allreduce":
        spec = parse_spec(options.algorithm or "sgd", what="--algorithm")
        if spec.name != ALLREDUCE_ALIAS and "allreduce" not in rule_class(spec.name).topologies:
            raise OptionsError(
                f"{spec.name} is a master/worker algorithm; the allreduce topology trains with "
                f"synchronous sgd (use --topology master-worker for {spec.name})"
            )
        if options.master_optimizer:
            raise OptionsError("--master-optimizer applies to the master-worker topology; allreduce has no master")
        if options.sync_every not in (None, 1):
            raise OptionsError("--sync-every applies to the master-worker topology; allreduce syncs every batch")
        return (
            None,
            1,
            parse_spec(options.worker_optimizer or DEFAULT_WORKER_OPTIMIZER, what="--worker-optimizer"),
            None,
        )

    algorithm = make_algorithm(parse_spec(options.algorithm or "downpour", what="--algorithm"))
    if options.worker_optimizer and not algorithm.uses_worker_optimizer:
        raise OptionsError(
            f"{algorithm.name} takes no worker optimizer: its workers step with its own lr and "
            f"momentum, e.g. --algorithm 'gem(lr=0.05, momentum=0.9)'"
        )
    if options.master_optimizer and not algorithm.uses_master_optimizer:
        raise OptionsError(
            f"{algorithm.name} takes no master optimizer: its master adds the workers' updates "
            f"to the centre; drop --master-optimizer"
        )
    worker: Spec | None = (
        parse_spec(
            options.worker_optimizer or algorithm.default_worker_optimizer or DEFAULT_WORKER_OPTIMIZER,
            what="--worker-optimizer",
        )
        if algorithm.uses_worker_optimizer
        else None
    )
    master = (
        parse_spec(options.master_optimizer or DEFAULT_MASTER_OPTIMIZER, what="--master-optimizer")
        if algorithm.uses_master_optimizer
        else None
    )
    window = algorithm.sync_window()
    if window is not None and options.sync_every not in (None, window):
        raise OptionsError(
            f"{algorithm.name} syncs every {window} batches (its inner_steps) and --sync-every says "
            f"{options.sync_every}: give one of them"
        )
    sync_every = options.sync_every or window or algorithm.default_sync_every
    if algorithm.name == "downpour" and sync_every == 1:
        # Downpour workers step locally only between pushes; with a push after every
        # batch a worker optimizer would be silently ignored.
        if options.worker_optimizer:
            raise OptionsError(
                "downpour with --sync-every 1 takes no worker optimizer (workers only compute "
                "gradients; the master's is --master-optimizer); use --sync-every > 1 for local steps"
            )
        worker = None
    return algorithm, sync_every, worker, master


def _resolve_compression(options: TrainOptions, algorithm: Algorithm | None) -> Spec | None:
    spec = parse_compression(options.compression)
    if spec is not None and algorithm is not None and algorithm.message_is_weights and make_codec(spec, 2).feedback:
        raise OptionsError(
            f"--compression {spec} sends a part of each message and keeps the rest for the next one: a fit for "
            f"gradients and updates, but {algorithm.name}'s workers send their weights; use fp16 or bf16"
        )
    return spec


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


def _run_name(options: TrainOptions) -> str:
    rule = (options.algorithm or ("sgd" if options.topology == "allreduce" else "downpour")).split("(")[0]
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{options.topology}-{rule}"


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
) -> Settled:
    """Every check of a run's set-up as rank `rank` of `ranks` makes it: the options, the
    layout, the rules, the model and its data, the optimisers, the metrics named; one
    UserError for the first mistake. No MPI: prepare() runs it on every rank, and
    `python -m nbdist slurm-script` runs it for rank 0 before the job waits in a queue
    (`here=False`: away from the nodes that train, so the model is built on this CPU and
    what depends on those nodes, their GPUs and the runs directory, is left to them)."""
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
    options = _check_gan(options)
    algorithm, sync_every, worker_opt, master_opt = _resolve_rules(options)
    compression = _resolve_compression(options, algorithm)
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
        _find_resume(options) if restart_of is None else Checkpoints(restart_of).latest_intact(check_resumable)
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
            choose_reducer(options.allreduce_backend, backend.rule_grads, compressed=compression is not None)
        reported = reported_metrics(backend.metric_name, staleness=algorithm is not None)
        check_metric_names(options, trial, [*reported, *MODEL_MEASURES, *definition.objectives])
        if here and rank == 0:  # the run leader, who writes the run directory (last: it may create --runs-dir)
            _check_run_dir_writable(options)
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


def prepare(
    options: TrainOptions,
    definition: ModelDefinition | Callable[[], ModelDefinition],
    comm: Any,
    stop: StopFlag,
    sink: RecordSink | None = None,
    record: bool = True,
    trial: TrialTag | None = None,
    restart_of: Path | None = None,
    written: TrainOptions | None = None,
) -> RankContext:
    """Collective over `comm`: build this rank's context or raise one UserError everywhere.

    `record`: the run leader feeds the run store (batch runs); a notebook job passes
    False, because the notebook's collector records it. `trial`: the study and trial
    number a study's run belongs to (its records and its row in the store say so).
    `restart_of`: the run directory of a run that lost ranks: it goes on there, from its
    last checkpoint (if any), on the ranks of `comm`, laid out anew. `written`: the
    options the run directory keeps, where they are not these (a warm start's first,
    synchronous phase keeps the whole run's)."""
    error: BaseException | None = None
    settled: Settled | None = None
    resume = _Resume()
    peers = Peers(comm, options.peer_timeout)
    device = DeviceRequest(options.device, local_rank(comm))  # collective: before any rank can fail
    try:
        settled = settle(options, definition, comm.Get_size(), comm.Get_rank(), device, trial, restart_of)
        options = settled.options
        if record and comm.Get_rank() == 0:  # its SQLite file's directory exists, not on NFS from several hosts
            place_store(options.store, options.runs_dir, several_hosts=launch_spans_hosts())
        poll_without_sleeping(
            options.busy_poll == "on" or (options.busy_poll == "auto" and polling_suits_node(options.threads)),
            while_core_free=options.busy_poll == "auto",
        )
        # Which share of the checkpoint each rank loads, and what laying it out anew changed.
        resume = _plan_resume(settled.resume_from, settled.layout, comm, restart_of is not None, options)
        # Dropout (and a GAN's noise) differs per rank after this point; weights do not.
        settled.backend.reseed(options.seed * 100003 + settled.role.rank)
    except UserError as exc:
        error = exc
    except Exception as exc:  # a bug or a user-code failure: keep it visible, named
        error = UserError(f"setup failed: {type(exc).__name__}: {exc}")
    try:
        agree(comm, error, peers.collectives)
    except BaseException:
        if settled is not None:
            settled.data.close()  # its cache copies and reading thread
        peers.close()
        raise
    assert settled is not None  # every rank agreed that none failed
    got = settled
    layout, role, backend, data, algorithm, sync_every = (
        got.layout, got.role, got.backend, got.data, got.algorithm, got.sync_every
    )  # fmt: skip
    notices, damaged, resume_from, make_replica, compression = (
        got.notices, got.damaged, got.resume_from, got.make_replica, got.compression
    )  # fmt: skip
    worker_opt, master_opt, worker_lr, master_lr = (
        got.worker_optimizer, got.master_optimizer, got.worker_lr, got.master_lr
    )  # fmt: skip
    comms = layout.split(comm)
    peers.meet(comm, _role_name(role))
    run_comm = comms.run
    is_leader = run_comm.Get_rank() == 0
    run_dir = restart_of or (Path(options.resume) if resume_from is not None and options.resume else None)
    if run_dir is None:
        name = None
        if is_leader:
            name = options.run_name or _run_name(options)
            run_dir = _fresh_dir(
                Path(options.runs_dir), name, store_path(options.store, options.runs_dir) if record else None, trial
            )
            name = str(run_dir)
        run_dir = Path(run_comm.bcast(name, root=0))
    if is_leader:
        _write_run_files(run_dir, written or options, layout)
        for notice in notices:
            if notice.warning:
                print(f"nbdist: warning: {notice.text}", file=sys.stderr, flush=True)
            elif not options.quiet:
                print(f"nbdist: note: {notice.text}", flush=True)
        for problem in damaged:  # every rank found the same: one says so
            where = f"resuming from {resume_from.name}" if resume_from is not None else "starting afresh"
            print(f"nbdist: warning: {problem}; {where}", file=sys.stderr, flush=True)
        if resume.note:  # even with --quiet: what a run resumed on other ranks carries over differs
            print(f"nbdist: note: {resume.note}", flush=True)
    run_id = run_dir.name
    recorder, error = None, None
    database = store_path(options.store, options.runs_dir) if record else None
    if is_leader and database is not None:
        try:
            recorder = RunRecorder(
                database,
                run_id,
                run_dir,
                options=options.to_dict(),
                layout=layout.to_dict(),
                study=trial.study if trial else None,
                trial=trial.number if trial else None,
            )
        except UserError as exc:
            error = exc
    if database is not None:
        agree(run_comm, error, peers.collectives)
    log = RunLog(run_dir, run_id, comm.Get_rank(), role.kind, sink=sink, trial=trial.number if trial else None)
    early = _stopping(options, trial, comms, peers)
    return RankContext(
        options=options,
        layout=layout,
        role=role,
        comms=comms,
        backend=backend,
        data=data,
        algorithm=algorithm,
        sync_every=sync_every,
        worker_optimizer=worker_opt,
        master_optimizer=master_opt,
        run_dir=run_dir,
        run_id=run_id,
        log=log,
        stop=stop,
        checkpoints=Checkpoints(run_dir, keep=options.keep_checkpoints),
        history_file=HistoryFile(run_dir, writer=is_leader),
        resume_from=resume_from,
        early=early,
        is_leader=is_leader,
        make_replica=make_replica,
        peers=peers,
        store_path=database,
        recorder=recorder,
        resume_rank=resume.share.rank if resume.share is not None else None,
        resume_partial=resume.share is not None and resume.share.partial,
        relayout=resume.relayout,
        resumed_layout=resume.old,
        worker_lr=worker_lr,
        master_lr=master_lr,
        compression=compression,
        loss_growth=None if options.gan else LossGrowth(got.initial_loss),
        keep_state=trial.keep if trial else None,
        measures=got.measures,
    )


def _stopping(options: TrainOptions, trial: TrialTag | None, comms: Communicators, peers: Peers) -> EarlyStopping:
    """Early stopping, or for a study's trial its scheduler's pause and word on each epoch
    too; in an allreduce run every rank decides, so the leader's word goes to them all."""
    target = parse_target(options.target) if options.target else None
    if trial is None:
        return EarlyStopping(options.monitor, options.early_stopping, options.min_delta, target)
    share = None
    if trial.asks and options.topology == "allreduce" and comms.run.Get_size() > 1:
        share = _share_from_leader(peers, comms.run)
    return TrialStopping(
        options.monitor,
        options.early_stopping,
        options.min_delta,
        target,
        pause_at=trial.pause_at,
        ask=trial.ask if comms.run.Get_rank() == 0 else None,
        share=share,
    )


STUDY_WORD_BYTES = 512  # the longest word of a study on an epoch that the ranks share


def _share_from_leader(peers: Peers, comm: Any) -> Callable[[str], str]:
    buffer = np.zeros(STUDY_WORD_BYTES, np.uint8)

    def share(word: str) -> str:
        buffer[:] = 0
        if comm.Get_rank() == 0:
            data = word.encode()[: STUDY_WORD_BYTES - 1]
            buffer[: len(data)] = np.frombuffer(data, np.uint8)
        peers.collectives.bcast(comm, buffer, "the study's word on the epoch")
        return bytes(buffer).rstrip(b"\0").decode(errors="replace")

    return share


@dataclass(frozen=True, slots=True)
class _Resume:
    share: Share | None = None  # what this rank loads of the checkpoint
    relayout: bool = False
    old: Layout | None = None
    note: str = ""  # what laying the run out anew changed, for the user


def _plan_resume(path: Path | None, layout: Layout, comm: Any, restart: bool, options: TrainOptions) -> _Resume:
    """Which share of checkpoint `path` this rank loads (train/relayout.py): its own when
    the layout is the one that wrote it (and, restarting, on the same processes), else by
    its place in the new layout. Every rank works out the same plan for every rank."""
    if path is None:
        return _Resume()
    old = saved_layout(path)
    rank = comm.Get_rank()
    if old is None:  # written before checkpoints recorded their layout
        return _Resume(Share(rank))
    world = None
    if restart:
        world = ([int(r) for r in Checkpoints.read_meta(path).get("world_ranks", [])], _world_ranks(comm))
    if old == layout and (world is None or world[0] == world[1]):
        return _Resume(Share(rank), old=old)
    pipeline = options.worker_parallel == "pipeline"
    plans = plan_shares(old, layout, world, pipeline)
    if old.topology == "allreduce":
        epoch = int(Checkpoints.read_scalars(path, 0).get("epoch", 0))
    else:
        epoch = int(Checkpoints.read_scalars(path, centre_share(old, 0)).get("next_epoch", 0))
    return _Resume(plans[rank], True, old, change_note(old, layout, plans, epoch, restart))


def _world_ranks(comm: Any) -> list[int]:
    from mpi4py import MPI

    group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
    try:
        return list(MPI.Group.Translate_ranks(group, list(range(group.Get_size())), world))
    finally:
        group.Free()
        world.Free()


def _role_name(role: Role) -> str:
    if role.kind == "worker":
        boss = f" of master {role.master}" if role.master else ""
        proc = f", process {role.proc}" if role.proc else ""
        return f"worker {role.worker}{boss}{proc}"
    return f"{role.kind} {role.master}" if role.kind == "master" else role.kind


def check_metric_names(options: TrainOptions, trial: TrialTag | None, reported: list[str]) -> None:
    """Every metric an option names is one the run reports, or one error listing those."""
    named = [(f"--monitor {options.monitor}", options.monitor)]
    if options.target:
        named.append((f"--target {options.target!r}", parse_target(options.target).metric))
    named += trial.watched if trial else ()
    for given, name in named:
        if name not in reported:
            raise MetricNameError(f"{given}: this run reports {', '.join(reported)}{did_you_mean(name, reported)}")


def check_data_size(data: Data, layout: Layout, options: TrainOptions) -> None:
    """Samples for every worker's batches at every step (as the topologies' ShardPlan
    cuts them), and some to validate on."""
    for count, which, flag in ((data.n_train, "training", "--train"), (data.n_val, "validation", "--val")):
        if count == 0:
            raise DataError(
                f"the {which} set is empty ({data.n_train} training and {data.n_val} validation "
                f"samples): give the model's data {which} samples, or {flag} files that hold some"
            )
    shards = shards_of(layout, options)
    # A master-worker worker of several processes splits each of its batches between them.
    procs = layout.procs_per_worker if layout.masters else 1
    try:
        plan = ShardPlan(data.n_train, shards, options.batch_size, options.seed)
        smallest = data.n_train // (shards * plan.batches_per_epoch)
    except ValueError:
        smallest = 0
    if smallest < procs:
        raise DataError(_too_few_samples(data.n_train, shards, procs, options.batch_size))


def _too_few_samples(samples: int, shards: int, procs: int, batch_size: int) -> str:
    """What to change when `samples` cannot give each of `shards` workers (of `procs`
    processes each) at least one sample per process at every step."""
    each = f"at least {procs} samples (one per process)" if procs > 1 else "a batch"
    if samples < shards * procs:
        most = samples // procs
        fix = f"use at most {most} worker{'s' if most > 1 else ''}" if most else "use fewer processes per worker"
        fix += ", or give more training samples"
    else:  # one batch per worker per epoch always fits: batches of ceil(samples / shards)
        fix = f"use --batch-size {-(-samples // shards)} or more, or fewer workers"
    return (
        f"too few training samples for {shards} workers: {samples} with --batch-size {batch_size} leave a "
        f"worker without {each} at some step; {fix}"
    )


def _check_run_dir_writable(options: TrainOptions) -> None:
    if options.resume:
        _check_writable(Path(options.resume), "--resume")
    else:
        _check_writable(Path(options.runs_dir), "--runs-dir")


def _check_writable(path: Path, flag: str) -> None:
    """Create `path` and a file in it, as the run leader will; one clear error if it cannot
    (a read-only file system, no permission, a file where the directory should be)."""
    try:
        make_dir(path)
        with tempfile.TemporaryFile(dir=path):
            pass
    except (FileExistsError, NotADirectoryError):
        in_the_way = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), path)
        raise OptionsError(f"{flag} {path}: {in_the_way} is a file, not a directory; give a directory") from None
    except OSError as exc:
        raise OptionsError(
            f"{flag} {path}: cannot write there ({exc.strerror or exc}); give a directory you can write to"
        ) from None


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


def _find_resume(options: TrainOptions) -> tuple[Path | None, list[str]]:
    """The checkpoint to resume from and those passed over (one line each: damaged, or
    lacking a master's state). Every rank verifies the same files, so every rank picks the
    same checkpoint. The layout may differ from the one that wrote it (train/relayout.py)."""
    if not options.resume:
        return None, []
    run_dir = Path(options.resume)
    if not (run_dir / "options.json").exists():
        raise CheckpointError(f"--resume {options.resume}: not a run directory (no options.json)")
    latest, damaged = Checkpoints(run_dir).latest_intact(check_resumable)
    if latest is None and damaged:
        raise CheckpointError(
            f"--resume {options.resume}: no intact checkpoint is left ({'; '.join(damaged)}); "
            f"start the run afresh without --resume"
        )
    if latest is None:
        raise CheckpointError(f"--resume {options.resume}: the run has no complete checkpoint")
    return latest, damaged


def _fresh_dir(root: Path, name: str, database: str | None, trial: TrialTag | None = None) -> Path:
    """A new run directory named `name`, or name-2, name-3, ...: the first whose name is
    free here and in the run store (which jobs with other runs directories may share: a
    trial trained again by another job of the study must not reuse the first one's row).
    Both are taken atomically: the directory by mkdir, the name by the store's INSERT.
    The reserved row names its study and trial from the start: a job killed before its
    run began still leaves a row the study's views count as the trial's."""
    make_dir(root)
    store = None
    if database is not None:
        try:
            store = RunStore(database)
        except UserError:
            pass  # the recorder reports it, on every rank
    candidate, n = root / name, 1
    try:
        while True:
            try:
                make_dir(candidate, exclusive=True)
                if store is None or store.reserve_run(
                    candidate.name,
                    candidate.resolve(),
                    study=trial.study if trial else None,
                    trial=trial.number if trial else None,
                ):
                    return candidate
                candidate.rmdir()  # another job's run has this name
            except FileExistsError:
                pass
            n += 1
            candidate = root / f"{name}-{n}"
    finally:
        if store is not None:
            store.close()


def _write_run_files(run_dir: Path, options: TrainOptions, layout: Layout) -> None:
    # The store as given: --resume reconnects to it (a URL never holds a password: the
    # options refuse one, and libpq finds it in PGPASSWORD, ~/.pgpass or a service file).
    write_json(run_dir / "options.json", options.to_dict())
    write_json(run_dir / "layout.json", layout.to_dict())
    write_text(run_dir / "layout.txt", layout.tree() + "\n")
