"""Sub-masters under a top master (`--masters N_M > 1`): workers in groups.

With one master, every worker's every update crosses the same rank. With N_M masters the
top master serves its own N_W workers plus N_M - 1 sub-masters, and each sub-master
serves N_W workers: the communication load is spread, at the cost of some staleness.

A sub-master is an ordinary master for its workers (the serving loop of roles/master/, the
algorithm's `master_apply`, or `master_round` for a synchronous round, and master
optimiser on its OWN copy of the centre) and is
itself a client of the top master on the `masters` communicator (top master = rank 0).
After each round's worth of updates (N_W when asynchronous, every round when
synchronous), at the end of every epoch of its workers, and to pass on a stop request or
an error, it pushes the top master its displacement since it last pulled,

    delta = local centre - centre at the last pull,

waits for the reply (the top centre) and continues from it. The push comes before the
round's replies, so its workers continue from the merged centre. The top master merges
the masters' steps with the rule's `merge_master_steps` (algorithms/base.py), with each
push's staleness counted in top versions. Asynchronous, a delta is added as it is
(whatever the rule: the sub-master already applied the rule to its workers' updates).
Synchronous, the top's round waits for its own workers and every sub-master, so nothing
is stale, and every master's step starts from the same centre: the round moves the
centre by their mean, weighted by the workers behind each (equal masters, equal
weights), the top master's own step (its rule on its own workers) being one of them.
As every master averages its own workers' updates, that is one master averaging all
the workers' (GEM, ADAG, DynSGD; Downpour with a plain sgd master, and with momentum
each master keeps its own velocity). EASGD's steps are summed instead: its elastic force
is bound to every worker of the run (train/settle.py), so each master's step is its
workers' share of one elastic round, and the sum is exactly one master serving them all.

Message, as a worker's: [header | delta | model state] (the state is the mean of its
workers'), VERSION = the top version of the last pull. Its header forwards::

  EPOCH_END    with the epoch's train sums of its workers (other pushes carry 0 samples),
               so the top master's epoch ends when its workers and every sub-master ended it;
  STOP_REQUEST a signal or a worker's request: only the top master decides a stop;
  ERROR + text a worker failed; the top master replies STOP (and later raises one
               error naming the worker), the sub-master stops its other workers;
  DONE         once all its workers are DONE (after an ERROR too, so that the top master
               leaves only when no rank of the run still writes into its directory);
  EPOCHS_ACKED synchronous: every epoch checkpoint up to there is complete below it (its
               workers' files and its own), cumulative because several can complete
               between two pushes; CHECKPOINT in DONE acknowledges the stop checkpoint;
  CHECKPOINT   asynchronous: the snapshot the top master asked for is complete below it.

Asynchronous snapshots go down the tree: the top master answers a sub-master's push with
SNAPSHOT instead of taking it; the sub-master saves its share (its centre still holds the
delta the top did not take, so a resume pushes it again), then takes the same snapshot of
its own workers, and acknowledges it in a later push once they all saved theirs.

A worker under a sub-master that dies or freezes in an asynchronous run is dropped by the
sub-master, as by any master; a sub-master that dies or freezes ends the run (its workers'
updates can no longer reach the centre).

A STOP reply carries the top master's stop label: the sub-master answers STOP with that
label to its workers as they report, waits until they are all DONE, writes its own share
of the stop checkpoint and says DONE. The delta of the push that got STOP was dropped by
the top master but stays in the sub-master's centre, and that round's workers get
CONTINUE (their updates are in it): its checkpoint (centre and pulled copy) still holds
them and a resume pushes them again. Only the top master validates, prints, decides
stops and commits checkpoints.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from nbdist.algorithms.arrays import copy_into
from nbdist.backends.base import BatchStats
from nbdist.roles.master import (
    SUB_MASTER,
    Client,
    Master,
    average_state,
    finish_checkpoints,
    open_master,
    open_tallies,
    restore_tallies,
    serve_and_settle,
    settle_centre,
    share_initial_weights,
    worker_clients,
)
from nbdist.train.checkpoint import Checkpoints
from nbdist.train.context import RankContext
from nbdist.train.progress import EpochTally
from nbdist.train.relayout import centre_share
from nbdist.train.state import load_rank_state, save_rank_state
from nbdist.transport import messages as m
from nbdist.transport.deadlines import Silence
from nbdist.transport.worker_channel import WorkerChannel

__all__ = ["SubMaster", "run_sub_master", "sub_master_clients"]


def sub_master_clients(ctx: RankContext) -> list[Client]:
    """The top master's clients on the `masters` communicator, sub-master j = peer j."""
    layout, role = ctx.layout, ctx.role
    masters = [r for r in layout.fold_ranks(*role.run) if layout.role(r).kind == "master"]
    return [
        Client(
            ctx.comms.masters,
            j,
            SUB_MASTER,
            rank,
            merge=ctx.rule.merge_master_steps,
            weight=layout.workers,
            silence=Silence(ctx.options.peer_timeout),
        )
        for j, rank in enumerate(masters)
        if j > 0
    ]


