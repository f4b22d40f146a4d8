"""Setting up one rank: options, layout, model, data, rule and run directory.

Everything that can be wrong with the user's input is checked here, on every rank,
before any rank starts to train; the ranks then agree (one small allgather) so that a
mistake becomes the same clear error everywhere instead of a hang or a traceback from
one rank.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nbdist.algorithms import Algorithm
from nbdist.backends import Backend, DeviceRequest
from nbdist.data.base import Data
from nbdist.errors import UserError
from nbdist.layout import Communicators, Layout, Role
from nbdist.metrics.log import RecordSink, RunLog
from nbdist.options import TrainOptions, parse_target
from nbdist.specs import Spec
from nbdist.store import RunRecorder, place_store, store_path
from nbdist.train.checkpoint import Checkpoints
from nbdist.train.checkpoint_cost import CheckpointCost
from nbdist.train.data_checks import check_data_size
from nbdist.train.definition import ModelDefinition
from nbdist.train.history import HistoryFile
from nbdist.train.loop import LossGrowth
from nbdist.train.lr import LrPlan
from nbdist.train.relayout import Share, change_note, epochs_done, plan_shares, saved_layout
from nbdist.train.rules import DEFAULT_MASTER_OPTIMIZER, DEFAULT_WORKER_OPTIMIZER
from nbdist.train.run_dir import check_resumed_model, fresh_dir, run_name, write_run_files
from nbdist.train.settle import Settled, settle
from nbdist.train.stopping import EarlyStopping, StopFlag, TrialStopping
from nbdist.train.trial import MetricNameError, TrialTag, check_metric_names
from nbdist.train.writer import CheckpointWriter
from nbdist.transport.agreement import agree
from nbdist.transport.interfaces import launch_spans_hosts
from nbdist.transport.node import local_rank, polling_suits_node
from nbdist.transport.peers import Peers
from nbdist.transport.waiting import poll_without_sleeping

# The set-up's steps live in modules of their own (train/settle.py, rules.py, run_dir.py,
# trial.py, data_checks.py); their public names are re-exported here, where callers import them.
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
    "DEFAULT_WORKER_OPTIMIZER",
    "DEFAULT_MASTER_OPTIMIZER",
]


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
    checkpoint_cost: CheckpointCost | None = None  # the leader's watch on what its checkpoints cost (None: none)
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

    def watch_checkpoints(self, metrics: dict[str, Any], writer: CheckpointWriter) -> None:
        """After each epoch, on the run leader, before its checkpoint: one note when its
        `writer`'s CPU time is a large share of the epochs' time (train/checkpoint_cost.py)."""
        if self.is_leader and self.checkpoint_cost is not None:
            note = self.checkpoint_cost.check(int(metrics["epoch"]), float(metrics["seconds"]), *writer.work_done())
            if note is not None:
                self.say(f"nbdist: note: {note}")

    def checkpoint_due(self, epochs_done: int) -> bool:
        every = self.options.checkpoint_every
        return epochs_done == self.options.epochs or (every > 0 and epochs_done % every == 0)


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
        settled = settle(options, definition, comm.Get_size(), comm.Get_rank(), device, trial, restart_of, run=written)
        options = settled.options
        if settled.resume_from is not None and restart_of is None and comm.Get_rank() == 0:
            check_resumed_model(settled.resume_from, settled.backend.num_params)
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
            name = options.run_name or run_name(options)
            run_dir = fresh_dir(
                Path(options.runs_dir), name, store_path(options.store, options.runs_dir) if record else None, trial
            )
            name = str(run_dir)
        run_dir = Path(run_comm.bcast(name, root=0))
    if is_leader:
        write_run_files(run_dir, written or options, layout)
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
        if resume_from is not None and restart_of is None and trial is None and resume.old is not None:
            _warn_if_trained(resume_from, resume.old, options.epochs)
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
        checkpoint_cost=CheckpointCost(options.checkpoint_every, options.epochs),
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
    return _Resume(plans[rank], True, old, change_note(old, layout, plans, epochs_done(path, old), restart))


def _warn_if_trained(checkpoint: Path, old: Layout, epochs: int) -> None:
    """--epochs is the run's total, not how many more: a resume of a run that has trained
    that many trains nothing, and would otherwise end as "completed"."""
    done = epochs_done(checkpoint, old)
    if done >= epochs:
        print(
            f"nbdist: warning: --epochs {epochs} is the run's total, and {checkpoint.name} has trained {done}: "
            f"nothing is left to train (give --epochs above {done} to train on)",
            file=sys.stderr,
            flush=True,
        )


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
