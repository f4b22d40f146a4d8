"""The master of the master/worker (parameter server) topology: serving its clients.

Master (rank 0 of the `block` communicator) holds the centre. It keeps ONE receive posted
per client, for the small header of its next message, and serves whatever has arrived, so
every client is served in turn and none starves, unlike `recv(ANY_SOURCE)`. An update's
body (its payload and model state) is received only once its header is in, into one of
a few pooled buffers (transport/pool.py): the master's memory does not grow with its
number of clients. Asynchronous, a pass serves at most as many updates as the pool has
buffers (ASYNC_BODIES); the others stay ready and are served first at the next pass.
Synchronous, once every header of the round is in (they carry the sample counts), the
workers' bodies are streamed through the same few buffers into the rule's
`master_round`, which folds them into one round buffer as it draws them (the next body
is received while the rule works on the current one): the memory of a synchronous
master does not grow with its workers either. Only the bodies of a top master's
sub-masters are held for the round (one per sub-master, see _merge_masters).

Asynchronous: each update is applied as it comes and answered once the updates served
with it are applied too. Synchronous: the master waits for one update from every client
still training and applies them together; a client that has finished says DONE and
leaves the round, so a worker that ends early never blocks the others.

A master's clients are its workers and, at the top master of a run with `--masters` > 1,
the sub-masters (hierarchy.py), which run this same serving loop for their own workers
and differ from the top master only at the `Master` methods they override.

Every update carries the version of the centre it was computed from; the master records
staleness = current version - that version, per update and per client rank.

Replies leave without blocking the master: it sends a reply, posts the client's next
receive at once (the client sends nothing before it has taken its reply) and goes on
serving. The centre a reply reads must not move under it: before the next update moves
the centre, the master waits for the centre's replies still in flight, up to a moment
(REPLY_WAIT) - by then a client that runs has usually taken its reply, while the master
was receiving the next update. A reply still in flight after that (its client is frozen,
or descheduled) stays pending while the master serves the others: it reaches a slow
client partly updated, as a Hogwild read would; a frozen client's is discarded with it,
see below.

Failures. A client whose process died (MPI's fault tolerance reports it), or that stayed
silent or did not take its reply for longer than the peer timeout (frozen), is *lost*. Asynchronous, a lost worker is
dropped and the run goes on: from the next epoch its share of the data goes to the
others (membership.py), the loss is recorded, and if it wakes up it is answered DROPPED.
Synchronous (every round needs every worker), or a lost sub-master: the run cannot go
on, and a RunFailure ends it (the survivors restart from the last checkpoint when the
user allowed restarts; roles/runner.py).

Checkpoints. Synchronous runs checkpoint at epoch ends: every worker writes its share at
its epoch boundary, the master when the epoch ends. Asynchronous workers are at different
epochs, so an epoch-aligned checkpoint would hold only what the slowest one did: instead
the master takes a *snapshot* when an epoch is due, of what every live rank has now. It
saves the centre at once, answers each client's next update with SNAPSHOT instead of
applying it; the client saves its state (the update not applied: a resume redoes it, as
after a stop) and sends the update again. The checkpoint commits when every live client
has acknowledged it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import numpy as np
from mpi4py import MPI

from nbdist.algorithms.base import Update
from nbdist.backends.base import BatchStats
from nbdist.errors import TrainingError
from nbdist.metrics.updates import UpdateSummary
from nbdist.roles.membership import EpochMembers
from nbdist.train.context import RankContext
from nbdist.train.lr import lr_metrics, master_lr_for
from nbdist.train.progress import EpochTally, RunResult, epoch_metrics, format_epoch, write_final
from nbdist.train.state import load_rank_state, save_rank_state
from nbdist.train.validation import BackgroundValidator, SampledValidation
from nbdist.transport import messages as m
from nbdist.transport.compression import Codec, make_codec
from nbdist.transport.deadlines import Silence
from nbdist.transport.faults import RankLost, RankSilent, kill_frozen
from nbdist.transport.pool import BodyPool
from nbdist.transport.waiting import CommFailure, WaitTimeout, receive_object, wait, wait_all, wait_some

__all__ = ["Master", "Client", "run_master", "worker_clients", "share_initial_weights", "open_master", "serve",
           "settle_centre",
           "average_state", "open_tallies", "restore_tallies", "commit_ready_checkpoints", "WORKER", "SUB_MASTER"]

REPORT_EVERY = 0.5  # seconds between a rank's throughput/phase records
# Longest a master waits for messages before it looks at its clients' silence again.
SILENCE_CHECK_EVERY = 0.5
# How long a master waits for a reply of the centre to leave before it moves the centre.
REPLY_WAIT = 0.5
# Bodies an asynchronous master receives into, whatever its number of clients: two lets
# one pass serve two updates (and EASGD's replies, which are the bodies, be in flight).
# A synchronous round streams its workers' bodies through as many: one the rule works
# on, the next one being received.
ASYNC_BODIES = 2

WORKER, SUB_MASTER = "worker", "sub-master"


@dataclass(slots=True)
class Client:
    """One peer a master serves, with the header its posted receive fills: a worker's
    leader (peer w + 1 on `block`) or, at the top master, a sub-master (peer j on
    `masters`). Workers' updates go through the algorithm's `master_apply`; a client with
    a `merge` function has its payload merged into the centre by that instead."""

    comm: Any
    peer: int
    kind: str  # WORKER or SUB_MASTER
    world_rank: int
    inbox: m.Message = field(default_factory=m.Message)  # the header alone
    merge: Callable[[np.ndarray, Sequence[Update]], None] | None = None  # Algorithm.merge_master_steps
    weight: int = 1  # workers whose model state (BatchNorm statistics) its messages carry
    silence: Silence = field(default_factory=Silence)
    body: m.Body | None = None  # the pooled body of the update being served
    codec: Codec | None = None  # how a worker's payload is encoded (--compression)

    def post(self) -> MPI.Request:
        return self.comm.Irecv(self.inbox.buffer, source=self.peer, tag=m.TAG_UPDATE)

    def receive_body(self, body: m.Body) -> MPI.Request:
        self.body = body
        return self.comm.Irecv(body.incoming(self.codec is not None), source=self.peer, tag=m.TAG_BODY)

    @property
    def index(self) -> int:
        """A worker's index under its master, a sub-master's among the masters."""
        return self.peer - 1 if self.kind == WORKER else self.peer

    def describe(self, ctx: RankContext | None = None) -> str:
        if ctx is not None:
            return ctx.peers.directory.describe(self.world_rank)
        return f"{self.kind} {self.index} (rank {self.world_rank})"


@dataclass(slots=True)
class _Reply:
    """A reply still in flight: its sends, whether it reads the centre, the pooled body it
    reads instead (given back once it has left), and since when."""

    requests: list
    reads_centre: bool
    body: m.Body | None = None
    since: float = field(default_factory=time.monotonic)


@dataclass
class Master:
    """A master's serving state. Its methods are where a sub-master (hierarchy.SubMaster)
    behaves differently from the top (or only) master."""

    ctx: RankContext
    clients: list = field(default_factory=list)  # [Client]
    center: np.ndarray | None = None  # the backend's flat parameters
    rule_state: Any = None
    opt: Any = None
    lr: Any = None  # sets opt's lr per update (train/lr.py MasterLr)
    requests: list = field(default_factory=list)  # one posted receive per client
    pool: BodyPool | None = None  # the bodies updates are received into
    round_buffer: np.ndarray | None = None  # a synchronous round's mean (or EASGD's reply), master_round's `out`
    waiting: list = field(default_factory=list)  # clients whose header is in, served at the next pass
    active: set = field(default_factory=set)  # clients still training: not DONE, failed or dropped
    dropped: dict = field(default_factory=dict)  # client -> why the run went on without it
    finished: set = field(default_factory=set)  # clients that said DONE
    acked_upto: list = field(default_factory=list)  # per client, see m.EPOCHS_ACKED
    states: np.ndarray | None = None  # each client's latest model state
    reply_headers: list = field(default_factory=list)  # one per client: a reply in flight keeps its own
    replying: dict = field(default_factory=dict)  # client -> _Reply still in flight
    silence_checked: float = 0.0  # when the clients' silence was last looked at
    members: EpochMembers | None = None
    version: int = 0
    next_epoch: int = 0  # lowest epoch not yet ended
    stopping: str = ""
    stop_label: str = ""
    snapshot: str = ""  # the label of the snapshot being taken (asynchronous checkpoints)
    snapshot_told: set = field(default_factory=set)
    snapshot_due: str = ""  # a snapshot that fell due while another was being taken
    error: str = ""
    history: list = field(default_factory=list)
    tallies: dict = field(default_factory=dict)
    acks: dict = field(default_factory=dict)  # checkpoint label -> clients that wrote it
    master_wrote: set = field(default_factory=set)
    failed: set = field(default_factory=set)
    epoch_clock: float = field(default_factory=time.time)  # when the previous epoch ended
    validator: BackgroundValidator | None = None
    # Training samples in the centre: those of every update applied, over all clients.
    samples_seen: int = 0
    sampled: SampledValidation | None = None  # --validate-every-samples, at the top (or only) master
    phases: dict = field(default_factory=lambda: {"wait": 0.0, "update": 0.0, "reply": 0.0, "validate": 0.0})
    updates: UpdateSummary = field(default_factory=UpdateSummary)  # since the last 'updates' record

    # -- decisions a sub-master takes differently ---------------------------------------
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
        finished = []
        while self.next_epoch in self.tallies and self._epoch_complete(self.next_epoch):
            epoch = self.next_epoch
            tally = self.tallies.pop(epoch)
            self.next_epoch += 1
            self.tallies.setdefault(self.next_epoch, EpochTally())
            now = time.time()
            seconds, self.epoch_clock = now - self.epoch_clock, now
            finished.append((epoch, tally, seconds))
        if finished and self.members is not None:
            self.members.forget_before(self.next_epoch)
        return finished

    def _epoch_complete(self, epoch: int) -> bool:
        expected = self.expected_in(epoch)
        return bool(expected) and expected <= self.tallies[epoch].ended

    def expected_in(self, epoch: int) -> set[int]:
        """The clients whose end of `epoch` the master waits for: the workers that share
        its data and the sub-masters, less those dropped or failed since."""
        gone = set(self.dropped) | self.failed
        workers = set(self.members.of(epoch, self.live_workers())) if self.members is not None else set()
        others = {i for i, c in enumerate(self.clients) if c.kind != WORKER}
        return (workers | others) - gone

    def live_workers(self) -> set[int]:
        return {i for i, c in enumerate(self.clients) if c.kind == WORKER and i not in self.dropped
                and i not in self.failed}

    def before_replies(self, applied: int, finished: list) -> None:
        """Between applying a round's updates and answering them (a sub-master talks to
        the top master here, so that its workers get the merged centre)."""

    def end_epoch(self, epoch: int, tally: EpochTally, seconds: float) -> None:
        """Every client has ended `epoch`: validate, report, decide, checkpoint."""
        ctx = self.ctx
        label = m.label_of(epoch + 1) if ctx.checkpoint_due(epoch + 1) else None
        if not ((epoch + 1) % ctx.options.validate_every == 0 or epoch + 1 == ctx.options.epochs):
            _finish_epoch(self, epoch, tally, seconds, None, self.samples_seen)
        elif ctx.options.synchronous:
            # Inline, after this round's replies went out: the workers compute meanwhile, and
            # the stop decision falls at the same step in every run (exact resume).
            t0 = time.perf_counter()
            average_state(self)
            val = ctx.backend.evaluate(*ctx.data.val_arrays())
            self.phases["validate"] += time.perf_counter() - t0
            _finish_epoch(self, epoch, tally, seconds, val, self.samples_seen)
        else:
            _collect_validation(self, block=True)  # one at a time, in epoch order
            average_state(self)
            self.validator.start(ctx.backend.params, ctx.backend.state, (epoch, tally, seconds, self.samples_seen))
        if label:
            if ctx.options.synchronous:
                self.save(label)
            else:
                self.take_snapshot(label)

    def take_snapshot(self, label: str) -> None:
        """Asynchronous checkpoint: this rank's share now, each client's at its next update."""
        if self.stopping:
            return  # the stop checkpoint will hold everything
        if self.snapshot:
            self.snapshot_due = label  # one at a time: taken when this one is complete
            return
        self.snapshot, self.snapshot_told = label, set()
        self.save(label)

    def save(self, label: str) -> None:
        """Write this rank's share of checkpoint `label`."""
        ctx = self.ctx
        # An asynchronous epoch enters the history when its background validation ends:
        # a snapshot taken before then would resume past an epoch its history lacks.
        _collect_validation(self, block=True)
        average_state(self)
        extra = {"version": self.version, "next_epoch": self.next_epoch, "early": ctx.early.to_json(),
                 "samples_seen": self.samples_seen,
                 **ctx.history_file.checkpoint(self.history), "members": self.members.to_json(),
                 "lr": self.lr.to_json(), **open_tallies(self, label)}
        save_rank_state(ctx, label, self.opt, self.rule_state, extra)
        self.master_wrote.add(label)

    def commit(self, label: str) -> None:
        """Every client and this rank wrote `label`: make it the run's latest checkpoint."""
        ctx = self.ctx
        ctx.checkpoints.commit(label, {"label": label, "layout": ctx.layout.to_dict(),
                                       "options": ctx.options.to_dict(), "version": self.version,
                                       "finished": sorted(self.clients[i].world_rank for i in self.finished),
                                       "world_ranks": ctx.world_ranks, "time": time.time()})

    def lose(self, i: int, cause: str, gone: bool) -> None:
        """Client i died (`gone`) or froze. Asynchronous workers are dropped and the run goes
        on; otherwise the run cannot go on and this raises RunFailure."""
        client, ctx = self.clients[i], self.ctx
        what = f"{client.describe(ctx)} {cause}"
        info = ctx.peers.directory.infos.get(client.world_rank)
        if ctx.options.synchronous or client.kind != WORKER:
            if not gone and info is not None:
                gone = kill_frozen(info)  # the survivors can restart without it only once it is gone
            why = ("a synchronous round needs every worker" if client.kind == WORKER
                   else "its workers' updates can no longer reach the centre")
            failure = RankLost if cause == "died" else RankSilent
            raise failure(f"{what}: the run cannot go on ({why})", ranks=[client.world_rank], restartable=gone)
        # A frozen worker is left as it is: if it wakes up, its next update is answered
        # DROPPED and it leaves (the run's end removes it if it never does).
        self.dropped[i] = cause
        self.active.discard(i)
        self.snapshot_told.discard(i)
        if gone:
            self.requests[i] = MPI.REQUEST_NULL
        left = len(self.live_workers())
        if left == 0:
            raise RankLost(f"{what}, and it was the last worker: the run cannot go on",
                           ranks=[client.world_rank], restartable=gone)
        ctx.log.emit("fault", {"rank": client.world_rank, "role": client.kind, "worker": client.index,
                               "cause": cause, "workers_left": left, "host": info.host if info else ""},
                     step=self.version, epoch=self.next_epoch)
        ctx.warn(f"nbdist: {what}; the run goes on with {left} worker{'s' if left != 1 else ''}, "
                 f"which share its data from the next epoch")