@dataclass
class SubMaster(Master):
    """A master of its own workers that asks the top master instead of deciding (stops),
    pushes instead of validating (epochs) and acknowledges instead of committing."""

    # Set by run_sub_master before it serves: to the top master, on the `masters`
    # communicator; the top centre at the last pull; the top master's reply (a STOP reply
    # is no pull); the push it sends.
    uplink: WorkerChannel = field(init=False, repr=False)
    pulled: np.ndarray = field(init=False, repr=False)
    incoming: np.ndarray = field(init=False, repr=False)
    out: m.Message = field(init=False, repr=False)
    pulled_version: int = 0  # the top master's version of `pulled`
    unpushed: int = 0  # updates applied since the last push
    samples_pushed: int = 0  # samples_seen at the last push the top master took
    stop_wanted: str = ""
    error_sent: bool = False
    epochs_acked: int = 0
    stop_acked: bool = False
    snapshot_ack: float = m.NO_CHECKPOINT  # the top's snapshot, complete below: acknowledged at the next push
    top_reply: np.ndarray = field(default_factory=m.new_header)

    def request_stop(self, reason: str) -> None:
        # Only the top master decides: ask it at the next push (made at once, see below).
        if not self.stopping and not self.stop_wanted:
            self.stop_wanted = reason

    def pop_finished_epochs(self) -> list[tuple[int, EpochTally, float]]:
        # Once told STOP, nothing goes up but DONE: the epochs still open stay open, so
        # that the stop checkpoint holds their tallies and a resume forwards them (the
        # workers that ended them will not end them again).
        return [] if self.stopping else super().pop_finished_epochs()

    def before_replies(self, applied: int, finished: list) -> None:
        if self.error and not self.error_sent:  # even while stopping: the run must fail
            self.error_sent = True
            self._push(m.ERROR)
        if self.stopping:
            self._reopen(finished)
            return
        self.unpushed += applied
        every = 1 if self.ctx.options.synchronous else self.ctx.layout.workers
        pushes = [(m.EPOCH_END, epoch, tally) for epoch, tally, _ in finished]
        if not pushes and (self.unpushed >= every or self.stop_wanted):
            pushes = [(0, self.next_epoch, None)]
        for k, (flags, epoch, tally) in enumerate(pushes):
            if self._push(m.UPDATE, flags, epoch, tally) in (m.STOP, m.SNAPSHOT):
                # The top master did not take this push (and, told STOP, takes no more).
                self._reopen(finished[k:] if flags else finished)
                return

    def _reopen(self, finished: list) -> None:
        """Give back epochs popped but not taken by the top master (see pop_finished_epochs)."""
        for epoch, tally, _ in finished:
            self.tallies[epoch] = tally
            self.next_epoch = min(self.next_epoch, epoch)

    def end_epoch(self, epoch: int, tally: EpochTally, seconds: float, validated_later: bool = False) -> None:
        if epoch >= self.next_epoch:  # reopened: the top master never took it
            return
        # Its tally went up with the push; validating and reporting are the top master's.
        # Written after that push, so the checkpoint holds the merged centre (exact resume).
        # Asynchronous checkpoints are the top master's snapshots (see _push).
        if self.ctx.checkpoint_due(epoch + 1) and self.ctx.options.synchronous:
            self.save(m.label_of(epoch + 1))

    def take_snapshot(self, label: str) -> None:
        """Only the top master decides snapshots; a sub-master passes them down (_push)."""

    def save_last_epoch(self) -> None:
        # Its share of the run's last checkpoint (the top master's save_last_epoch), which
        # it acknowledges in its DONE as a snapshot's (commit, send_done): the top master
        # cannot commit that checkpoint without it.
        if self.next_epoch == 0:
            return
        label = m.label_of(self.next_epoch)
        self.snapshot, self.snapshot_told, self.snapshot_due = label, set(), ""
        self.save(label)

    def save(self, label: str) -> None:
        average_state(self)
        extra = {
            "version": self.version,
            "next_epoch": self.next_epoch,
            "pulled_version": self.pulled_version,
            "unpushed_samples": self.samples_seen - self.samples_pushed,
            "members": self.members.to_json(),
            "lr": self.lr.to_json(),
            **self.speeds_to_save(),
            **open_tallies(self, label),
        }
        save_rank_state(self.ctx, label, self.opt, self.rule_state, extra, {"pulled": self.pulled}, writer=self.writer)

    def commit(self, label: str) -> None:
        # Complete below this rank: acknowledge it to the top master, which commits.
        if label == self.stop_label:
            self.stop_acked = True
        elif label == self.snapshot:
            self.snapshot_ack = m.label_code(label)
        else:
            self.epochs_acked = max(self.epochs_acked, int(m.label_code(label)))

    def _push(self, kind: float, flags: int = 0, epoch: int = 0, tally: EpochTally | None = None) -> float:
        """Send [header | centre - pulled | state] up, wait for the reply and continue from
        the top centre (CONTINUE) or begin this block's stop (STOP). Returns the reply kind."""
        t0 = time.perf_counter()
        out = self.out
        train = tally.train if tally is not None else BatchStats()
        self._fill_header(kind, flags | (m.STOP_REQUEST if self.stop_wanted else 0), epoch, train)
        np.subtract(self.centre, self.pulled, out=out.payload)
        average_state(self)
        out.state[:] = self.ctx.backend.state
        self.uplink.expect_reply()
        self.uplink.send(out)
        self.snapshot_ack = m.NO_CHECKPOINT  # delivered
        if kind == m.ERROR:
            self.uplink.send_text(self.error)
        self.uplink.await_reply()
        self.phases["uplink"] += time.perf_counter() - t0
        if self.top_reply[m.KIND] == m.STOP:
            self.stopping = "stopped by the top master"
            self.stop_label = m.label_of(self.top_reply[m.CHECKPOINT])
            return m.STOP
        if self.top_reply[m.KIND] == m.SNAPSHOT:
            # The top did not take this push: its delta stays in the centre for the next.
            # This rank's share now, its workers' at their next updates (master/receive.py, read_messages).
            self.snapshot, self.snapshot_told = m.label_of(self.top_reply[m.CHECKPOINT]), set()
            self.save(self.snapshot)
            return m.SNAPSHOT
        settle_centre(self)  # its workers' replies read the centre
        self.centre[:] = self.incoming
        self.pulled[:] = self.incoming
        self.pulled_version = int(self.top_reply[m.VERSION])
        # The centre changed under the workers: what they computed before is one version staler.
        self.version += 1
        self.unpushed = 0
        self.samples_pushed = self.samples_seen
        return m.CONTINUE

    def send_done(self) -> None:
        self._fill_header(m.DONE, 0, self.next_epoch, BatchStats())
        if self.stop_acked:
            self.out.header[m.CHECKPOINT] = m.label_code(self.stop_label)
        self.uplink.send(self.out)

    def _fill_header(self, kind: float, flags: int, epoch: int, train: BatchStats) -> None:
        header = self.out.header
        header[m.KIND] = kind
        header[m.VERSION] = self.pulled_version
        header[m.EPOCH] = epoch
        header[m.SAMPLES] = train.n
        header[m.LOSS_SUM] = train.loss_sum
        header[m.METRIC_SUM] = train.metric_sum
        header[m.FLAGS] = flags
        header[m.CHECKPOINT] = self.snapshot_ack
        header[m.EPOCHS_ACKED] = self.epochs_acked
        header[m.MERGED_SAMPLES] = self.samples_seen - self.samples_pushed


