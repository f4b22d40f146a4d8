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
from nbdist.train.progress import EpochTally, RunResult, epoch_metrics, format_epoch, sample_validation, write_final
from nbdist.train.state import load_rank_state, save_rank_state
from nbdist.train.validation import SampleMarks
from nbdist.train.writer import CheckpointWriter
from nbdist.transport.reducers import make_reducer
from nbdist.transport.staging import Staging

__all__ = ["Replica", "run_allreduce"]


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
    replica = replica or Replica(ctx)
    comm = ctx.comms.run
    rank = comm.Get_rank()
    backend = ctx.backend
    # The weights and BatchNorm statistics as MPI sees them (zero-copy on the host).
    params, model_state = Staging(backend.params, backend.copier), Staging(backend.state, backend.copier)
    if ctx.worker_optimizer is None:
        raise RuntimeError("the allreduce topology steps with --worker-optimizer, and none was resolved")
    opt = backend.make_optimizer(ctx.worker_optimizer)
    collectives = ctx.peers.collectives
    reducer = make_reducer(
        ctx.options.allreduce_backend,
        replica.comm,
        backend,
        max(1, int(ctx.options.bucket_mb * 2**20 / 4)),
        collectives,
        compression=ctx.compression,
    )
    # --sync-batchnorm: the statistics are the whole step's, the same on every rank.
    shared_statistics = synchronise_batchnorm(ctx, comm)
    plan = ctx.data.plan(replica.count, ctx.options.batch_size, ctx.options.seed)
    lr = WorkerLr(ctx.worker_lr, opt, plan.batches_per_epoch)
    val_indices = split_evenly(np.arange(ctx.data.n_val), replica.count, replica.index)

    history: list[dict] = []
    start_epoch, start_step = 0, 0
    samples_seen = 0  # over all ranks, from the start of the run: every rank counts the same
    if ctx.resume_from is not None:
        carried = reducer.state_arrays()  # --compression's residuals, PowerSGD's Q
        extra = load_rank_state(ctx, ctx.resume_from, opt, None, own=carried)
        reducer.load_state_arrays(carried)
        # On another layout the shards are new: the checkpoint's epoch again from its start.
        start_epoch, start_step = int(extra["epoch"]), 0 if ctx.relayout else int(extra["step"])
        ctx.early.load_json(extra.get("early", {}))
        history = ctx.history_file.resume(extra)
        samples_seen = int(extra.get("samples_seen", sum(h.get("samples", 0) for h in history)))
        ctx.say(f"resumed from {ctx.resume_from} at epoch {start_epoch + 1}")
    else:
        collectives.bcast(replica.comm, params)
        collectives.bcast(replica.comm, model_state)

    trailer = np.zeros(4, np.float32)
    every = ctx.options.validate_every_samples
    marks = SampleMarks(every, samples_seen) if every else None
    started = time.time()
    stop_reason = ""
    report = TrainReport(ctx, ("compute", "wait", "update"))
    tally, n_batches = EpochTally(), 0
    sizes: np.ndarray = np.empty((0, 0), np.int64)  # the step's shard sizes, per step (begin_epoch)

    # Each rank writes its share on a thread (train/writer.py), from copies: the ranks go on
    # training. Once its share is on disk a rank starts a barrier for that checkpoint (in
    # the same order on every rank); when the barrier is done, every rank's is, and rank 0
    # commits it (on its writer, after its own share). The barriers have a communicator of
    # their own: each rank starts one between other steps' gradient buckets, and
    # collectives on one communicator must start in the same order on every rank.
    writer = CheckpointWriter()
    checkpoint_comm = comm.Dup()
    agreeing: list = []  # (label, barrier) of the shares this rank has written, oldest first

    def save(label: str, epoch: int, step: int) -> None:
        save_rank_state(
            ctx,
            label,
            opt,
            None,
            {
                "epoch": epoch,
                "step": step,
                "early": ctx.early.to_json(),
                "samples_seen": samples_seen,
                **ctx.history_file.checkpoint(history),
            },
            own=reducer.state_arrays(),
            same_as=replica.twin,
            writer=writer,
        )

    def settle_checkpoints(block: bool) -> None:
        """Start the barriers of the shares written since, commit the checkpoints every rank
        has written; `block`: until every checkpoint saved is committed."""
        for label in writer.finish() if block else writer.written():
            agreeing.append((label, collectives.start_barrier(checkpoint_comm, f"checkpoint {label}")))
        while agreeing and (block or agreeing[0][1].done()):
            label, barrier = agreeing.pop(0)
            barrier.wait()
            if rank == 0:
                meta = {
                    "label": label,
                    "layout": ctx.layout.to_dict(),
                    "options": ctx.options.to_dict(),
                    "world_ranks": ctx.world_ranks,
                    "time": time.time(),
                }
                writer.submit(functools.partial(ctx.checkpoints.commit, label, meta))
        if block:
            writer.finish()

    def begin_epoch(epoch: int) -> list[np.ndarray]:
        nonlocal tally, sizes, n_batches
        tally = EpochTally()
        batches = plan.epoch(epoch, replica.index)
        sizes, n_batches = plan.step_sizes(epoch), len(batches)
        return batches

    def train_step(epoch: int, step: int, indices: np.ndarray, last: bool) -> bool:
        """One batch, its gradient summed over every rank; True when a rank asked to stop."""
        nonlocal samples_seen, stop_reason
        t0 = time.perf_counter()
        sent = reducer.bytes_sent  # the buckets start during backward
        x, y = ctx.data.train_batch(indices)
        share = allreduce_sgd.sample_share(sizes[step], replica.index)
        stats = replica.gradients(x, y, scale=share)
        t1 = time.perf_counter()
        trailer[:] = (stats.n, stats.loss_sum, stats.metric_sum, float(ctx.stop.requested))
        replica.share_sums(trailer)
        reducer.finish(trailer)
        report.bytes_sent += reducer.bytes_sent - sent
        t2 = time.perf_counter()
        ctx.peers.pace.heard()
        global_stats = BatchStats(float(trailer[1]), float(trailer[2]), int(trailer[0]))
        check_loss(global_stats, epoch, step)
        lr.before_step(epoch, step)
        allreduce_sgd.apply(opt, backend.rule_grads)
        t3 = time.perf_counter()
        report.phases["compute"] += t1 - t0
        report.phases["wait"] += t2 - t1
        report.phases["update"] += t3 - t2
        tally.train.add(global_stats)
        samples_seen += global_stats.n
        if marks is not None and marks.due(samples_seen):
            # Every rank passes the mark at the same step (the trailer's global count).
            marks.passed(samples_seen)
            val = _validate(ctx, replica, val_indices, None if shared_statistics else model_state)
            if ctx.is_leader:
                ctx.log.emit(
                    "val",
                    sample_validation(samples_seen, val, backend.metric_name),
                    step=epoch * n_batches + step + 1,
                    epoch=epoch,
                )
        report.add(stats)
        if report.due:
            report.emit(epoch, step)
        if trailer[3] > 0:
            stop_reason = ctx.stop.reason or "stopped: requested on another rank"
            save(f"stopped-{epoch:04d}{step + 1:06d}", epoch, step + 1)
            return True
        settle_checkpoints(block=False)
        return False

    def end_epoch(epoch: int) -> bool:
        """Validate, report, decide; True when early stopping ends the run."""
        nonlocal stop_reason
        val = None
        if (epoch + 1) % ctx.options.validate_every == 0 or epoch + 1 == ctx.options.epochs:
            val = _validate(ctx, replica, val_indices, None if shared_statistics else model_state)
        metrics = epoch_metrics(epoch, tally, val, time.time() - tally.started, backend.metric_name, samples_seen)
        metrics.update(lr_metrics(ctx.worker_lr, None, epoch))
        history.append(metrics)
        if ctx.is_leader:
            # Every rank holds the same global metrics; one record per epoch, like a master's.
            ctx.log.emit("epoch", metrics, step=(epoch + 1) * n_batches, epoch=epoch + 1)
        ctx.say(format_epoch(metrics, ctx.options.epochs))
        ctx.watch_loss(metrics)
        decision = ctx.early.update(metrics)
        if ctx.checkpoint_due(epoch + 1) or decision.stop:
            save(f"epoch-{epoch + 1:04d}", epoch + 1, 0)
        if decision.stop:
            stop_reason = decision.reason
        return decision.stop

    try:
        epoch = run_epochs(start_epoch, start_step, ctx.options.epochs, begin_epoch, train_step, end_epoch)
        settle_checkpoints(block=True)
    except BaseException:
        writer.settle()  # a restart reads the checkpoints: not while this rank's writer is at one
        raise
    finally:
        checkpoint_comm.Free()
    report.emit(epoch, 0)
    reducer.close()
    reason = stop_reason or f"completed {ctx.options.epochs} epochs"
    faults = {"restarts": ctx.attempt} if ctx.attempt else {}
    ctx.log.emit(
        "run",
        {"status": "stopped" if stop_reason else "completed", "reason": reason, "allreduce": reducer.way, **faults},
    )
    ctx.log.close()
    final = replica.final_arrays()
    if rank != 0:
        return None
    if final is None:
        raise RuntimeError("rank 0 of the run gathered no final weights")
    return write_final(ctx.run_dir, final, history, reason, time.time() - started, faults)


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