def run_master(ctx: RankContext) -> RunResult:
    """The top (or only) master: serves its workers and, with --masters > 1, the sub-masters."""
    me = Master(ctx)
    clients = worker_clients(ctx)
    if ctx.layout.masters > 1:
        from nbdist.roles.hierarchy import sub_master_clients  # hierarchy builds on this module

        clients += sub_master_clients(ctx)
    open_master(me, clients)
    if ctx.resume_from is not None:
        extra = load_rank_state(ctx, ctx.resume_from, me.opt, me.rule_state)
        me.version, me.next_epoch = int(extra["version"]), int(extra["next_epoch"])
        me.lr.load_json(extra.get("lr", {}))
        ctx.early.load_json(extra.get("early", {}))
        me.history = ctx.history_file.resume(extra)
        me.samples_seen = int(extra.get("samples_seen", sum(h.get("samples", 0) for h in me.history)))
        if not ctx.relayout:  # on other ranks, every worker starts the epoch again
            restore_tallies(me, extra)
        ctx.say(f"resumed from {ctx.resume_from} at epoch {me.next_epoch + 1}, version {me.version}")
    else:
        share_initial_weights(ctx)
    if ctx.options.validate_every_samples:
        me.sampled = SampledValidation(ctx.options.validate_every_samples, me.samples_seen,
                                       BackgroundValidator(ctx.make_replica, *ctx.data.val_arrays()),
                                       ctx.backend.metric_name)
    started = serve(me)

    _collect_validation(me, block=True)
    if me.sampled is not None:
        me.sampled.collect(ctx.log, block=True)
    # Every client has said DONE (or failed, or was dropped). The stop checkpoint commits
    # only when every client stopped on the same STOP; otherwise the last epoch checkpoint
    # is the state.
    if me.stopping and not me.error:
        me.save(me.stop_label)
        commit_ready_checkpoints(me)
    ctx.checkpoints.discard_incomplete()
    ctx.log.emit("phase", dict(me.phases), step=me.version, epoch=me.next_epoch)
    if me.error:
        ctx.log.emit("run", {"status": "failed", "error": me.error})
        ctx.log.close()
        raise TrainingError(me.error)
    reason = me.stopping or f"completed {ctx.options.epochs} epochs"
    faults = {**_losses(me), **({"restarts": ctx.attempt} if ctx.attempt else {})}
    ctx.log.emit("run", {"status": "stopped" if me.stopping else "completed", "reason": reason, **faults})
    ctx.log.close()
    average_state(me)
    result = write_final(ctx.run_dir, ctx.backend.named_arrays(), me.history, reason, time.time() - started, faults)
    _remove_dropped(me)
    return result


