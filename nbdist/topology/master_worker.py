"""Master/worker (parameter server) topology: who sends what to whom, and when.

Master (rank 0 of the `block` communicator) holds the centre. It keeps ONE receive posted
per client and serves whatever has arrived (`Testsome`), so every client is served in
turn and none starves, unlike `recv(ANY_SOURCE)`. Asynchronous: each update is applied
as it comes and answered once the updates that arrived with it are applied too.
Synchronous: the master waits for one update from every client still training and
applies them together; a client that has finished says DONE and leaves the round, so a
worker that ends early never blocks the others.

A master's clients are its workers and, at the top master of a run with `--masters` > 1,
the sub-masters (topology/hierarchy.py), which run this same serving loop for their own
workers and differ from the top master only at the `_Master` methods they override.

Every update carries the version of the centre it was computed from; the master records
staleness = current version - that version, per update and per client rank.

A worker spanning several processes (N_P > 1) allreduces its gradient over its own
communicator; its leader alone talks to the master and broadcasts the reply.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from mpi4py import MPI

from nbdist.algorithms.base import Update
from nbdist.backends.base import BatchStats
from nbdist.data.sharding import split_evenly
from nbdist.errors import TrainingError
from nbdist.topology import messages as m
from nbdist.topology.waiting import wait, wait_all, wait_some
from nbdist.train.context import RankContext
from nbdist.train.progress import EpochTally, RunResult, epoch_metrics, format_epoch, write_final
from nbdist.train.state import load_rank_state, save_rank_state
from nbdist.train.validation import BackgroundValidator

__all__ = ["run_master", "run_worker", "Client", "WORKER", "SUB_MASTER"]

REPORT_EVERY = 0.5  # seconds between a rank's throughput/phase records

WORKER, SUB_MASTER = "worker", "sub-master"


# ----------------------------------------------------------------------------- master
@dataclass(slots=True)
class Client:
    """One peer a master serves, with the buffer its posted receive fills: a worker's
    leader (peer w + 1 on `block`) or, at the top master, a sub-master (peer j on
    `masters`). Workers' updates go through the algorithm's `master_apply`; a client with
    a `merge` function has its payload merged into the centre by that instead."""

    comm: Any
    peer: int
    kind: str  # WORKER or SUB_MASTER
    world_rank: int
    inbox: m.Message
    merge: Callable[[np.ndarray, np.ndarray], None] | None = None
    weight: int = 1  # workers whose model state (BatchNorm statistics) its messages carry

    def post(self) -> MPI.Request:
        return self.comm.Irecv(self.inbox.buffer, source=self.peer, tag=m.TAG_UPDATE)

    def describe(self) -> str:
        index = self.peer - 1 if self.kind == WORKER else self.peer
        return f"{self.kind} {index} (rank {self.world_rank})"


@dataclass
class _Master:
    """A master's serving state. Its methods are where a sub-master (hierarchy.SubMaster)
    behaves differently from the top (or only) master."""

    ctx: RankContext
    clients: list = field(default_factory=list)  # [Client]
    center: np.ndarray | None = None  # the backend's flat parameters
    rule_state: Any = None
    opt: Any = None
    requests: list = field(default_factory=list)  # one posted receive per client
    active: set = field(default_factory=set)  # clients that have not said DONE
    states: np.ndarray | None = None  # each client's latest model state
    acked_upto: list = field(default_factory=list)  # per client, see m.EPOCHS_ACKED
    reply_header: np.ndarray = field(default_factory=m.new_header)
    version: int = 0
    next_epoch: int = 0  # lowest epoch not yet ended
    stopping: str = ""
    stop_label: str = ""
    error: str = ""
    history: list = field(default_factory=list)
    tallies: dict = field(default_factory=dict)
    acks: dict = field(default_factory=dict)  # checkpoint label -> clients that wrote it
    master_wrote: set = field(default_factory=set)
    failed: set = field(default_factory=set)
    epoch_clock: float = field(default_factory=time.time)  # when the previous epoch ended
    validator: BackgroundValidator | None = None
    phases: dict = field(default_factory=lambda: {"wait": 0.0, "update": 0.0, "reply": 0.0, "validate": 0.0})

    def begin_stop(self, reason: str) -> None:
        """From now on every client's next update is answered with STOP."""
        if not self.stopping:
            self.stopping = reason
            self.stop_label = f"stopped-{self.version:010d}"

    def request_stop(self, reason: str) -> None:
        """A stop signal, a client's request or a client's failure."""
        self.begin_stop(reason)

    def pop_finished_epochs(self) -> list[tuple[int, EpochTally, float]]:
        """The epochs every client still training has now ended: (epoch, tally, seconds)."""
        expected = len(self.clients) - len(self.failed)
        finished = []
        while self.next_epoch in self.tallies and self.tallies[self.next_epoch].ended >= expected > 0:
            epoch = self.next_epoch
            tally = self.tallies.pop(epoch)
            self.next_epoch += 1
            self.tallies.setdefault(self.next_epoch, EpochTally())
            now = time.time()
            seconds, self.epoch_clock = now - self.epoch_clock, now
            finished.append((epoch, tally, seconds))
        return finished

    def before_replies(self, applied: int, finished: list) -> None:
        """Between applying a round's updates and answering them (a sub-master talks to
        the top master here, so that its workers get the merged centre)."""

    def end_epoch(self, epoch: int, tally: EpochTally, seconds: float) -> None:
        """Every client has ended `epoch`: validate, report, decide, checkpoint."""
        ctx = self.ctx
        label = m.label_of(epoch + 1) if ctx.checkpoint_due(epoch + 1) else None
        if not ((epoch + 1) % ctx.options.validate_every == 0 or epoch + 1 == ctx.options.epochs):
            _finish_epoch(self, epoch, tally, seconds, None)
        elif ctx.options.synchronous:
            # Inline, after this round's replies went out: the workers compute meanwhile, and
            # the stop decision falls at the same step in every run (exact resume).
            t0 = time.perf_counter()
            _average_state(self)
            val = ctx.backend.evaluate(*ctx.data.val_arrays())
            self.phases["validate"] += time.perf_counter() - t0
            _finish_epoch(self, epoch, tally, seconds, val)
        else:
            _collect_validation(self, block=True)  # one at a time, in epoch order
            _average_state(self)
            self.validator.start(ctx.backend.params, ctx.backend.state, (epoch, tally, seconds))
        if label:
            self.save(label)

    def save(self, label: str) -> None:
        """Write this rank's share of checkpoint `label`."""
        ctx = self.ctx
        _average_state(self)
        extra = {"version": self.version, "next_epoch": self.next_epoch, "early": ctx.early.to_json(),
                 **ctx.history_file.checkpoint(self.history), **_open_tallies(self, label)}
        save_rank_state(ctx, label, self.opt, self.rule_state, extra)
        self.master_wrote.add(label)

    def commit(self, label: str) -> None:
        """Every client and this rank wrote `label`: make it the run's latest checkpoint."""
        ctx = self.ctx
        ctx.checkpoints.commit(label, {"label": label, "layout": ctx.layout.to_dict(),
                                       "options": ctx.options.to_dict(), "version": self.version,
                                       "time": time.time()})


