"""Master/worker (parameter server) topology: who sends what to whom, and when.

Master (rank 0 of the `block` communicator) holds the centre. It keeps ONE receive posted
per worker and serves whatever has arrived (`Testsome`), so every worker is served in
turn and none starves, unlike `recv(ANY_SOURCE)`. Asynchronous: each update is applied
as it comes and answered at once. Synchronous: the master waits for one update from
every worker still training and applies them together; a worker that has finished says
DONE and leaves the round, so a worker that ends early never blocks the others.

Every update carries the version of the centre it was computed from; the master records
staleness = current version - that version, per update and per worker rank.

A worker spanning several processes (N_P > 1) allreduces its gradient over its own
communicator; its leader alone talks to the master and broadcasts the reply.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
from mpi4py import MPI

from nbdist.algorithms.base import Update
from nbdist.backends.base import BatchStats
from nbdist.data.sharding import ShardPlan, split_evenly
from nbdist.errors import TrainingError
from nbdist.topology import messages as m
from nbdist.topology.waiting import wait, wait_all, wait_some
from nbdist.train.context import RankContext
from nbdist.train.progress import EpochTally, RunResult, epoch_metrics, format_epoch, write_final
from nbdist.train.state import load_rank_state, save_rank_state
from nbdist.train.validation import BackgroundValidator

__all__ = ["run_master", "run_worker"]

REPORT_EVERY = 0.5  # seconds between a rank's throughput/phase records


# ----------------------------------------------------------------------------- master
@dataclass
class _Master:
    ctx: RankContext
    version: int = 0
    next_epoch: int = 0  # lowest epoch not yet ended
    stopping: str = ""
    stop_label: str = ""
    error: str = ""
    history: list = field(default_factory=list)
    tallies: dict = field(default_factory=dict)
    acks: dict = field(default_factory=dict)  # checkpoint label -> workers that wrote it
    master_wrote: set = field(default_factory=set)
    failed: set = field(default_factory=set)
    epoch_clock: float = field(default_factory=time.time)  # when the previous epoch ended
    validator: BackgroundValidator | None = None

    def begin_stop(self, reason: str) -> None:
        """From now on every worker's next update is answered with STOP."""
        if not self.stopping:
            self.stopping = reason
            self.stop_label = f"stopped-{self.version:010d}"
    phases: dict = field(default_factory=lambda: {"wait": 0.0, "update": 0.0, "reply": 0.0, "validate": 0.0})


