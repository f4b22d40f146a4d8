"""Tallies, validation and checkpoints: the epochs' train sums, their ends, what is
validated and reported, and which checkpoints every client has written."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from nbdist.backends.base import BatchStats
from nbdist.errors import TrainingError
from nbdist.roles.master.clients import SUB_MASTER, WORKER
from nbdist.train.lr import lr_metrics
from nbdist.train.progress import EpochTally, epoch_metrics, format_epoch
from nbdist.train.stopping import VALIDATED_WITH
from nbdist.transport import messages as m

if TYPE_CHECKING:
    from nbdist.roles.master.state import Master

__all__ = [
    "tally_message",
    "tally_of",
    "note_checkpoint_ack",
    "open_tallies",
    "restore_tallies",
    "collect_validation",
    "validate_by_samples",
    "finish_epoch",
    "average_state",
    "commit_ready_checkpoints",
    "finish_checkpoints",
]


def tally_of(me: Master, epoch: int) -> EpochTally:
    """Where what a client did in `epoch` is counted: that epoch's tally, or, when the
    epoch ended without the client (it was late, see Master._late), the epoch open now;
    a closed epoch's tally is never reported again."""
    return me.tallies.setdefault(max(epoch, me.next_epoch), EpochTally())


def tally_message(me: Master, i: int, msg: m.Message) -> None:
    epoch = int(msg.header[m.EPOCH])
    # A sub-master's SAMPLES are its epoch's tally, sent when the epoch ends; what a push
    # merges into the centre comes in MERGED_SAMPLES.
    me.samples_seen += int(msg.header[m.MERGED_SAMPLES if me.clients[i].kind == SUB_MASTER else m.SAMPLES])
    samples = int(msg.header[m.SAMPLES])
    tally = tally_of(me, epoch)
    if epoch < me.next_epoch:  # the share of an epoch that ended without this client
        tally.late += samples
    tally.train.add(BatchStats(msg.header[m.LOSS_SUM], msg.header[m.METRIC_SUM], samples))
    if msg.has(m.EPOCH_END):
        me.reached[i] = max(me.reached[i], epoch + 1)
        me.whole_epoch_began[i], me.epoch_began[i] = me.epoch_began[i], time.monotonic()
        if epoch >= me.next_epoch:
            tally.ended.add(i)


def note_checkpoint_ack(me: Master, i: int, msg: m.Message) -> None:
    code = msg.header[m.CHECKPOINT]
    if code != m.NO_CHECKPOINT:
        me.acks.setdefault(m.label_of(code), set()).add(i)
    # Cumulative acks (synchronous workers and sub-masters): every due epoch checkpoint up to `upto`.
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


def collect_validation(me: Master, block: bool) -> None:
    t0 = time.perf_counter()
    done = me.validator.poll(block)
    if block:
        me.phases["validate"] += time.perf_counter() - t0
    if done is not None:
        (group, seen), val = done
        validated = group[-1][0]  # the epochs that ended with it share its validation (Master.end_epochs)
        for epoch, tally, seconds, due in group:
            with_epoch = validated if epoch != validated else None
            finish_epoch(me, epoch, tally, seconds, val if due else None, seen, validated_with=with_epoch)
        me.flush_saves()  # the shares that waited for these epochs' place in the history


def validate_by_samples(me: Master) -> None:
    """--validate-every-samples: record the validation that finished, start the next one
    when a mark has passed. In the background, like an epoch's: workers are served meanwhile."""
    sampled = me.sampled
    if sampled is None:
        return
    sampled.collect(me.ctx.log)
    if sampled.due(me.samples_seen) and not me.stopping:
        average_state(me)
        sampled.start(me.ctx.backend.params, me.ctx.backend.state, me.samples_seen, me.version, me.next_epoch)


def finish_epoch(
    me: Master, epoch: int, tally: EpochTally, seconds: float, val, seen: int, validated_with: int | None = None
) -> None:
    """`seen`: the samples in the centre that was validated (at the epoch's end if it was not).
    `validated_with`: the later epoch that ended on the same centre, whose record holds
    (and whose decisions count) the one validation `val` of them both."""
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
    # Ended without a late client (Master._late), the samples missing are pending: they
    # are counted when they come (`samples_late` of a later epoch), or lost with it.
    if tally.late:
        metrics["samples_late"] = int(tally.late)
    if tally.behind:
        metrics["workers_behind"] = int(tally.behind)
    lost = ctx.data.n_train - (tally.train.n - tally.late)
    if lost > 0 and not ctx.role.is_sub_master:
        metrics["samples_pending" if tally.behind else "samples_lost"] = int(lost)
    if validated_with is not None and val is not None:
        metrics[VALIDATED_WITH] = validated_with + 1
    me.history.append(metrics)
    ctx.log.emit("epoch", metrics, step=me.version, epoch=epoch + 1)
    ctx.say(format_epoch(metrics, ctx.options.epochs))
    ctx.watch_loss(metrics)
    ctx.watch_checkpoints(metrics, me.writer)
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


def finish_checkpoints(me: Master) -> None:
    """At the end of a run: wait for this rank's writes, commit what is complete, wait for
    the commits (the run's last checkpoint must be in place before its final files)."""
    me.master_wrote.update(me.writer.finish())
    commit_ready_checkpoints(me)
    me.writer.finish()


def commit_ready_checkpoints(me: Master) -> None:
    """Commit what every client still expected has written; the snapshot in progress
    ends with its commit (and the next due one starts)."""
    me.master_wrote.update(me.writer.written())
    needed = set(range(len(me.clients))) - me.failed - set(me.dropped)
    for label in sorted(me.master_wrote):
        have = me.acks.get(label, set())
        if label == me.snapshot:
            # A worker that finished before it was told has no update left to hold back
            # (its share is its last one); nor is a snapshot held up by a worker still in an
            # epoch that ended without it, told or not: without its share, a resume starts
            # it from the centre, as a dropped one (and its share, if it comes, is the state
            # before an update the centre does not hold). A worker frozen between the
            # SNAPSHOT reply and its acknowledgement held every checkpoint up until the peer
            # timeout dropped it. A sub-master holds its workers' updates since its last
            # push: it always acknowledges its share (hierarchy.py, SubMaster.save_last_epoch).
            finished_workers = {i for i in me.finished - me.snapshot_told if me.clients[i].kind == WORKER}
            have = have | finished_workers | me.behind()
        if needed <= have:
            me.commit(label)
            me.master_wrote.discard(label)
            me.acks.pop(label, None)
            if label == me.snapshot:
                me.snapshot = ""
                due, me.snapshot_due = me.snapshot_due, ""
                if due:
                    me.take_snapshot(due)