def _losses(me: Master) -> dict[str, Any]:
    """What the run lost to dropped workers, for its last record and its summary."""
    if not me.dropped:
        return {}
    return {"dropped": [{"rank": me.clients[i].world_rank, "worker": me.clients[i].index, "cause": cause}
                        for i, cause in sorted(me.dropped.items())],
            "samples_lost": int(sum(h.get("samples_lost", 0) for h in me.history))}


def _remove_dropped(me: Master) -> None:
    """A dropped worker that is still frozen would keep mpiexec waiting for it forever."""
    for i in me.dropped:
        info = me.ctx.peers.directory.infos.get(me.clients[i].world_rank)
        if info is not None:
            kill_frozen(info)


def worker_clients(ctx: RankContext) -> list[Client]:
    block = ctx.comms.block
    ranks = _leader_world_ranks(ctx, block.Get_size() - 1)
    # Decoding keeps no state: the workers share one codec.
    codec = (make_codec(ctx.compression, ctx.backend.num_params, ctx.backend.param_blocks())
             if ctx.compression is not None else None)
    return [Client(block, i + 1, WORKER, rank, silence=Silence(ctx.options.peer_timeout), codec=codec)
            for i, rank in enumerate(ranks)]


def _leader_world_ranks(ctx: RankContext, workers: int) -> list[int]:
    ranks = ctx.layout.fold_ranks(ctx.role.group, ctx.role.fold)
    roles = [ctx.layout.role(r) for r in ranks]
    return [r.rank for r in roles if r.kind == "worker" and r.master == ctx.role.master and r.proc == 0][:workers]