def run_master(ctx: RankContext) -> RunResult:
    block = ctx.comms.block
    workers = block.Get_size() - 1
    backend, algorithm = ctx.backend, ctx.algorithm
    center, model_state = backend.params, backend.state
    n, s = center.size, model_state.size
    rule_state = algorithm.new_master_state(n)
    opt = backend.make_optimizer(ctx.master_optimizer) if ctx.master_optimizer else None
    me = _Master(ctx)
    me.validator = BackgroundValidator(ctx.make_replica, ctx.data.x_val, ctx.data.y_val)

    if ctx.resume_from is not None:
        extra = load_rank_state(ctx, ctx.resume_from, opt, rule_state)
        me.version, me.next_epoch = int(extra["version"]), int(extra["next_epoch"])
        ctx.early.load_json(extra.get("early", {}))
        me.history = list(extra.get("history", []))
        ctx.say(f"resumed from {ctx.resume_from} at epoch {me.next_epoch + 1}, version {me.version}")
    else:
        block.Bcast(center, root=0)
        block.Bcast(model_state, root=0)

    inbox = [m.Message(n, s) for _ in range(workers)]
    worker_states = np.zeros((workers, s), np.float32)
    requests = [block.Irecv(inbox[i].buffer, source=i + 1, tag=m.TAG_UPDATE) for i in range(workers)]
    active = set(range(workers))
    reply_header = m.new_header()
    world_rank_of = _leader_world_ranks(ctx, workers)
    started = me.epoch_clock = time.time()  # after the initial broadcast: all ranks are ready
    last_report = time.monotonic()
    synchronous = ctx.options.synchronous
    if me.next_epoch not in me.tallies:
        me.tallies[me.next_epoch] = EpochTally()

    def reply(i: int, kind: float, payload: np.ndarray) -> None:
        t0 = time.perf_counter()
        reply_header[m.KIND] = kind
        reply_header[m.VERSION] = me.version
        reply_header[m.CHECKPOINT] = m.label_code(me.stop_label) if kind == m.STOP else m.NO_CHECKPOINT
        block.Send(reply_header, dest=i + 1, tag=m.TAG_REPLY_HEADER)
        block.Send(payload, dest=i + 1, tag=m.TAG_REPLY)
        requests[i] = block.Irecv(inbox[i].buffer, source=i + 1, tag=m.TAG_UPDATE)
        me.phases["reply"] += time.perf_counter() - t0

    while active:
        if ctx.stop.requested:
            me.begin_stop(ctx.stop.reason)
        t0 = time.perf_counter()
        if synchronous:
            wait_all([requests[i] for i in sorted(active)])
            ready = sorted(active)
        else:
            ready = wait_some(requests)
        me.phases["wait"] += time.perf_counter() - t0

        round_updates: list[tuple[int, Update]] = []
        for i in ready:
            msg = inbox[i]
            kind = msg.header[m.KIND]
            _note_checkpoint_ack(me, i, msg)
            if kind == m.DONE:
                active.discard(i)
                requests[i] = MPI.REQUEST_NULL
                continue
            if kind == m.ERROR:
                text = block.recv(source=i + 1, tag=m.TAG_ERROR_TEXT)
                me.error = me.error or text
                me.failed.add(i)
                me.begin_stop(f"error on worker {i}")
                active.discard(i)
                requests[i] = MPI.REQUEST_NULL
                continue
            if msg.has(m.STOP_REQUEST):
                me.begin_stop("stop requested")
            if me.stopping:
                # The update is dropped (and not counted): the worker checkpoints the
                # state it had before it and leaves.
                reply(i, m.STOP, center)
                continue
            _tally(me, msg)
            worker_states[i] = msg.state
            update = Update(msg.payload, me.version - int(msg.header[m.VERSION]), int(msg.header[m.SAMPLES]))
            round_updates.append((i, update))

        if round_updates:
            groups = [round_updates] if synchronous else [[u] for u in round_updates]
            for group in groups:
                t0 = time.perf_counter()
                replies = algorithm.master_apply(rule_state, center, [u for _, u in group], opt)
                me.version += 1
                me.phases["update"] += time.perf_counter() - t0
                for (i, update), payload in zip(group, replies):
                    me.tallies.setdefault(int(inbox[i].header[m.EPOCH]), EpochTally()).add_staleness(update.staleness)
                    ctx.log.emit("update", {"worker": i, "source_rank": world_rank_of[i],
                                            "staleness": update.staleness, "version": me.version},
                                 step=me.version, epoch=int(inbox[i].header[m.EPOCH]))
                    reply(i, m.CONTINUE, payload)

        _end_finished_epochs(me, workers, worker_states, rule_state, opt)
        _collect_validation(me, block=False)
        if time.monotonic() - last_report >= REPORT_EVERY:
            ctx.log.emit("phase", dict(me.phases), step=me.version, epoch=me.next_epoch)
            last_report = time.monotonic()
        _commit_ready_checkpoints(me, workers)

    _collect_validation(me, block=True)
    # Every worker has said DONE (or failed). The stop checkpoint commits only when every
    # worker stopped on the same STOP; otherwise the last epoch checkpoint is the state.
    if me.stopping and not me.error:
        _save_master(me, me.stop_label, rule_state, opt, worker_states)
        _commit_ready_checkpoints(me, workers)
    ctx.checkpoints.discard_incomplete()
    ctx.log.emit("phase", dict(me.phases), step=me.version, epoch=me.next_epoch)
    if me.error:
        ctx.log.emit("run", {"status": "failed", "error": me.error})
        ctx.log.close()
        raise TrainingError(me.error)
    reason = me.stopping or f"completed {ctx.options.epochs} epochs"
    ctx.log.emit("run", {"status": "stopped" if me.stopping else "completed", "reason": reason})
    ctx.log.close()
    _average_state(backend, worker_states)
    return write_final(ctx.run_dir, backend.named_arrays(), me.history, reason, time.time() - started)


