"""A worker of the master/worker topology: train on its shard, exchange with its master.

Each batch's gradient goes to the rule (`worker_step`: a local optimiser step, or an
accumulation); when the rule says so, the worker's leader sends its message to the master
and waits for the reply. A worker spanning several processes (N_P > 1) allreduces its
gradient over its own communicator; its leader alone talks to the master and broadcasts
the reply. (With --worker-parallel pipeline its processes are pipeline stages instead:
roles/pipeline.py overrides how they compute a gradient and share a message.)

The reply says how to go on: CONTINUE (apply it), STOP (save this rank's share of the
stop checkpoint and leave), SNAPSHOT (save this rank's share of an asynchronous checkpoint,
then send the same message again), DROPPED (the master went on without this worker: it
was silent too long). A reply that ends an epoch also names the workers that share the
next epoch's data (membership.py).

A master that died, or that stays silent longer than the peer timeout, ends the run:
RankLost / RankSilent, which the run's other ranks hear of over the control channel.
When one process of a multi-process worker is lost in an asynchronous run, the worker
leaves (the master is told LOST) and the run goes on without it.

Where it starts (a resume) and its shares of the checkpoints are worker_checkpoints.py's
`WorkerCheckpoints`, which `Worker` extends.
"""

from __future__ import annotations

import time

import numpy as np

from nbdist.algorithms.arrays import to_numpy
from nbdist.backends.base import BatchStats, all_finite
from nbdist.data.sharding import split_evenly
from nbdist.roles.membership import batches_for
from nbdist.roles.worker_checkpoints import WorkerCheckpoints
from nbdist.train.batchnorm import synchronise_batchnorm
from nbdist.train.context import RankContext
from nbdist.train.loop import NonFiniteLoss, TrainReport, check_loss, run_epochs
from nbdist.train.lr import WorkerLr, rule_lr
from nbdist.train.writer import CheckpointWriter
from nbdist.transport import messages as m
from nbdist.transport.compression import Compressor, make_codec
from nbdist.transport.deadlines import Silence
from nbdist.transport.faults import RunFailure
from nbdist.transport.reduction import compressed_reduction
from nbdist.transport.staging import Staging
from nbdist.transport.worker_channel import WorkerChannel

__all__ = ["Worker", "run_worker"]


class _Leave(Exception):
    """This worker is done with the run early: stopped, dropped or lost (the run goes on)."""