def open_master(me: Master, clients: list[Client]) -> None:
    """What every master holds besides its clients: the centre, its rule and optimiser."""
    ctx = me.ctx
    me.center = ctx.backend.params
    me.rule_state = ctx.algorithm.new_master_state(me.center.size)
    me.opt = ctx.backend.make_optimizer(ctx.master_optimizer) if ctx.master_optimizer else None
    me.lr = master_lr_for(ctx, me.opt)
    me.validator = BackgroundValidator(ctx.make_replica, *ctx.data.val_arrays())
    me.clients = clients
    me.states = np.zeros((len(clients), ctx.backend.state.size), np.float32)
    # A synchronous round streams its workers' bodies; it holds its sub-masters' pushes.
    held = sum(1 for c in clients if c.kind != WORKER) if ctx.options.synchronous else 0
    wire = max((c.codec.wire_size for c in clients if c.codec is not None), default=0)
    me.pool = BodyPool(me.center.size, ctx.backend.state.size, ASYNC_BODIES + held, wire)
    if ctx.options.synchronous:
        me.round_buffer = np.empty_like(me.center)
    workers = sum(1 for c in clients if c.kind == WORKER)
    me.members = EpochMembers(workers)
    me.reply_headers = [m.new_header(workers) for _ in clients]


def share_initial_weights(ctx: RankContext) -> None:
    """Fresh run: every master starts from the top master's centre, every worker from its master's."""
    params, state = ctx.backend.params, ctx.backend.state
    if ctx.layout.masters > 1:
        ctx.peers.collectives.bcast(ctx.comms.masters, params)
        ctx.peers.collectives.bcast(ctx.comms.masters, state)
    ctx.peers.collectives.bcast(ctx.comms.block, params)
    ctx.peers.collectives.bcast(ctx.comms.block, state)


def serve(me: Master) -> float:
    """Serve the clients until every one has said DONE (or failed, or was dropped);
    returns the start time."""
    ctx = me.ctx
    me.requests = [c.post() for c in me.clients]
    me.active = set(range(len(me.clients)))
    me.acked_upto = [me.next_epoch] * len(me.clients)  # a resume starts from a committed epoch
    me.tallies.setdefault(me.next_epoch, EpochTally())
    for c in me.clients:
        c.silence.restart()
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
            reply(me, i, m.CONTINUE, payload)
        for epoch, tally, seconds in finished:
            me.end_epoch(epoch, tally, seconds)
        _collect_validation(me, block=False)
        _validate_by_samples(me)
        if time.monotonic() - last_report >= REPORT_EVERY:
            ctx.log.emit("phase", dict(me.phases), step=me.version, epoch=me.next_epoch)
            _report_updates(me)
            last_report = time.monotonic()
        commit_ready_checkpoints(me)
    _report_updates(me)
    return started


