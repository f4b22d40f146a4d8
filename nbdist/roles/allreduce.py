"""Allreduce topology: every rank is a worker; gradients are summed over all of them.

Gradients are reduced in buckets while backward is still running: the backend calls
back as soon as a contiguous bucket of the flat gradient is final, and that bucket's
reduction starts at once (later layers' buckets finish first), through the reducer
--allreduce-backend names (transport/reducers.py: MPI's Iallreduce, or a torch.distributed
group, NCCL on GPUs). After backward, the rank waits for the last buckets, and every
rank steps the same optimiser on the same gradient, so the replicas stay bit-identical.

A four-number trailer (samples, loss sum, metric sum, stop requests) is reduced with
the gradient: the global training loss costs no extra message, and a stop requested on
any rank (signal) stops every rank at the same step.

What a rank holds is a `Replica`: the whole model here, or one stage of a pipeline
replica (roles/pipeline.py's StageReplica, --worker-parallel pipeline), which reduces
with the same stage of the other replicas; the loop is the same.

Every rank waits for every other at each step, so a rank that dies or freezes ends the
run: the reduction fails (MPI's fault tolerance reports the dead rank) or runs past the
peer timeout (a roll call names the frozen one). With --max-restarts the survivors then
go on from the last checkpoint on fewer ranks (roles/runner.py).
"""

from __future__ import annotations

import functools
import time

import numpy as np

from nbdist.algorithms import allreduce_sgd
from nbdist.algorithms.arrays import f32
from nbdist.backends.base import BatchStats
from nbdist.data.sharding import split_evenly
from nbdist.train.batchnorm import synchronise_batchnorm
from nbdist.train.context import RankContext
from nbdist.train.loop import TrainReport, check_loss, run_epochs
from nbdist.train.lr import WorkerLr, lr_metrics
from nbdist.train.progress import (
    EpochTally,
    RunResult,
    epoch_metrics,
    format_epoch,
    sample_validation,
    validation_due,
    write_final,
)
from nbdist.train.state import load_rank_state, save_rank_state
from nbdist.train.validation import SampleMarks
from nbdist.train.writer import CheckpointWriter
from nbdist.transport.reducers import Reducer, make_reducer
from nbdist.transport.staging import Staging

__all__ = ["AllreduceRun", "CheckpointAgreement", "Replica", "run_allreduce"]


class Replica:
    """What this rank holds of one replica of the model, and the ranks it reduces with.

    Here the whole model: every rank of the run is a replica of its own, takes its own
    shard of each batch and reduces its whole gradient over the run. (roles/pipeline.py's
    StageReplica: one pipeline stage of a replica, reduced with that stage of the others.)"""

    def __init__(self, ctx: RankContext):
        self.ctx = ctx
        self.comm = ctx.comms.run  # the ranks that hold the same parameters as this one
        self.index, self.count = self.comm.Get_rank(), self.comm.Get_size()  # shard, of shards
        # The rank whose checkpoint share holds this rank's weights and optimiser bit for bit.
        self.twin = ctx.layout.fold_ranks(*ctx.role.run)[0]

    def gradients(self, x, y, scale: float) -> BatchStats:
        """This rank's gradient of its shard (x, y), times `scale`; the shard's sums."""
        return self.ctx.backend.compute_gradients(x, y, scale=scale)

    def share_sums(self, trailer: np.ndarray) -> None:
        """The trailer (samples, loss, metric, stops) as the replica's, before it is reduced."""

    def evaluate(self, x, y) -> BatchStats:
        return self.ctx.backend.evaluate(x, y) if len(y) else BatchStats()

    def final_arrays(self) -> dict[str, np.ndarray] | None:
        """The whole model's named arrays on the run's first rank (None elsewhere)."""
        return self.ctx.backend.named_arrays() if self.comm.Get_rank() == 0 else None


def run_allreduce(ctx: RankContext, replica: Replica | None = None) -> RunResult | None:
    """Train this rank's replica with every other; the run's result on its first rank."""
    return AllreduceRun(ctx, replica or Replica(ctx)).run()