def run_master(ctx: RankContext) -> RunResult:
    """The top (or only) master: serves its workers and, with --masters > 1, the sub-masters."""
    me = _Master(ctx)
    clients = _worker_clients(ctx)
    if ctx.layout.masters > 1:
        from nbdist.topology.hierarchy import sub_master_clients  # hierarchy builds on this module

        clients += sub_master_clients(ctx)
    _open(me, clients)
    if ctx.resume_from is not None:
        extra = load_rank_state(ctx, ctx.resume_from, me.opt, me.rule_state)
        me.version, me.next_epoch = int(extra["version"]), int(extra["next_epoch"])
        ctx.early.load_json(extra.get("early", {}))
        me.history = ctx.history_file.resume(extra)
        _restore_tallies(me, extra)
        ctx.say(f"resumed from {ctx.resume_from} at epoch {me.next_epoch + 1}, version {me.version}")
    else:
        _share_initial_weights(ctx)
    started = _serve(me)

    _collect_validation(me, block=True)
    # Every client has said DONE (or failed). The stop checkpoint commits only when every
    # client stopped on the same STOP; otherwise the last epoch checkpoint is the state.
    if me.stopping and not me.error:
        me.save(me.stop_label)
        _commit_ready_checkpoints(me)
    ctx.checkpoints.discard_incomplete()
    ctx.log.emit("phase", dict(me.phases), step=me.version, epoch=me.next_epoch)
    if me.error:
        ctx.log.emit("run", {"status": "failed", "error": me.error})
        ctx.log.close()
        raise TrainingError(me.error)
    reason = me.stopping or f"completed {ctx.options.epochs} epochs"
    ctx.log.emit("run", {"status": "stopped" if me.stopping else "completed", "reason": reason})
    ctx.log.close()
    _average_state(me)
    return write_final(ctx.run_dir, ctx.backend.named_arrays(), me.history, reason, time.time() - started)