def _report_updates(me: Master) -> None:
    """The 'updates' record of the interval that ends now (none when nothing was applied)."""
    values = me.updates.take(me.version)
    if values is not None:
        me.ctx.log.emit("updates", values, step=me.version, epoch=me.next_epoch)


def _wait_for_clients(me: Master) -> list[int]:
    """The clients whose message is in: any one when asynchronous, every client still
    training when synchronous. Clients found dead, or silent for longer than the peer
    timeout, are lost on the way (Master.lose)."""
    t0 = time.perf_counter()
    carried, me.waiting = me.waiting, []  # ready since the last pass: served first
    ready: set[int] = set(carried)
    synchronous = me.ctx.options.synchronous
    while me.active:
        _check_replies(me)
        if time.monotonic() - me.silence_checked >= SILENCE_CHECK_EVERY:
            # Also while the others keep the master busy: a frozen client sends nothing.
            me.silence_checked = time.monotonic()
            _check_silence(me)
        # Dropped clients keep their receive posted: one that wakes up is told DROPPED.
        done, failed = wait_some(me.requests, timeout=0 if ready else SILENCE_CHECK_EVERY)
        for i, _failure in failed:
            me.requests[i] = MPI.REQUEST_NULL
            if i in me.active:
                me.lose(i, "died", gone=True)
        for i in done:
            me.clients[i].silence.heard()
        ready.update(done)
        if ready and (not synchronous or me.active <= ready):
            break
    me.phases["wait"] += time.perf_counter() - t0
    order = carried + sorted(ready - set(carried))
    return [i for i in order if i in me.active or i in me.dropped]


def _check_silence(me: Master) -> None:
    """Clients whose message the master still waits for, silent too long since it last
    answered them: lost (frozen, or far slower than their peer timeout allows)."""
    for i in sorted(me.active):
        silence = me.clients[i].silence
        if me.requests[i] != MPI.REQUEST_NULL and silence.exceeded:
            me.lose(i, f"sent nothing for {silence.silent_for():.0f} s (the peer timeout is {silence.limit:.0f} s)",
                    gone=False)


def _read_messages(me: Master, ready: list[int]) -> list[tuple[int, Update]]:
    """Handle what the `ready` clients sent (those the pool has bodies for); returns the
    updates to apply. Every body received is given back by its reply (`reply`)."""
    updates: list[tuple[int, Update]] = []
    # Synchronous: the workers' bodies are received as the round applies them (_round_updates).
    streamed = {i for i in ready if me.ctx.options.synchronous and me.clients[i].kind == WORKER}
    for i in _receive_bodies(me, ready, streamed):
        client = me.clients[i]
        msg = client.inbox
        kind = msg.header[m.KIND]
        if i in me.dropped:
            # Woke up after the run went on without it: it must leave.
            if kind not in (m.DONE, m.ERROR, m.LOST) and _body_in(me, i):
                reply(me, i, m.DROPPED, me.center, repost=False)
            continue
        _note_checkpoint_ack(me, i, msg)
        if kind == m.DONE:
            _retire(me, i)
            me.finished.add(i)
            continue
        if kind in (m.ERROR, m.LOST):
            text = _error_text(me, i)
            if kind == m.LOST:
                _retire(me, i)
                me.lose(i, text, gone=True)
            else:
                _client_failed(me, i, text)
            continue
        if msg.has(m.STOP_REQUEST):
            me.request_stop("stop requested")
        if me.stopping:
            # The update is dropped (and not counted): the client checkpoints the
            # state it had before it and leaves.
            if _body_in(me, i):
                reply(me, i, m.STOP, me.center)
            continue
        if me.snapshot and i not in me.snapshot_told:
            # Not applied: the client saves the state it had before it, then sends it again.
            if _body_in(me, i):
                me.snapshot_told.add(i)
                reply(me, i, m.SNAPSHOT, me.center, label=me.snapshot)
            continue
        _tally(me, i, msg)
        # Staleness is set when the update is applied (_apply_updates), not now: the
        # updates of one batch are applied one by one, each one version later.
        update = Update(None, 0, int(msg.header[m.SAMPLES]), int(msg.header[m.VERSION]))
        if i not in streamed:
            me.states[i] = client.body.state
            update.payload = client.body.payload
        updates.append((i, update))
    return updates


def _body_in(me: Master, i: int) -> bool:
    """Whether client i's body is in, receiving it now if it was left to a synchronous
    round (_round_updates) that will not apply it: it was sent, and must be received
    before the reply. False when it did not arrive (the client is lost)."""
    client = me.clients[i]
    if client.body is not None or client.inbox.header[m.KIND] != m.UPDATE:
        return True
    body = _take_body(me)
    if body is None:  # between rounds every body is free
        raise TrainingError("internal: no receive buffer free for a synchronous master")
    return _body_arrived(me, i, client.receive_body(body))


def _round_updates(me: Master, round: list[tuple[int, Update]]) -> Iterator[Update]:
    """A synchronous round's updates for the rule's master_round, each body received as
    the rule draws it and given back once the rule draws the next; the next body's
    receive is posted first, so that it arrives while the rule works on this one: the
    round holds two bodies, not one per worker. A body that does not arrive loses its
    client, which ends a synchronous run."""
    receiving: dict[int, MPI.Request] = {}
    for k, (i, update) in enumerate(round):
        for ahead in (k, k + 1):
            if ahead < len(round) and ahead not in receiving and (body := me.pool.take()) is not None:
                receiving[ahead] = me.clients[round[ahead][0]].receive_body(body)
        if k not in receiving:  # the previous body was given back: cannot happen
            raise TrainingError("internal: no receive buffer free for a synchronous round")
        t0 = time.perf_counter()
        arrived = _body_arrived(me, i, receiving.pop(k))
        me.phases["wait"] += time.perf_counter() - t0
        if not arrived:  # lose() raises for a synchronous worker: only a bug gets here
            raise TrainingError(f"internal: {me.clients[i].describe(me.ctx)} left a synchronous round")
        client = me.clients[i]
        me.states[i] = client.body.state
        update.payload = client.body.payload
        yield update
        update.payload = None
        me.pool.give_back(client.body)
        client.body = None