class AllreduceRun:
    """One rank's allreduce run, along its data flow: set up (optimiser, reducer, data
    plan), resume or broadcast the weights, then per step a gradient reduced over the
    replicas and the same optimiser step everywhere, per epoch validation and checkpoints.

    `run_epochs` (train/loop.py) drives `begin_epoch`, `train_step` and `end_epoch`; what
    they share (the run's position, the epoch's tally, the stop reason) lives here."""

    def __init__(self, ctx: RankContext, replica: Replica):
        self.ctx, self.replica, self.backend = ctx, replica, ctx.backend
        self.comm = ctx.comms.run
        self.rank = self.comm.Get_rank()
        self.collectives = ctx.peers.collectives
        # The weights and BatchNorm statistics as MPI sees them (zero-copy on the host).
        self.params = Staging(self.backend.params, self.backend.copier)
        self.model_state = Staging(self.backend.state, self.backend.copier)
        if ctx.worker_optimizer is None:
            raise RuntimeError("the allreduce topology steps with --worker-optimizer, and none was resolved")
        self.opt = self.backend.make_optimizer(ctx.worker_optimizer)
        self.reducer = self._make_reducer()
        if self.reducer.note:
            ctx.say(f"nbdist: note: {self.reducer.note}")
        # --sync-batchnorm: the statistics are the whole step's, the same on every rank.
        self.shared_statistics = synchronise_batchnorm(ctx, self.comm)
        self.plan = ctx.data.plan(replica.count, ctx.options.batch_size, ctx.options.seed)
        self.lr = WorkerLr(ctx.worker_lr, self.opt, self.plan.batches_per_epoch)
        self.val_indices = split_evenly(np.arange(ctx.data.n_val), replica.count, replica.index)

        self.history: list[dict] = []
        self.start_epoch, self.start_step = 0, 0
        self.samples_seen = 0  # over all ranks, from the start of the run: every rank counts the same
        if ctx.resume_from is not None:
            self._resume(ctx.resume_from)
        else:
            self.collectives.bcast(replica.comm, self.params)
            self.collectives.bcast(replica.comm, self.model_state)

        self.trailer = np.zeros(4, np.float32)  # samples, loss sum, metric sum, stop requests
        every = ctx.options.validate_every_samples
        self.marks = SampleMarks(every, self.samples_seen) if every else None
        self.started = time.time()
        self.stop_reason = ""
        self.report = TrainReport(ctx, ("compute", "wait", "update"))
        self.tally, self.n_batches = EpochTally(), 0
        self.sizes: np.ndarray = np.empty((0, 0), np.int64)  # the step's shard sizes, per step
        # After the broadcast: its communicator is a duplicate, and duplicating is collective.
        self.checkpoints = CheckpointAgreement(ctx, self.comm)

    def _make_reducer(self) -> Reducer:
        """The bucketed reducer --allreduce-backend names, over the replica's ranks."""
        options = self.ctx.options
        return make_reducer(
            options.allreduce_backend,
            self.replica.comm,
            self.backend,
            max(1, int(options.bucket_mb * 2**20 / 4)),  # float32 elements per bucket
            self.collectives,
            compression=self.ctx.compression,
        )

    def _resume(self, path) -> None:
        """The weights, optimiser, reducer state and position of the checkpoint at `path`."""
        ctx = self.ctx
        carried = self.reducer.state_arrays()  # --compression's residuals, PowerSGD's Q
        extra = load_rank_state(ctx, path, self.opt, None, own=carried)
        self.reducer.load_state_arrays(carried)
        # On another layout the shards are new: the checkpoint's epoch again from its start.
        self.start_epoch, self.start_step = int(extra["epoch"]), 0 if ctx.relayout else int(extra["step"])
        ctx.early.load_json(extra.get("early", {}))
        self.history = ctx.history_file.resume(extra)
        self.samples_seen = int(extra.get("samples_seen", sum(h.get("samples", 0) for h in self.history)))
        ctx.say(f"resumed from {path} at epoch {self.start_epoch + 1}")

    def run(self) -> RunResult | None:
        """Every epoch, then the run's record; the result on the run's first rank."""
        try:
            epoch = run_epochs(
                self.start_epoch,
                self.start_step,
                self.ctx.options.epochs,
                self.begin_epoch,
                self.train_step,
                self.end_epoch,
            )
            self.checkpoints.settle(block=True)
        except BaseException:
            self.checkpoints.abandon()
            raise
        finally:
            self.checkpoints.close()
        return self._finish(epoch)

    def begin_epoch(self, epoch: int) -> list[np.ndarray]:
        """This replica's batches of `epoch`, and every replica's shard sizes per step."""
        self.tally = EpochTally()
        batches = self.plan.epoch(epoch, self.replica.index)
        self.sizes, self.n_batches = self.plan.step_sizes(epoch), len(batches)
        return batches

    def train_step(self, epoch: int, step: int, indices: np.ndarray, last: bool) -> bool:
        """One batch, its gradient summed over every rank; True when a rank asked to stop."""
        report = self.report
        t0 = time.perf_counter()
        sent = self.reducer.bytes_sent  # the buckets start during backward
        stats = self._local_gradient(step, indices)
        t1 = time.perf_counter()
        total = self._reduce(stats)
        report.bytes_sent += self.reducer.bytes_sent - sent
        t2 = time.perf_counter()
        self._step_optimiser(total, epoch, step)
        t3 = time.perf_counter()
        report.phases["compute"] += t1 - t0
        report.phases["wait"] += t2 - t1
        report.phases["update"] += t3 - t2
        self.tally.train.add(total)
        self.samples_seen += total.n
        self._validate_at_mark(epoch, step)
        report.add(stats)
        if report.due:
            report.emit(epoch, step)
        if self.trailer[3] > 0:
            self.stop_reason = self.ctx.stop.reason or "stopped: requested on another rank"
            self._save(f"stopped-{epoch:04d}{step + 1:06d}", epoch, step + 1)
            return True
        self.checkpoints.settle(block=False)
        return False

    def _local_gradient(self, step: int, indices: np.ndarray) -> BatchStats:
        """This rank's gradient of its shard, scaled by the shard's part of the step's
        samples so that the reduced sum is the whole batch's mean gradient."""
        x, y = self.ctx.data.train_batch(indices)
        share = allreduce_sgd.sample_share(self.sizes[step], self.replica.index)
        return self.replica.gradients(x, y, scale=share)

    def _reduce(self, stats: BatchStats) -> BatchStats:
        """Wait for the gradient's last buckets, the trailer with them; the step's global sums."""
        trailer = self.trailer
        trailer[:] = (stats.n, stats.loss_sum, stats.metric_sum, float(self.ctx.stop.requested))
        self.replica.share_sums(trailer)
        self.reducer.finish(trailer)
        self.ctx.peers.pace.heard()
        return BatchStats(float(trailer[1]), float(trailer[2]), int(trailer[0]))

    def _step_optimiser(self, total: BatchStats, epoch: int, step: int) -> None:
        """The same step on every rank from the same gradient: the replicas stay identical."""
        check_loss(total, epoch, step)
        self.lr.before_step(epoch, step)
        allreduce_sgd.apply(self.opt, self.backend.rule_grads)

    def _validate_at_mark(self, epoch: int, step: int) -> None:
        """--validate-every-samples: validate when the run's sample count passes a mark."""
        marks, seen = self.marks, self.samples_seen
        if marks is None or not marks.due(seen):
            return
        # Every rank passes the mark at the same step (the trailer's global count).
        marks.passed(seen)
        val = self._validate()
        if self.ctx.is_leader:
            self.ctx.log.emit(
                "val",
                sample_validation(seen, val, self.backend.metric_name),
                step=epoch * self.n_batches + step + 1,
                epoch=epoch,
            )

    def end_epoch(self, epoch: int) -> bool:
        """Validate, report, decide; True when early stopping ends the run."""
        ctx = self.ctx
        val = None
        if validation_due(ctx.options, epoch):
            val = self._validate()
        tally = self.tally
        metrics = epoch_metrics(
            epoch, tally, val, time.time() - tally.started, self.backend.metric_name, self.samples_seen
        )
        metrics.update(lr_metrics(ctx.worker_lr, None, epoch))
        self.history.append(metrics)
        if ctx.is_leader:
            # Every rank holds the same global metrics; one record per epoch, like a master's.
            ctx.log.emit("epoch", metrics, step=(epoch + 1) * self.n_batches, epoch=epoch + 1)
        ctx.say(format_epoch(metrics, ctx.options.epochs))
        ctx.watch_loss(metrics)
        ctx.watch_checkpoints(metrics, self.checkpoints.writer)
        decision = ctx.early.update(metrics)
        if ctx.checkpoint_due(epoch + 1) or decision.stop:
            self._save(f"epoch-{epoch + 1:04d}", epoch + 1, 0)
        if decision.stop:
            self.stop_reason = decision.reason
        return decision.stop

    def _validate(self) -> BatchStats:
        # Without --sync-batchnorm each replica's statistics are its own: averaged first.
        model_state = None if self.shared_statistics else self.model_state
        return _validate(self.ctx, self.replica, self.val_indices, model_state)

    def _save(self, label: str, epoch: int, step: int) -> None:
        """This rank's share of checkpoint `label`, written on the checkpoint thread."""
        ctx = self.ctx
        save_rank_state(
            ctx,
            label,
            self.opt,
            None,
            {
                "epoch": epoch,
                "step": step,
                "early": ctx.early.to_json(),
                "samples_seen": self.samples_seen,
                **ctx.history_file.checkpoint(self.history, self.checkpoints.writer),
            },
            own=self.reducer.state_arrays(),
            same_as=self.replica.twin,
            writer=self.checkpoints.writer,
        )

    def _finish(self, epoch: int) -> RunResult | None:
        """The run's record and, on its first rank, the final weights and result."""
        ctx, reducer = self.ctx, self.reducer
        self.report.emit(epoch, 0)
        reducer.close()
        reason = self.stop_reason or f"completed {ctx.options.epochs} epochs"
        faults = {"restarts": ctx.attempt} if ctx.attempt else {}
        ctx.log.emit(
            "run",
            {
                "status": "stopped" if self.stop_reason else "completed",
                "reason": reason,
                "allreduce": reducer.way,
                **({"allreduce_note": reducer.note} if reducer.note else {}),
                **faults,
            },
        )
        ctx.log.close()
        final = self.replica.final_arrays()
        if self.rank != 0:
            return None
        if final is None:
            raise RuntimeError("rank 0 of the run gathered no final weights")
        return write_final(ctx.run_dir, final, self.history, reason, time.time() - self.started, faults)