def _worker_clients(ctx: RankContext) -> list[Client]:
    block = ctx.comms.block
    n, s = ctx.backend.params.size, ctx.backend.state.size
    ranks = _leader_world_ranks(ctx, block.Get_size() - 1)
    return [Client(block, i + 1, WORKER, rank, m.Message(n, s)) for i, rank in enumerate(ranks)]


def _leader_world_ranks(ctx: RankContext, workers: int) -> list[int]:
    ranks = ctx.layout.fold_ranks(ctx.role.group, ctx.role.fold)
    roles = [ctx.layout.role(r) for r in ranks]
    return [r.rank for r in roles if r.kind == "worker" and r.master == ctx.role.master and r.proc == 0][:workers]


def _open(me: _Master, clients: list[Client]) -> None:
    """What every master holds besides its clients: the centre, its rule and optimiser."""
    ctx = me.ctx
    me.center = ctx.backend.params
    me.rule_state = ctx.algorithm.new_master_state(me.center.size)
    me.opt = ctx.backend.make_optimizer(ctx.master_optimizer) if ctx.master_optimizer else None
    me.validator = BackgroundValidator(ctx.make_replica, *ctx.data.val_arrays())
    me.clients = clients
    me.states = np.zeros((len(clients), ctx.backend.state.size), np.float32)


def _share_initial_weights(ctx: RankContext) -> None:
    """Fresh run: every master starts from the top master's centre, every worker from its master's."""
    params, state = ctx.backend.params, ctx.backend.state
    if ctx.layout.masters > 1:
        ctx.comms.masters.Bcast(params, root=0)
        ctx.comms.masters.Bcast(state, root=0)
    ctx.comms.block.Bcast(params, root=0)
    ctx.comms.block.Bcast(state, root=0)


def _serve(me: _Master) -> float:
    """Serve the clients until every one has said DONE (or failed); returns the start time."""
    ctx = me.ctx
    me.requests = [c.post() for c in me.clients]
    me.active = set(range(len(me.clients)))
    me.acked_upto = [me.next_epoch] * len(me.clients)  # a resume starts from a committed epoch
    me.tallies.setdefault(me.next_epoch, EpochTally())
    started = me.epoch_clock = time.time()  # after the initial broadcast: all ranks are ready
    last_report = time.monotonic()
    while me.active:
        ready = _wait_for_clients(me)
        if ctx.stop.requested:  # after the wait: a signal usually arrives during one
            me.request_stop(ctx.stop.reason)
        updates = _read_messages(me, ready)
        replies = _apply_updates(me, updates)
        finished = me.pop_finished_epochs()
        me.before_replies(len(updates), finished)
        for i, payload in replies:
            _reply(me, i, m.CONTINUE, payload)
        for epoch, tally, seconds in finished:
            me.end_epoch(epoch, tally, seconds)
        _collect_validation(me, block=False)
        if time.monotonic() - last_report >= REPORT_EVERY:
            ctx.log.emit("phase", dict(me.phases), step=me.version, epoch=me.next_epoch)
            last_report = time.monotonic()
        _commit_ready_checkpoints(me)
    return started