def _receive_bodies(me: Master, ready: list[int], streamed: set[int]) -> list[int]:
    """Receive the bodies of the ready clients' updates into pooled buffers, but those of
    `streamed` clients (a synchronous round receives them as it applies them); returns
    the clients served now: those without an update first, then the updates, each in
    order. Those the pool has no buffer for wait for the next pass, in order; a client
    whose body does not follow its header is lost."""
    t0 = time.perf_counter()
    served, receiving = [], []
    for i in ready:
        client = me.clients[i]
        if client.inbox.header[m.KIND] != m.UPDATE:
            served.append(i)
            continue
        if i in streamed:
            receiving.append((i, None))
            continue
        body = None if me.waiting else _take_body(me)
        if body is None:
            me.waiting.append(i)
            continue
        receiving.append((i, client.receive_body(body)))
    for i, request in receiving:
        if request is None or _body_arrived(me, i, request):
            served.append(i)
    me.phases["wait"] += time.perf_counter() - t0  # receiving is part of waiting for a message
    return served


def _take_body(me: Master) -> m.Body | None:
    """A free body; when all are lent, one that a reply in flight gives back soon."""
    body = me.pool.take()
    if body is None:
        _check_replies(me)
        body = me.pool.take()
    if body is None:
        holders = [i for i, pending in me.replying.items() if pending.body is not None]
        if holders and _reply_left(me, holders[0], REPLY_WAIT):
            body = me.pool.take()
    return body


def _body_arrived(me: Master, i: int, request: MPI.Request) -> bool:
    """Wait for client i's body, sent right after its header (within the peer timeout)."""
    client = me.clients[i]
    try:
        wait(request, timeout=client.silence.limit)
        if client.codec is not None:  # the one place a worker's encoded payload is decoded
            client.codec.decode(client.body.wire, client.body.payload)
        return True
    except CommFailure:
        me.pool.write_off(client.body)
        client.body = None
        me.requests[i] = MPI.REQUEST_NULL
        if i in me.active:
            me.lose(i, "died", gone=True)
    except WaitTimeout:
        me.pool.write_off(client.body)  # still posted: MPI may yet write into it
        client.body = None
        if i in me.active:
            me.lose(i, f"sent a header but not its update within {client.silence.limit:.0f} s (the peer timeout)",
                    gone=False)
    return False


def _error_text(me: Master, i: int) -> str:
    """The text that follows an ERROR or LOST header (sent right after it)."""
    client = me.clients[i]
    try:
        return receive_object(client.comm, client.peer, m.TAG_ERROR_TEXT, timeout=client.silence.limit)
    except (WaitTimeout, CommFailure):
        return "failed (its message did not arrive)"


def _retire(me: Master, i: int) -> None:
    me.active.discard(i)
    me.requests[i] = MPI.REQUEST_NULL


def _client_failed(me: Master, i: int, text: str) -> None:
    client = me.clients[i]
    me.error = me.error or text
    me.failed.add(i)
    me.request_stop(f"error on {client.describe(me.ctx)}")
    if client.kind == SUB_MASTER:
        # It still has workers to stop: it passes this STOP on to them, then says DONE,
        # so no rank is still writing into the run directory when the top master leaves.
        reply(me, i, m.STOP, me.center)
    else:
        _retire(me, i)


def _apply_updates(me: Master, updates: list[tuple[int, Update]]) -> list[tuple[int, np.ndarray]]:
    """Fold the updates into the centre, a synchronous round as one version and each
    asynchronous update as its own; returns (client, array to reply) pairs."""
    ctx = me.ctx
    groups = [updates] if ctx.options.synchronous else [[u] for u in updates]
    replies: list[tuple[int, np.ndarray]] = []
    for group in groups:
        if not group:
            continue
        settle_centre(me)  # counted as replying
        t0 = time.perf_counter()
        for _, u in group:
            u.staleness = me.version - u.version
        from_workers = [(i, u) for i, u in group if me.clients[i].merge is None]
        from_masters = [(i, u) for i, u in group if me.clients[i].merge is not None]
        start = me.center.copy() if from_workers and from_masters else None
        waited = me.phases["wait"]  # a synchronous round receives its bodies as it goes
        if from_workers:
            me.lr.before_update(sum(u.samples for _, u in from_workers))
            replies += _apply_rule(me, from_workers)
        if from_masters:
            _merge_masters(me, start, len(from_workers), from_masters)
            replies += [(i, me.center) for i, _ in from_masters]
        me.version += 1
        me.phases["update"] += time.perf_counter() - t0 - (me.phases["wait"] - waited)
        for i, u in group:
            client = me.clients[i]
            epoch = int(client.inbox.header[m.EPOCH])
            me.tallies.setdefault(epoch, EpochTally()).add_staleness(u.staleness)
            me.updates.add(client.world_rank, u.staleness, me.version)
            if ctx.options.trace_updates:
                who = {"worker": client.index} if client.kind == WORKER else {"sub_master": client.index}
                ctx.log.emit("update", {**who, "source_rank": client.world_rank, "staleness": u.staleness,
                                        "version": me.version, "traced": True}, step=me.version, epoch=epoch)
    return replies