class Worker(WorkerCheckpoints):
    # Whether the worker's processes each hold the whole model and sum their gradients
    # (roles/pipeline.py's PipelineWorker: each holds one stage, and builds its own message).
    replicas = True

    def __init__(self, ctx: RankContext):
        self.ctx = ctx
        role, backend = ctx.role, ctx.backend
        self.block, self.wcomm = ctx.comms.block, ctx.comms.worker
        self.leader, self.procs = role.is_leader, self.wcomm.Get_size()
        reduces = self.procs > 1 and self.replicas  # a gradient summed over the worker's processes
        # The rule runs where the model lives (torch tensors on its device, or numpy views);
        # MPI reads the flat buffers only through their staging (zero-copy on the host).
        self.rule_params, self.rule_grads = backend.rule_params, backend.rule_grads
        self.params = Staging(backend.params, backend.copier)
        self.model_state = Staging(backend.state, backend.copier)
        # Compressed, the worker's gradient goes through host memory (the codecs are numpy).
        self.grads = (
            Staging(backend.grads, backend.copier, cuda_aware=False if ctx.compression else None) if reduces else None
        )
        if reduces:
            synchronise_batchnorm(ctx, self.wcomm)  # --sync-batchnorm: over the worker's processes
        n, s = backend.num_params, len(backend.state)
        self.opt = backend.make_optimizer(ctx.worker_optimizer) if ctx.worker_optimizer else None
        self.rule_state = ctx.rule.new_worker_state(n, ctx.sync_every, like=self.rule_params)
        # One shard per worker of the whole run, sub-masters' workers included: an epoch is
        # one pass over the data however the workers are grouped.
        self.workers, masters = ctx.layout.workers, max(ctx.layout.masters, 1)
        self.plan = ctx.data.plan(masters * self.workers, ctx.options.batch_size, ctx.options.seed)
        self.first_shard = role.master_index * self.workers
        taker = self.opt if self.opt is not None else rule_lr(ctx.algorithm)  # GEM steps with its own lr
        self.lr = WorkerLr(ctx.worker_lr, taker, self.plan.batches_per_epoch)
        self.members: tuple[int, ...] = tuple(range(self.workers))
        self.version = 0
        # --compression: the leader encodes its message (one point: _exchange); a worker of
        # several processes also reduces its gradient through the codec (_reduce_gradient).
        compression = ctx.compression if self.replicas else None
        codec = make_codec(compression, n, backend.param_blocks()) if compression is not None else None
        self.compressor = Compressor(codec) if codec is not None and self.leader else None
        self.carried_before: dict[str, np.ndarray] = {}  # the compressor's state before the last message
        self.reduction = (
            compressed_reduction(self.wcomm, compression, n, [(0, n)], backend.param_blocks())
            if compression is not None and reduces
            else None
        )
        self.out = m.Message(n, s, codec.wire_size if codec is not None else 0)
        self.reply_header = m.new_header(self.workers)
        self.reply_payload = np.empty(n, np.float32)
        # The message's payload and the reply as the rule sees them (zero-copy on the host).
        self.message = Staging.of_host(self.out.payload, self.rule_params, backend.copier)
        self.reply = Staging.of_host(self.reply_payload, self.rule_params, backend.copier)
        self.sync = BatchStats()  # since the last message: its header's sums
        self.report = TrainReport(ctx, ("compute", "send", "wait"))
        self.pending_ack = m.NO_CHECKPOINT
        self.epochs_acked = 0
        # A worker of one process writes its checkpoint shares on a thread (train/writer.py)
        # and acknowledges each in the first message after it is on disk; the processes of a
        # bigger worker write at once, since the leader acknowledges for all of them.
        self.writer = CheckpointWriter() if self.procs == 1 else None
        self.writing: dict[str, float] = {}  # label -> its acknowledgement code, once written
        self.totals = np.zeros(3, np.float64)
        self.overflows = 0  # fp16 gradients left out (_overflowed)
        self.master_rank = next(
            r
            for r in ctx.layout.fold_ranks(*role.run)
            if ctx.layout.role(r).kind == "master" and ctx.layout.role(r).master == role.master
        )
        self.channel = WorkerChannel(
            self.block,
            self.reply_header,
            self.reply_payload,
            Silence(ctx.options.peer_timeout),
            master="the master",
            master_rank=self.master_rank,
            describe=ctx.peers.directory.describe,
            listener=ctx.comms.world.Get_rank(),
        )

    # -- the loop ---------------------------------------------------------------------
    def run(self) -> None:
        ctx = self.ctx
        start_epoch, start_step = self._start()
        self.epochs_acked = start_epoch  # the checkpoints before it are not this worker's to write
        try:
            run_epochs(start_epoch, start_step, ctx.options.epochs, self._batches, self._train_step, self._end_epoch)
            self._report(ctx.options.epochs, 0)
            if self.leader:
                self._send(m.DONE, ctx.options.epochs, 0)
        except _Leave:
            pass
        except RunFailure as failure:
            if not self._leave_lost(failure):
                raise
        finally:
            if self.writer is not None:
                # A restart reads the checkpoints: not while this worker's writer is at one
                # (a no-op after the DONE message, which waited for every write).
                self.writer.settle()
            ctx.log.close()

    def _end_epoch(self, epoch: int) -> None:
        # Synchronous workers write their share of every due epoch checkpoint at its end;
        # asynchronous ones when the master asks (SNAPSHOT), and at their own end, since
        # the master's last snapshot comes when they may have finished already.
        ctx = self.ctx
        last = epoch + 1 == ctx.options.epochs
        if ctx.checkpoint_due(epoch + 1) and (ctx.options.synchronous or last):
            label = m.label_of(epoch + 1)
            self._save(label, epoch + 1, 0)
            self._acknowledge(label, m.label_code(label))

    def _batches(self, epoch: int) -> list[np.ndarray]:
        me = self.ctx.role.worker_index
        if len(self.members) == self.workers:
            return self.plan.epoch(epoch, self.first_shard + me)
        shards = self.plan.every_shard(epoch)[self.first_shard : self.first_shard + self.workers]
        return batches_for(shards, me, self.members)

    def _train_step(self, epoch: int, step: int, indices: np.ndarray, last: bool) -> None:
        ctx, phases = self.ctx, self.report.phases
        mine = self._share(indices)
        x, y = ctx.data.train_batch(mine)
        t0 = time.perf_counter()
        self.lr.before_step(epoch, step)
        stats = self._gradients(x, y, scale=len(mine) / len(indices))
        try:
            check_loss(stats, epoch, step, self._who)
        except NonFiniteLoss as exc:
            self._fail(str(exc))
        self.sync.add(stats)
        self.report.add(stats)
        if self._overflowed():
            sync_now = last  # this batch's gradient is left out, as GradScaler skips its step
        else:
            sync_now = ctx.rule.worker_step(self.rule_state, self.rule_params, self.rule_grads, self.opt) or last
        phases["compute"] += time.perf_counter() - t0
        ctx.peers.pace.heard()
        if sync_now:
            flags = (m.EPOCH_END if last else 0) | (m.STOP_REQUEST if ctx.stop.requested else 0)
            self._exchange(epoch, step, flags)
        if self.report.due:
            self._report(epoch, step)

    def _overflowed(self) -> bool:
        """An fp16 gradient that overflowed (the loss scale backs off at the next backward),
        where no worker optimiser skips it: a rule that adds up raw gradients (GEM) would
        add inf to them and send it to the master."""
        backend = self.ctx.backend
        if backend.loss_scale is None or self.opt is not None or all_finite(self.rule_grads):
            return False
        self.overflows += 1
        return True

    def _share(self, indices: np.ndarray) -> np.ndarray:
        """The samples of a batch this process computes the gradient of."""
        return split_evenly(indices, self.procs, self.ctx.role.proc_index) if self.procs > 1 else indices

    def _gradients(self, x, y, scale: float) -> BatchStats:
        """The worker's gradient of this batch (this process's share of it, `scale`),
        reduced over its processes; the batch's sums over all of them."""
        stats = self.ctx.backend.compute_gradients(x, y, scale=scale)
        if self.procs > 1:
            self._reduce_gradient()
            stats = self._batch_totals(stats)
        return stats

    def _batch_totals(self, stats: BatchStats) -> BatchStats:
        self.totals[:] = (stats.loss_sum, stats.metric_sum, stats.n)
        self.ctx.peers.collectives.allreduce(self.wcomm, self.totals, "the worker's gradient allreduce")
        return BatchStats(self.totals[0], self.totals[1], int(self.totals[2]))

    def _reduce_gradient(self) -> None:
        """Sum the gradient over the worker's processes, through the codec if any."""
        what = "the worker's gradient allreduce"
        collectives = self.ctx.peers.collectives
        grads = self.grads
        if grads is None:
            raise RuntimeError("a worker of one process has no gradient to reduce")
        if self.reduction is None:
            collectives.allreduce(self.wcomm, grads, what)
            self.report.bytes_sent += 4 * self.ctx.backend.num_params
            return
        before = self.reduction.bytes_sent
        host = grads.to_host()

        def wait(requests: list) -> None:
            collectives.wait_all(self.wcomm, requests, what)

        wait(self.reduction.start(0, host))
        self.reduction.finish(lambda: host, wait)
        grads.to_device()
        self.report.bytes_sent += self.reduction.bytes_sent - before

    # -- talking to the master ----------------------------------------------------------
    def _exchange(self, epoch: int, step: int, flags: int) -> None:
        """Send this window's update, wait for the reply, act on it."""
        ctx = self.ctx
        ctx.rule.worker_message(self.rule_state, self.rule_params, self.message.device)
        self.message.to_host()
        self._collect_message()
        if self.compressor is not None:
            # Kept for a checkpoint of the state before this message (SNAPSHOT, STOP).
            self.carried_before = {k: v.copy() for k, v in self.compressor.state_arrays().items()}
            self.compressor.compress(self.out.payload, self.out.wire)
        while True:
            kind = self._round_trip(epoch, flags)
            if kind != m.SNAPSHOT:
                break
            # Not applied: save the state from before this update, then send it again.
            label = m.label_of(float(self.reply_header[m.CHECKPOINT]))
            self._save(label, epoch, step, before_message=True)
            self._acknowledge(label, m.label_code(label))
        self.sync = BatchStats()
        if kind == m.STOP:
            # The master discarded this window: resume redoes it.
            stop_code = float(self.reply_header[m.CHECKPOINT])
            self._save(m.label_of(stop_code), epoch, step, before_message=True)
            self._acknowledge(m.label_of(stop_code), stop_code)
            if self.leader:
                self._send(m.DONE, epoch, 0)
            self._report(epoch, step)
            raise _Leave()
        if kind == m.DROPPED:
            ctx.log.emit("run", {"status": "dropped", "reason": "the master went on without this worker"})
            raise _Leave()
        self.reply.to_device()
        # A synchronous master replies its round's one array (Algorithm.master_round).
        apply = ctx.rule.worker_round_reply if ctx.options.synchronous else ctx.rule.worker_reply
        apply(self.rule_state, self.rule_params, self.reply.device)
        if self.reply_header[m.WINDOW] > 0:  # dynamic local steps: the master names the next window
            ctx.rule.worker_window(self.rule_state, int(self.reply_header[m.WINDOW]))
        self.version = int(self.reply_header[m.VERSION])
        if flags & m.EPOCH_END:
            self.members = m.members_in(self.reply_header)

    def _round_trip(self, epoch: int, flags: int) -> float:
        """Leader: send, await the reply; every process of the worker gets the reply."""
        if self.leader:
            self.channel.expect_reply()
            self._send(m.UPDATE, epoch, flags)
            self.pending_ack = m.NO_CHECKPOINT
            t0 = time.perf_counter()
            self.channel.await_reply()
            self.report.phases["wait"] += time.perf_counter() - t0
        self._share_reply()
        return float(self.reply_header[m.KIND])

    # How the worker's processes make one message and share one reply (roles/pipeline.py
    # gathers and scatters its stages' parts instead).
    def _collect_message(self) -> None:
        """Every process: the worker's message is ready in the leader's `out`."""

    def _share_reply(self) -> None:
        """Every process: the reply's header and its payload (its part of it) from the leader."""
        if self.procs > 1:
            what = "the master's reply to the worker's processes"
            self.ctx.peers.collectives.bcast(self.wcomm, self.reply_header, what)
            self.ctx.peers.collectives.bcast(self.wcomm, self.reply_payload, what)

    def _send(self, kind: float, epoch: int, flags: int) -> None:
        """Leader only: one message to the master (header | payload | state)."""
        if self.writer is not None and kind == m.DONE:
            self._written(self.writer.finish())  # its last message: every share must be on disk
        elif self.writer is not None and kind == m.UPDATE:
            self._written(self.writer.written())
        out, sync = self.out, self.sync
        out.header[m.KIND] = kind
        out.header[m.VERSION] = self.version
        out.header[m.EPOCH] = epoch
        out.header[m.SAMPLES] = sync.n
        out.header[m.LOSS_SUM] = sync.loss_sum
        out.header[m.METRIC_SUM] = sync.metric_sum
        out.header[m.FLAGS] = flags
        out.header[m.CHECKPOINT] = self.pending_ack
        out.header[m.EPOCHS_ACKED] = self.epochs_acked
        self._message_state()
        t0 = time.perf_counter()
        self.channel.send(out)  # DONE, ERROR and LOST carry only the header
        self.report.bytes_sent += sum(part.nbytes for part, _ in out.parts())
        self.report.phases["send"] += time.perf_counter() - t0

    def _message_state(self) -> None:
        """The model state (BatchNorm statistics) into the outgoing message."""
        self.out.state[:] = to_numpy(self.model_state.device)

    def _who(self) -> str:
        return self.ctx.peers.directory.describe(self.ctx.comms.world.Get_rank())

    # -- leaving early ------------------------------------------------------------------
    def _fail(self, text: str) -> None:
        """This worker cannot go on, and neither can the run: tell the master, end here."""
        ctx = self.ctx
        if self.leader:
            self._send_text(m.ERROR, text)
        ctx.log.emit("run", {"status": "failed", "error": text})
        raise _Leave()

    def _leave_lost(self, failure: RunFailure) -> bool:
        """A process of this worker was lost in an asynchronous run: the worker leaves and
        the run goes on without it (the master drops it). False when the run cannot go on."""
        ctx = self.ctx
        if (
            ctx.options.synchronous
            or self.procs == 1
            or not failure.origin
            or not failure.ranks
            or self.master_rank in failure.ranks
        ):
            return False
        if self.leader:
            try:
                self._send_text(m.LOST, f"lost a process: {failure}")
            except RunFailure:
                return False
        ctx.log.emit("run", {"status": "lost", "error": str(failure)})
        return True

    def _send_text(self, kind: float, text: str) -> None:
        self._send(kind, 0, 0)
        try:
            self.channel.send_text(text)
        except RunFailure:
            pass  # the master is gone: the others hear of this rank's failure anyway

    # -- bookkeeping --------------------------------------------------------------------
    def _report(self, epoch: int, step: int) -> None:
        scale = self.ctx.backend.loss_scale
        fp16 = {} if scale is None else {"loss_scale": scale.scale, "fp16_skipped": self.overflows}
        self.report.emit(epoch, step, version=self.version, **fp16)


def run_worker(ctx: RankContext) -> None:
    Worker(ctx).run()