class CheckpointAgreement:
    """Checkpoints that every rank writes a share of, committed once all shares are on disk.

    Each rank writes its share on a thread (train/writer.py), from copies: the ranks go on
    training. Once its share is on disk a rank starts a barrier for that checkpoint (in
    the same order on every rank); when the barrier is done, every rank's is, and rank 0
    commits it (on its writer, after its own share). The barriers have a communicator of
    their own: each rank starts one between other steps' gradient buckets, and
    collectives on one communicator must start in the same order on every rank."""

    def __init__(self, ctx: RankContext, comm):
        self.ctx = ctx
        self.rank = comm.Get_rank()
        self.writer = CheckpointWriter()
        self.comm = comm.Dup()
        self.agreeing: list = []  # (label, barrier) of the shares this rank has written, oldest first

    def settle(self, block: bool) -> None:
        """Start the barriers of the shares written since, commit the checkpoints every rank
        has written; `block`: until every checkpoint saved is committed."""
        collectives, writer = self.ctx.peers.collectives, self.writer
        for label in writer.finish() if block else writer.written():
            self.agreeing.append((label, collectives.start_barrier(self.comm, f"checkpoint {label}")))
        while self.agreeing and (block or self.agreeing[0][1].done()):
            label, barrier = self.agreeing.pop(0)
            barrier.wait()
            if self.rank == 0:
                self._commit(label)
        if block:
            writer.finish()

    def _commit(self, label: str) -> None:
        ctx = self.ctx
        meta = {
            "label": label,
            "layout": ctx.layout.to_dict(),
            "options": ctx.options.to_dict(),
            "world_ranks": ctx.world_ranks,
            "time": time.time(),
        }
        self.writer.submit(functools.partial(ctx.checkpoints.commit, label, meta))

    def abandon(self) -> None:
        """The run failed: a restart reads the checkpoints, not while this rank's writer is at one."""
        self.writer.settle()

    def close(self) -> None:
        self.comm.Free()


def _validate(ctx: RankContext, replica: Replica, indices: np.ndarray, model_state: Staging | None) -> BatchStats:
    """Each replica evaluates its slice of the validation set; the sums are added up over
    the run. `model_state`: the statistics to average first (None: the same everywhere)."""
    collectives = ctx.peers.collectives
    if model_state is not None and len(model_state.device):
        # BatchNorm statistics differ per replica (each saw its own batches): use their mean.
        collectives.allreduce(replica.comm, model_state, "the validation")
        state = model_state.device
        state /= f32(replica.count)
    x, y = ctx.data.val_batch(indices)
    local = replica.evaluate(x, y)
    sums = np.array([local.loss_sum, local.metric_sum, local.n], np.float64)
    collectives.allreduce(ctx.comms.run, sums, "the validation")
    return BatchStats(float(sums[0]), float(sums[1]), int(sums[2]))
