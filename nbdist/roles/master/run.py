"""The top (or only) master's run: its set-up, the serving loop every master runs
(serve), and its end."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from nbdist.errors import TrainingError
from nbdist.roles.master.apply import apply_updates
from nbdist.roles.master.clients import WORKER, Client, worker_clients
from nbdist.roles.master.epochs import (
    average_state,
    collect_validation,
    commit_ready_checkpoints,
    finish_checkpoints,
    restore_tallies,
    validate_by_samples,
)
from nbdist.roles.master.receive import read_messages, wait_for_clients
from nbdist.roles.master.replies import reply
from nbdist.roles.master.state import Master
from nbdist.roles.master.windows import WorkerWindows
from nbdist.roles.membership import EpochMembers
from nbdist.train.context import RankContext
from nbdist.train.loop import REPORT_EVERY
from nbdist.train.lr import master_lr_for
from nbdist.train.progress import EpochTally, RunResult, write_final
from nbdist.train.state import load_rank_state
from nbdist.train.validation import BackgroundValidator, SampledValidation
from nbdist.transport import messages as m
from nbdist.transport.faults import kill_frozen
from nbdist.transport.master_channel import MasterChannel
from nbdist.transport.pool import BodyPool

__all__ = [
    "ASYNC_BODIES",
    "run_master",
    "open_master",
    "share_initial_weights",
    "open_epochs",
    "serve",
    "serve_and_settle",
]


# Bodies an asynchronous master receives into, whatever its number of clients: two lets
# one pass serve two updates (and EASGD's replies, which are the bodies, be in flight).
# A synchronous round streams its workers' bodies through as many: one the rule works
# on, the next one being received.
ASYNC_BODIES = 2


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
            me.load_speeds(extra)
        ctx.say(f"resumed from {ctx.resume_from} at epoch {me.next_epoch + 1}, version {me.version}")
    else:
        share_initial_weights(ctx)
    if ctx.options.validate_every_samples:
        me.sampled = SampledValidation(
            ctx.options.validate_every_samples,
            me.samples_seen,
            BackgroundValidator(ctx.make_replica, *ctx.data.val_arrays()),
            ctx.backend.metric_name,
        )
    started = serve_and_settle(me)

    collect_validation(me, block=True)
    if me.sampled is not None:
        me.sampled.collect(ctx.log, block=True)
    # Every client has said DONE (or failed, or was dropped). The stop checkpoint commits
    # only when every client stopped on the same STOP; otherwise the last epoch checkpoint
    # is the state.
    if me.stopping and not me.error:
        me.save(me.stop_label)
    elif not me.error and not ctx.options.synchronous:
        me.save_last_epoch()
    finish_checkpoints(me)
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
    return {
        "dropped": [
            {"rank": me.clients[i].world_rank, "worker": me.clients[i].index, "cause": cause}
            for i, cause in sorted(me.dropped.items())
        ],
        # Every epoch's samples that never came (a late share counts in a later epoch).
        "samples_lost": max(0, int(sum(me.ctx.data.n_train - h.get("samples", 0) for h in me.history))),
    }


def _remove_dropped(me: Master) -> None:
    """A dropped worker that is still frozen would keep mpiexec waiting for it forever."""
    for i in me.dropped:
        info = me.ctx.peers.directory.infos.get(me.clients[i].world_rank)
        if info is not None:
            kill_frozen(info)


def open_master(me: Master, clients: list[Client]) -> None:
    """What every master holds besides its clients: the centre, its rule and optimiser."""
    ctx = me.ctx
    me.centre = ctx.backend.params
    me.rule_state = ctx.rule.new_master_state(me.centre.size)
    me.opt = ctx.backend.make_optimizer(ctx.master_optimizer) if ctx.master_optimizer else None
    me.lr = master_lr_for(ctx, me.opt)
    me.validator = BackgroundValidator(ctx.make_replica, *ctx.data.val_arrays())
    me.clients = clients
    me.channel = MasterChannel([(c.comm, c.peer, c.inbox.buffer) for c in clients])
    me.states = np.zeros((len(clients), ctx.backend.state.size), np.float32)
    # A synchronous round streams its workers' bodies; it holds its sub-masters' pushes.
    held = sum(1 for c in clients if c.kind != WORKER) if ctx.options.synchronous else 0
    wire = max((c.codec.wire_size for c in clients if c.codec is not None), default=0)
    me.pool = BodyPool(me.centre.size, ctx.backend.state.size, ASYNC_BODIES + held, wire)
    if ctx.options.synchronous:
        me.round_buffer = np.empty_like(me.centre)
    workers = sum(1 for c in clients if c.kind == WORKER)
    me.members = EpochMembers(workers)
    me.reply_headers = [m.new_header(workers) for _ in clients]
    if ctx.rule.adapts_windows and not ctx.options.synchronous:
        me.windows = WorkerWindows(ctx.rule, ctx.sync_every, len(clients))


def share_initial_weights(ctx: RankContext) -> None:
    """Fresh run: every master starts from the top master's centre, every worker from its master's."""
    params, state = ctx.backend.params, ctx.backend.state
    if ctx.layout.masters > 1:
        ctx.peers.collectives.bcast(ctx.comms.masters, params)
        ctx.peers.collectives.bcast(ctx.comms.masters, state)
    ctx.peers.collectives.bcast(ctx.comms.block, params)
    ctx.peers.collectives.bcast(ctx.comms.block, state)


def serve_and_settle(me: Master) -> float:
    """`serve`; when it fails, the checkpoint writes already queued are finished first (briefly),
    so that a restart reads the checkpoints as they stand, not half-way through a commit."""
    try:
        return serve(me)
    except BaseException:
        me.writer.settle()
        raise


def open_epochs(me: Master) -> None:
    """Where the clients stand as serving begins: all training, in the master's next epoch
    (a resume's open epochs say who had ended them), heard from now."""
    me.active = set(range(len(me.clients)))
    me.acked_upto = [me.next_epoch] * len(me.clients)  # a resume starts from a committed epoch
    me.reached = [me.next_epoch] * len(me.clients)
    for epoch, tally in me.tallies.items():  # a resume's open epochs: who had ended them
        for i in tally.ended:
            me.reached[i] = max(me.reached[i], epoch + 1)
    me.epoch_began, me.whole_epoch_began = [time.monotonic()] * len(me.clients), [None] * len(me.clients)
    me.tallies.setdefault(me.next_epoch, EpochTally())
    for c in me.clients:
        c.silence.restart()


def serve(me: Master) -> float:
    """Serve the clients until every one has said DONE (or failed, or was dropped);
    returns the start time."""
    ctx = me.ctx
    for i in range(len(me.clients)):
        me.channel.post(i)
    open_epochs(me)
    started = me.epoch_clock = time.time()  # after the initial broadcast: all ranks are ready
    last_report = time.monotonic()
    while me.active:
        ready = wait_for_clients(me)
        if ctx.stop.requested:  # after the wait: a signal usually arrives during one
            me.request_stop(ctx.stop.reason)
        updates = read_messages(me, ready)
        replies = apply_updates(me, updates)
        finished = me.pop_finished_epochs()
        me.before_replies(len(updates), finished)
        for i, payload in replies:
            reply(me, i, m.CONTINUE, payload)
        me.end_epochs(finished)
        collect_validation(me, block=False)
        validate_by_samples(me)
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