def run_sub_master(ctx: RankContext) -> None:
    layout, role = ctx.layout, ctx.role
    top_rank = next(
        r for r in layout.fold_ranks(*role.run) if layout.role(r).kind == "master" and layout.role(r).master == 0
    )
    me = SubMaster(ctx, top_reply=m.new_header(layout.workers))
    open_master(me, worker_clients(ctx))
    n, s = me.centre.size, ctx.backend.state.size
    me.pulled, me.incoming, me.out = np.empty(n, np.float32), np.empty(n, np.float32), m.Message(n, s)
    me.uplink = WorkerChannel(
        ctx.comms.masters,
        me.top_reply,
        me.incoming,
        Silence(ctx.options.peer_timeout),
        master="the top master",
        master_rank=top_rank,
        describe=ctx.peers.directory.describe,
    )
    me.phases["uplink"] = 0.0
    if ctx.resume_from is not None:
        _resume(me)
    else:
        share_initial_weights(ctx)
        me.pulled[:] = me.centre
    serve_and_settle(me)

    # Every worker has said DONE (or failed); as at the top master, the stop checkpoint
    # is acknowledged only when every worker stopped on the same STOP.
    if me.stopping and not me.error:
        me.save(me.stop_label)
    elif not me.error and not ctx.options.synchronous:
        me.save_last_epoch()
    finish_checkpoints(me)
    me.send_done()
    ctx.log.emit("phase", dict(me.phases), step=me.version, epoch=me.next_epoch)
    if me.error:
        ctx.log.emit("run", {"status": "failed", "error": me.error})
    else:
        status = "stopped" if me.stopping else "completed"
        ctx.log.emit("run", {"status": status, "reason": me.stopping or f"completed {ctx.options.epochs} epochs"})
    ctx.log.close()