def _wait_for_clients(me: _Master) -> list[int]:
    t0 = time.perf_counter()
    if me.ctx.options.synchronous:
        ready = sorted(me.active)
        wait_all([me.requests[i] for i in ready])
    else:
        ready = wait_some(me.requests)
    me.phases["wait"] += time.perf_counter() - t0
    return ready


def _read_messages(me: _Master, ready: list[int]) -> list[tuple[int, Update]]:
    """Handle what the `ready` clients sent; returns the updates to apply."""
    updates: list[tuple[int, Update]] = []
    for i in ready:
        client = me.clients[i]
        msg = client.inbox
        kind = msg.header[m.KIND]
        _note_checkpoint_ack(me, i, msg)
        if kind == m.DONE:
            _retire(me, i)
            continue
        if kind == m.ERROR:
            _client_failed(me, i, client.comm.recv(source=client.peer, tag=m.TAG_ERROR_TEXT))
            continue
        if msg.has(m.STOP_REQUEST):
            me.request_stop("stop requested")
        if me.stopping:
            # The update is dropped (and not counted): the client checkpoints the
            # state it had before it and leaves.
            _reply(me, i, m.STOP, me.center)
            continue
        _tally(me, msg)
        me.states[i] = msg.state
        staleness = me.version - int(msg.header[m.VERSION])
        updates.append((i, Update(msg.payload, staleness, int(msg.header[m.SAMPLES]))))
    return updates


def _retire(me: _Master, i: int) -> None:
    me.active.discard(i)
    me.requests[i] = MPI.REQUEST_NULL


def _client_failed(me: _Master, i: int, text: str) -> None:
    client = me.clients[i]
    me.error = me.error or text
    me.failed.add(i)
    me.request_stop(f"error on {client.describe()}")
    if client.kind == SUB_MASTER:
        # It still has workers to stop: it passes this STOP on to them, then says DONE,
        # so no rank is still writing into the run directory when the top master leaves.
        _reply(me, i, m.STOP, me.center)
    else:
        _retire(me, i)


def _apply_updates(me: _Master, updates: list[tuple[int, Update]]) -> list[tuple[int, np.ndarray]]:
    """Fold the updates into the centre, a synchronous round as one version and each
    asynchronous update as its own; returns (client, array to reply) pairs."""
    ctx = me.ctx
    groups = [updates] if ctx.options.synchronous else [[u] for u in updates]
    replies: list[tuple[int, np.ndarray]] = []
    for group in groups:
        if not group:
            continue
        t0 = time.perf_counter()
        from_workers = [(i, u) for i, u in group if me.clients[i].merge is None]
        if from_workers:
            payloads = ctx.algorithm.master_apply(me.rule_state, me.center, [u for _, u in from_workers], me.opt)
            replies += [(i, payload) for (i, _), payload in zip(from_workers, payloads)]
        for i, u in group:
            merge = me.clients[i].merge
            if merge is not None:
                merge(me.center, u.payload)
                replies.append((i, me.center))
        me.version += 1
        me.phases["update"] += time.perf_counter() - t0
        for i, u in group:
            client = me.clients[i]
            epoch = int(client.inbox.header[m.EPOCH])
            me.tallies.setdefault(epoch, EpochTally()).add_staleness(u.staleness)
            who = {"worker": client.peer - 1} if client.kind == WORKER else {"sub_master": client.peer}
            ctx.log.emit("update", {**who, "source_rank": client.world_rank, "staleness": u.staleness,
                                    "version": me.version}, step=me.version, epoch=epoch)
    return replies