def _apply_rule(me: Master, updates: list[tuple[int, Update]]) -> list[tuple[int, np.ndarray]]:
    """The rule on the workers' updates: master_apply, or, for a synchronous round,
    master_round with the bodies streamed in; (client, array to reply) pairs."""
    ctx = me.ctx
    if not ctx.options.synchronous:
        payloads = ctx.algorithm.master_apply(me.rule_state, me.center, [u for _, u in updates], me.opt)
        return [(i, payload) for (i, _), payload in zip(updates, payloads)]
    stream = _round_updates(me, updates)
    payload = ctx.algorithm.master_round(me.rule_state, me.center, stream, [u.samples for _, u in updates],
                                         me.opt, me.round_buffer)
    if next(stream, None) is not None:
        raise TrainingError(f"internal: {ctx.algorithm.name}'s master_round left updates of the round undrawn")
    return [(i, payload) for i, _ in updates]


def _merge_masters(me: Master, start: np.ndarray | None, own_workers: int, pushes: list[tuple[int, Update]]) -> None:
    """Merge sub-masters' pushes (hierarchy.py) into the centre with their `merge` rule.
    In a synchronous round this master's own workers moved the centre from `start`
    too: that step is merged with the pushes as one master's among the others."""
    steps = [Update(u.payload, u.staleness, me.clients[i].weight, u.version) for i, u in pushes]
    if start is not None:
        steps.insert(0, Update(me.center - start, 0, own_workers))
        me.center[:] = start
    me.clients[pushes[0][0]].merge(me.center, steps)