def _leader_world_ranks(ctx: RankContext, workers: int) -> list[int]:
    ranks = ctx.layout.fold_ranks(ctx.role.group, ctx.role.fold)
    roles = [ctx.layout.role(r) for r in ranks]
    return [r.rank for r in roles if r.kind == "worker" and r.master == ctx.role.master and r.proc == 0][:workers]


def _tally(me: _Master, msg: m.Message) -> None:
    epoch = int(msg.header[m.EPOCH])
    tally = me.tallies.setdefault(epoch, EpochTally())
    tally.train.add(BatchStats(msg.header[m.LOSS_SUM], msg.header[m.METRIC_SUM], int(msg.header[m.SAMPLES])))
    if msg.has(m.EPOCH_END):
        tally.ended += 1


def _note_checkpoint_ack(me: _Master, i: int, msg: m.Message) -> None:
    code = msg.header[m.CHECKPOINT]
    if code != m.NO_CHECKPOINT:
        me.acks.setdefault(m.label_of(code), set()).add(i)


def _end_finished_epochs(me: _Master, workers: int, worker_states, rule_state, opt) -> None:
    ctx = me.ctx
    expected = workers - len(me.failed)
    while me.next_epoch in me.tallies and me.tallies[me.next_epoch].ended >= expected > 0:
        epoch = me.next_epoch
        tally = me.tallies.pop(epoch)
        me.next_epoch += 1
        me.tallies.setdefault(me.next_epoch, EpochTally())
        now = time.time()
        seconds, me.epoch_clock = now - me.epoch_clock, now
        label = f"epoch-{epoch + 1:04d}" if ctx.checkpoint_due(epoch + 1) else None
        if not ((epoch + 1) % ctx.options.validate_every == 0 or epoch + 1 == ctx.options.epochs):
            _finish_epoch(me, epoch, tally, seconds, None)
        elif ctx.options.synchronous:
            # Inline, after this round's replies went out: the workers compute meanwhile, and
            # the stop decision falls at the same step in every run (exact resume).
            t0 = time.perf_counter()
            _average_state(ctx.backend, worker_states)
            val = ctx.backend.evaluate(ctx.data.x_val, ctx.data.y_val)
            me.phases["validate"] += time.perf_counter() - t0
            _finish_epoch(me, epoch, tally, seconds, val)
        else:
            _collect_validation(me, block=True)  # one at a time, in epoch order
            _average_state(ctx.backend, worker_states)
            me.validator.start(ctx.backend.params, ctx.backend.state, (epoch, tally, seconds))
        if label:
            _save_master(me, label, rule_state, opt, worker_states)


def _collect_validation(me: _Master, block: bool) -> None:
    t0 = time.perf_counter()
    done = me.validator.poll(block)
    if block:
        me.phases["validate"] += time.perf_counter() - t0
    if done is not None:
        (epoch, tally, seconds), val = done
        _finish_epoch(me, epoch, tally, seconds, val)


def _finish_epoch(me: _Master, epoch: int, tally: EpochTally, seconds: float, val) -> None:
    ctx = me.ctx
    try:
        metrics = epoch_metrics(epoch, tally, val, seconds, ctx.backend.metric_name)
    except TrainingError as exc:
        me.error = me.error or str(exc)
        me.begin_stop("error")
        return
    me.history.append(metrics)
    ctx.log.emit("epoch", metrics, step=me.version, epoch=epoch + 1)
    ctx.say(format_epoch(metrics, ctx.options.epochs))
    if not me.stopping:
        decision = ctx.early.update(metrics)
        if decision.stop:
            me.begin_stop(decision.reason)


def _average_state(backend, worker_states: np.ndarray) -> None:
    """The centre's BatchNorm statistics: the mean of the workers' latest ones."""
    if backend.state.size:
        np.mean(worker_states, axis=0, out=backend.state)