def _reply(me: _Master, i: int, kind: float, payload: np.ndarray) -> None:
    """Answer client i (header, then the payload array itself) and re-post its receive."""
    t0 = time.perf_counter()
    client, header = me.clients[i], me.reply_header
    header[m.KIND] = kind
    header[m.VERSION] = me.version
    header[m.CHECKPOINT] = m.label_code(me.stop_label) if kind == m.STOP else m.NO_CHECKPOINT
    # Sent without blocking inside MPI: a client that vanished mid-exchange (it failed, or
    # the job abandoned it) must not hold the master in a Send that never completes.
    wait_all([client.comm.Isend(header, dest=client.peer, tag=m.TAG_REPLY_HEADER),
              client.comm.Isend(payload, dest=client.peer, tag=m.TAG_REPLY)])
    me.requests[i] = client.post()
    me.phases["reply"] += time.perf_counter() - t0


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
    # Cumulative acks (sub-masters): every due epoch checkpoint up to `upto`.
    upto = int(msg.header[m.EPOCHS_ACKED])
    for epoch in range(me.acked_upto[i] + 1, upto + 1):
        if me.ctx.checkpoint_due(epoch):
            me.acks.setdefault(m.label_of(epoch), set()).add(i)
    me.acked_upto[i] = max(me.acked_upto[i], upto)


def _open_tallies(me: _Master, label: str) -> dict:
    """The tallies of the epochs not yet ended, for a stop checkpoint only.

    A stop checkpoint is a consistent cut (each client saved the state the master had
    accepted), and a worker that ended an epoch before the stop will not end it again
    after a resume: without its tally that epoch would never end. At an asynchronous
    epoch checkpoint, on the contrary, the workers restart the next epoch from its first
    batch, so the updates already tallied for it are counted again anyway.
    """
    if label != me.stop_label:
        return {}
    return {"tallies": {str(epoch): tally.to_json() for epoch, tally in me.tallies.items()}}


def _restore_tallies(me: _Master, extra: dict) -> None:
    me.tallies = {int(epoch): EpochTally.from_json(v) for epoch, v in extra.get("tallies", {}).items()}


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


def _average_state(me: _Master) -> None:
    """The centre's BatchNorm statistics: the clients' latest ones, weighted by the
    workers behind each (a sub-master's are already its workers' mean)."""
    state = me.ctx.backend.state
    if state.size:
        state[:] = np.average(me.states, axis=0, weights=[c.weight for c in me.clients])


def _commit_ready_checkpoints(me: _Master) -> None:
    needed = set(range(len(me.clients))) - me.failed
    for label in sorted(me.master_wrote):
        if needed <= me.acks.get(label, set()):
            me.commit(label)
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
    # One shard per worker of the whole run, sub-masters' workers included: an epoch is
    # one pass over the data however the workers are grouped.
    workers, masters = ctx.layout.workers, max(ctx.layout.masters, 1)
    plan = ctx.data.plan(masters * workers, ctx.options.batch_size, ctx.options.seed)
    shard = role.master * workers + role.worker
    who = f"worker {role.worker}" + (f" of master {role.master}" if masters > 1 else "")

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
        # DONE and ERROR carry only the header. Polled, not blocking: a master that is gone
        # (the job abandoned it) must not hold this rank in a Send.
        message = out.buffer if kind == m.UPDATE else out.buffer[: m.HEADER_FLOATS]
        wait(block.Isend(message, dest=0, tag=m.TAG_UPDATE))
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
                               "version": version, **backend.train_extras()}, step=step, epoch=epoch)
        window.report, window.compute, window.send, window.wait = BatchStats(), 0.0, 0.0, 0.0
        window.since = time.monotonic()

    def save(label: str, epoch: int, step: int) -> None:
        save_rank_state(ctx, label, opt, rule_state, {"version": version, "epoch": epoch, "step": step},
                        same_as=role.rank - role.proc)
        if procs > 1:
            wcomm.Barrier()  # the leader acknowledges for all the worker's processes

    def fail(text: str) -> None:
        if leader:
            send_to_master(m.ERROR, 0, 0)
            block.send(text, dest=0, tag=m.TAG_ERROR_TEXT)
        ctx.log.emit("run", {"status": "failed", "error": text})
        ctx.log.close()

    for epoch in range(start_epoch, ctx.options.epochs):
        batches = plan.epoch(epoch, shard)
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
                fail(f"the loss became {stats.loss_sum / max(stats.n, 1)} on {who} (rank "
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