def _resume(me: SubMaster) -> None:
    """From the checkpoint: this sub-master's own share or, on a layout whose sub-master
    the checkpoint lacks, the top master's centre (train/relayout.py). On another layout
    its epoch is the top master's (every worker starts it again) and no tally is open."""
    ctx = me.ctx
    path = ctx.resume_dir
    top = Checkpoints.read_scalars(path, centre_share(ctx.old_layout, 0)) if ctx.relayout else {}
    if ctx.resume_rank is None:
        arrays, _ = Checkpoints.read_rank(path, centre_share(ctx.old_layout, 0))
        copy_into(me.centre, arrays["model"]["params"])
        if "state" in arrays["model"]:
            copy_into(ctx.backend.state, arrays["model"]["state"])
        me.pulled[:] = me.centre
        me.version = me.pulled_version = int(top["version"])
        me.lr.load_json(top.get("lr", {}))
    else:
        extra = load_rank_state(ctx, path, me.opt, me.rule_state, {"pulled": me.pulled})
        me.version, me.next_epoch = int(extra["version"]), int(extra["next_epoch"])
        me.pulled_version = int(extra["pulled_version"])
        me.lr.load_json(extra.get("lr", {}))
        me.samples_seen = int(extra.get("unpushed_samples", 0))  # in the delta the checkpoint holds
        if not ctx.relayout:
            restore_tallies(me, extra)
            me.load_speeds(extra)
    if ctx.relayout:
        me.next_epoch = int(top["next_epoch"])
    me.epochs_acked = me.next_epoch  # the checkpoint resumed from was committed