def _save_master(me: _Master, label: str, rule_state, opt, worker_states) -> None:
    ctx = me.ctx
    _average_state(ctx.backend, worker_states)
    extra = {"version": me.version, "next_epoch": me.next_epoch, "early": ctx.early.to_json(),
             "history": me.history}
    save_rank_state(ctx, label, opt, rule_state, extra)
    me.master_wrote.add(label)


def _commit_ready_checkpoints(me: _Master, workers: int) -> None:
    needed = set(range(workers)) - me.failed
    for label in sorted(me.master_wrote):
        if needed <= me.acks.get(label, set()):
            me.ctx.checkpoints.commit(label, {"label": label, "layout": me.ctx.layout.to_dict(),
                                               "options": me.ctx.options.to_dict(),
                                               "version": me.version, "time": time.time()})
            me.master_wrote.discard(label)
            me.acks.pop(label, None)


# ----------------------------------------------------------------------------- worker
@dataclass
class _Window:
    """What a worker did since it last reported (metrics) or synced (header sums)."""

    sync: BatchStats = field(default_factory=BatchStats)
    report: BatchStats = field(default_factory=BatchStats)
    compute: float = 0.0
    send: float = 0.0
    wait: float = 0.0
    since: float = field(default_factory=time.monotonic)


def run_worker(ctx: RankContext) -> None:
    role, backend, algorithm = ctx.role, ctx.backend, ctx.algorithm
    block, wcomm = ctx.comms.block, ctx.comms.worker
    leader, procs = role.is_leader, wcomm.Get_size()
    params, grads, model_state = backend.params, backend.grads, backend.state
    n, s = params.size, model_state.size
    opt = backend.make_optimizer(ctx.worker_optimizer) if ctx.worker_optimizer else None
    rule_state = algorithm.new_worker_state(n, ctx.sync_every)
    workers = ctx.layout.workers
    plan = ShardPlan(ctx.data.n_train, workers, ctx.options.batch_size, ctx.options.seed)

    version, start_epoch, start_step = 0, 0, 0
    if ctx.resume_from is not None:
        extra = load_rank_state(ctx, ctx.resume_from, opt, rule_state)
        version, start_epoch, start_step = int(extra["version"]), int(extra["epoch"]), int(extra["step"])
    else:
        if leader:
            block.Bcast(params, root=0)
            block.Bcast(model_state, root=0)
        if procs > 1:
            wcomm.Bcast(params, root=0)
            wcomm.Bcast(model_state, root=0)
        algorithm.worker_start(rule_state, params)

    out = m.Message(n, s)
    reply_header = m.new_header()
    reply_payload = np.empty(n, np.float32)
    window = _Window()
    pending_ack = m.NO_CHECKPOINT
    totals = np.zeros(3, np.float64)

    def send_to_master(kind: float, epoch: int, flags: int) -> None:
        """Leader only: one message to the master (header | payload | state)."""
        out.header[m.KIND] = kind
        out.header[m.VERSION] = version
        out.header[m.EPOCH] = epoch
        out.header[m.SAMPLES] = window.sync.n
        out.header[m.LOSS_SUM] = window.sync.loss_sum
        out.header[m.METRIC_SUM] = window.sync.metric_sum
        out.header[m.FLAGS] = flags
        out.header[m.CHECKPOINT] = pending_ack
        out.state[:] = model_state
        t0 = time.perf_counter()
        # DONE and ERROR carry only the header.
        block.Send(out.buffer if kind == m.UPDATE else out.buffer[: m.HEADER_FLOATS], dest=0, tag=m.TAG_UPDATE)
        window.send += time.perf_counter() - t0

    def exchange(epoch: int, flags: int) -> float:
        """Send this window's update, wait for the reply, apply it. Returns the reply kind."""
        nonlocal version, pending_ack
        algorithm.worker_message(rule_state, params, out.payload)
        if leader:
            header_req = block.Irecv(reply_header, source=0, tag=m.TAG_REPLY_HEADER)
            payload_req = block.Irecv(reply_payload, source=0, tag=m.TAG_REPLY)
            send_to_master(m.UPDATE, epoch, flags)
            pending_ack = m.NO_CHECKPOINT
            t0 = time.perf_counter()
            wait(header_req)
            wait(payload_req)
            window.wait += time.perf_counter() - t0
        if procs > 1:
            wcomm.Bcast(reply_header, root=0)
            wcomm.Bcast(reply_payload, root=0)
        window.sync = BatchStats()
        if reply_header[m.KIND] == m.STOP:
            return m.STOP
        algorithm.worker_reply(rule_state, params, reply_payload)
        version = int(reply_header[m.VERSION])
        return m.CONTINUE

    def report(epoch: int, step: int) -> None:
        elapsed = time.monotonic() - window.since
        stats = window.report
        ctx.log.emit("train", {"samples": stats.n, "samples_per_s": stats.n / elapsed if elapsed else 0.0,
                               "loss": stats.loss, backend.metric_name or "metric": stats.metric,
                               "compute_s": window.compute, "send_s": window.send, "wait_s": window.wait,
                               "version": version}, step=step, epoch=epoch)
        window.report, window.compute, window.send, window.wait = BatchStats(), 0.0, 0.0, 0.0
        window.since = time.monotonic()

    def save(label: str, epoch: int, step: int) -> None:
        save_rank_state(ctx, label, opt, rule_state, {"version": version, "epoch": epoch, "step": step})
        if procs > 1:
            wcomm.Barrier()  # the leader acknowledges for all the worker's processes

    def fail(text: str) -> None:
        if leader:
            send_to_master(m.ERROR, 0, 0)
            block.send(text, dest=0, tag=m.TAG_ERROR_TEXT)
        ctx.log.emit("run", {"status": "failed", "error": text})
        ctx.log.close()

    for epoch in range(start_epoch, ctx.options.epochs):
        batches = plan.epoch(epoch, role.worker)
        first = start_step if epoch == start_epoch else 0
        last = len(batches) - 1
        for step in range(first, len(batches)):
            indices = batches[step]
            mine = split_evenly(indices, procs, role.proc) if procs > 1 else indices
            x, y = ctx.data.train_batch(mine)
            t0 = time.perf_counter()
            stats = backend.compute_gradients(x, y, scale=len(mine) / len(indices))
            if procs > 1:
                wcomm.Allreduce(MPI.IN_PLACE, grads, op=MPI.SUM)
                totals[:] = (stats.loss_sum, stats.metric_sum, stats.n)
                wcomm.Allreduce(MPI.IN_PLACE, totals, op=MPI.SUM)
                stats = BatchStats(totals[0], totals[1], int(totals[2]))
            if not np.isfinite(stats.loss_sum):
                fail(f"the loss became {stats.loss_sum / max(stats.n, 1)} on worker {role.worker} (rank "
                     f"{role.rank}) at epoch {epoch + 1}, batch {step + 1}: lower the learning rate or "
                     f"check the data")
                return
            window.sync.add(stats)
            window.report.add(stats)
            sync_now = algorithm.worker_step(rule_state, params, grads, opt) or step == last
            window.compute += time.perf_counter() - t0
            if sync_now:
                flags = (m.EPOCH_END if step == last else 0) | (m.STOP_REQUEST if ctx.stop.requested else 0)
                if exchange(epoch, flags) == m.STOP:
                    # The master discarded this window: resume redoes it.
                    stop_code = float(reply_header[m.CHECKPOINT])
                    save(m.label_of(stop_code), epoch, step)
                    pending_ack = stop_code
                    if leader:
                        send_to_master(m.DONE, epoch, 0)
                    report(epoch, step)
                    ctx.log.close()
                    return
            if time.monotonic() - window.since >= REPORT_EVERY:
                report(epoch, step)
        if ctx.checkpoint_due(epoch + 1):
            label = f"epoch-{epoch + 1:04d}"
            save(label, epoch + 1, 0)
            pending_ack = m.label_code(label)
    report(ctx.options.epochs, 0)
    if leader:
        send_to_master(m.DONE, ctx.options.epochs, 0)
    ctx.log.close()