def reply(me: Master, i: int, kind: float, payload: np.ndarray, *, label: str = "", repost: bool = True) -> None:
    """Answer client i (header, then the payload array itself) without waiting for it to
    leave, and post its next receive: the client sends nothing before it has taken the
    reply. The body of its update goes back to the pool, once the reply has left when
    the reply is that body (_check_replies).

    The header names the workers that share the next epoch's data when the client's
    message ended an epoch."""
    t0 = time.perf_counter()
    if i in me.replying:  # its previous reply, taken by now: the client has sent again
        _reply_left(me, i, REPLY_WAIT)
    client, header = me.clients[i], me.reply_headers[i]
    header[m.KIND] = kind
    header[m.VERSION] = me.version
    header[m.CHECKPOINT] = m.label_code(label or me.stop_label) if kind in (m.STOP, m.SNAPSHOT) else m.NO_CHECKPOINT
    epoch = int(client.inbox.header[m.EPOCH]) + (1 if client.inbox.has(m.EPOCH_END) else 0)
    header[m.EPOCH] = epoch
    header[m.HEADER_FLOATS // 2:] = 0.0
    if me.members.workers:
        for w in me.members.of(epoch, me.live_workers()):
            header[m.HEADER_FLOATS // 2 + w] = 1.0
    body, client.body = client.body, None
    held = body if body is not None and np.may_share_memory(payload, body.buffer) else None
    if body is not None and held is None:
        me.pool.give_back(body)
    me.replying[i] = _Reply([client.comm.Isend(header, dest=client.peer, tag=m.TAG_REPLY_HEADER),
                             client.comm.Isend(payload, dest=client.peer, tag=m.TAG_REPLY)],
                            reads_centre=_reads_centre(me, payload), body=held)
    client.silence.restart()  # its next message comes after its next steps, from now
    if repost:
        me.requests[i] = client.post()
    _reply_left(me, i, 0)
    me.phases["reply"] += time.perf_counter() - t0


def _reads_centre(me: Master, payload: np.ndarray) -> bool:
    """Whether a reply reads what the next round or update overwrites: the centre, or the
    round buffer (EASGD's synchronous reply, the centre before the round)."""
    return np.may_share_memory(payload, me.center) or (
        me.round_buffer is not None and np.may_share_memory(payload, me.round_buffer))


def settle_centre(me: Master) -> None:
    """Before the centre moves: wait for the replies that still read it, each once and for
    up to REPLY_WAIT (one still in flight after that reaches its client partly updated)."""
    t0 = time.perf_counter()
    for i in [i for i, pending in me.replying.items() if pending.reads_centre]:
        if i in me.replying and not _reply_left(me, i, REPLY_WAIT):
            me.replying[i].reads_centre = False
    me.phases["reply"] += time.perf_counter() - t0


def _reply_left(me: Master, i: int, wait: float) -> bool:
    """Whether client i's reply has left (waiting up to `wait` seconds); then the body it
    read goes back to the pool. A client found dead meanwhile is lost."""
    pending = me.replying[i]
    try:
        if wait > 0:
            wait_all(pending.requests, timeout=wait)
        elif not MPI.Request.Testall(pending.requests):
            return False
    except WaitTimeout:
        return False
    except (CommFailure, MPI.Exception):
        del me.replying[i]
        if pending.body is not None:
            me.pool.write_off(pending.body)
        me.requests[i] = MPI.REQUEST_NULL
        if i in me.active:
            me.lose(i, "died", gone=True)
        return True
    del me.replying[i]
    if pending.body is not None:
        me.pool.give_back(pending.body)
    return True


def _check_replies(me: Master) -> None:
    """Replies still in flight: give back the bodies of those that have left; lose the
    clients that have not taken theirs within the peer timeout (frozen). A dropped
    client's reply stays in flight (its body written off: the pool makes another): if it
    wakes up and takes it, its next update is received and answered DROPPED."""
    for i in list(me.replying):
        if _reply_left(me, i, 0):
            continue
        pending, limit = me.replying[i], me.clients[i].silence.limit
        if i in me.active and time.monotonic() - pending.since > limit:
            if pending.body is not None:
                me.pool.write_off(pending.body)
                pending.body = None
            me.lose(i, f"did not take its reply for {limit:.0f} s (the peer timeout)", gone=False)


def _tally(me: Master, i: int, msg: m.Message) -> None:
    epoch = int(msg.header[m.EPOCH])
    # A sub-master's SAMPLES are its epoch's tally, sent when the epoch ends; what a push
    # merges into the centre comes in MERGED_SAMPLES.
    me.samples_seen += int(msg.header[m.MERGED_SAMPLES if me.clients[i].kind == SUB_MASTER else m.SAMPLES])
    tally = me.tallies.setdefault(epoch, EpochTally())
    tally.train.add(BatchStats(msg.header[m.LOSS_SUM], msg.header[m.METRIC_SUM], int(msg.header[m.SAMPLES])))
    if msg.has(m.EPOCH_END):
        tally.ended.add(i)


def _note_checkpoint_ack(me: Master, i: int, msg: m.Message) -> None:
    code = msg.header[m.CHECKPOINT]
    if code != m.NO_CHECKPOINT:
        me.acks.setdefault(m.label_of(code), set()).add(i)
    # Cumulative acks (synchronous sub-masters): every due epoch checkpoint up to `upto`.
    upto = int(msg.header[m.EPOCHS_ACKED])
    for epoch in range(me.acked_upto[i] + 1, upto + 1):
        if me.ctx.checkpoint_due(epoch):
            me.acks.setdefault(m.label_of(epoch), set()).add(i)
    me.acked_upto[i] = max(me.acked_upto[i], upto)


def open_tallies(me: Master, label: str) -> dict:
    """The tallies of the epochs not yet ended, for stop checkpoints and snapshots.

    Those are consistent cuts (each client saved the state the master had accepted), and
    a worker that ended an epoch before the cut will not end it again after a resume:
    without its tally that epoch would never end. At a synchronous epoch checkpoint, on
    the contrary, every worker restarts the next epoch from its first batch.
    """
    if label != me.stop_label and label != me.snapshot:
        return {}
    return {"tallies": {str(epoch): tally.to_json() for epoch, tally in me.tallies.items()}}


def restore_tallies(me: Master, extra: dict) -> None:
    me.tallies = {int(epoch): EpochTally.from_json(v) for epoch, v in extra.get("tallies", {}).items()}
    me.members.load_json(extra.get("members", {}))


def _collect_validation(me: Master, block: bool) -> None:
    t0 = time.perf_counter()
    done = me.validator.poll(block)
    if block:
        me.phases["validate"] += time.perf_counter() - t0
    if done is not None:
        (epoch, tally, seconds, seen), val = done
        _finish_epoch(me, epoch, tally, seconds, val, seen)


def _validate_by_samples(me: Master) -> None:
    """--validate-every-samples: record the validation that finished, start the next one
    when a mark has passed. In the background, like an epoch's: workers are served meanwhile."""
    sampled = me.sampled
    if sampled is None:
        return
    sampled.collect(me.ctx.log)
    if sampled.due(me.samples_seen) and not me.stopping:
        average_state(me)
        sampled.start(me.ctx.backend.params, me.ctx.backend.state, me.samples_seen, me.version, me.next_epoch)


def _finish_epoch(me: Master, epoch: int, tally: EpochTally, seconds: float, val, seen: int) -> None:
    """`seen`: the samples in the centre that was validated (at the epoch's end if it was not)."""
    ctx = me.ctx
    try:
        metrics = epoch_metrics(epoch, tally, val, seconds, ctx.backend.metric_name, seen)
    except TrainingError as exc:
        me.error = me.error or str(exc)
        me.begin_stop("error")
        return
    metrics.update(lr_metrics(ctx.worker_lr, ctx.master_lr, epoch))
    if me.dropped:  # how many workers finished the epoch
        metrics["workers"] = sum(1 for i in tally.ended if me.clients[i].kind == WORKER)
    # What dropped workers cost the epoch (here or under a sub-master): the samples of a
    # share that its worker took along. The top master's tally counts the whole run's.
    lost = ctx.data.n_train - tally.train.n
    if lost > 0 and not ctx.role.is_sub_master:
        metrics["samples_lost"] = int(lost)
    me.history.append(metrics)
    ctx.log.emit("epoch", metrics, step=me.version, epoch=epoch + 1)
    ctx.say(format_epoch(metrics, ctx.options.epochs))
    if not me.stopping:
        decision = ctx.early.update(metrics)
        if decision.stop:
            me.begin_stop(decision.reason)


def average_state(me: Master) -> None:
    """The centre's BatchNorm statistics: the clients' latest ones, weighted by the
    workers behind each (a sub-master's are already its workers' mean)."""
    state = me.ctx.backend.state
    if state.size:
        state[:] = np.average(me.states, axis=0, weights=[c.weight for c in me.clients])


def commit_ready_checkpoints(me: Master) -> None:
    """Commit what every client still expected has written; the snapshot in progress
    ends with its commit (and the next due one starts)."""
    needed = set(range(len(me.clients))) - me.failed - set(me.dropped)
    for label in sorted(me.master_wrote):
        have = me.acks.get(label, set())
        if label == me.snapshot:
            # A client that finished before it was told has no update left to hold back.
            have = have | (me.finished - me.snapshot_told)
        if needed <= have:
            me.commit(label)
            me.master_wrote.discard(label)
            me.acks.pop(label, None)
            if label == me.snapshot:
                me.snapshot = ""
                due, me.snapshot_due = me.snapshot_due, ""
                if due:
                    me.take_snapshot(due)
