"""A master's serving state, and the decisions where a sub-master (roles/hierarchy.py) differs
from the top (or only) master: stops, epochs' ends, checkpoints, lost clients."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nbdist.metrics.updates import UpdateSummary
from nbdist.roles.master.clients import WORKER
from nbdist.roles.master.epochs import (
    average_state,
    collect_validation,
    finish_checkpoints,
    finish_epoch,
    open_tallies,
)
from nbdist.roles.master.windows import WorkerWindows
from nbdist.roles.membership import EpochMembers
from nbdist.train.context import RankContext
from nbdist.train.progress import EpochTally, validation_due
from nbdist.train.state import rank_state_arrays, write_rank_state
from nbdist.train.validation import BackgroundValidator, SampledValidation
from nbdist.train.writer import CheckpointWriter
from nbdist.transport import messages as m
from nbdist.transport.faults import RankLost, RankSilent, kill_frozen
from nbdist.transport.master_channel import MasterChannel
from nbdist.transport.pool import BodyPool

__all__ = ["Master"]


@dataclass
class Master:
    """A master's serving state. Its methods are where a sub-master (hierarchy.SubMaster)
    behaves differently from the top (or only) master."""

    ctx: RankContext
    clients: list = field(default_factory=list)  # [Client]
    # Set by open_master (master/run.py) before the master serves: the backend's flat
    # parameters, one posted header receive per client, the bodies' buffers, each
    # client's latest model state, the epochs' members, the background validation.
    centre: np.ndarray = field(init=False, repr=False)
    channel: MasterChannel = field(init=False, repr=False)
    pool: BodyPool = field(init=False, repr=False)
    states: np.ndarray = field(init=False, repr=False)
    members: EpochMembers = field(init=False, repr=False)
    validator: BackgroundValidator = field(init=False, repr=False)
    rule_state: Any = None
    opt: Any = None
    lr: Any = None  # sets opt's lr per update (train/lr.py MasterLr)
    round_buffer: np.ndarray | None = None  # a synchronous round's mean (or EASGD's reply), master_round's `out`
    waiting: list = field(default_factory=list)  # clients whose header is in, served at the next pass
    active: set = field(default_factory=set)  # clients still training: not DONE, failed or dropped
    dropped: dict = field(default_factory=dict)  # client -> why the run went on without it
    finished: set = field(default_factory=set)  # clients that said DONE
    acked_upto: list = field(default_factory=list)  # per client, see m.EPOCHS_ACKED
    reached: list = field(default_factory=list)  # per client, the epoch it is in (those before it ended)
    epoch_began: list = field(default_factory=list)  # per client, when it began that epoch (monotonic)
    whole_epoch_began: list = field(default_factory=list)  # ... and the last epoch it ended (None: none yet)
    reply_headers: list = field(default_factory=list)  # one per client: a reply in flight keeps its own
    replying: dict = field(default_factory=dict)  # client -> _Reply still in flight
    silence_checked: float = 0.0  # when the clients' silence was last looked at
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
    master_wrote: set = field(default_factory=set)  # labels whose share this rank has written (fsynced)
    writer: CheckpointWriter = field(default_factory=CheckpointWriter)  # its shares and commits, off the loop
    unwritten: list = field(default_factory=list)  # (label, arrays, scalars) taken, awaiting a validation
    # Epochs closed in this loop turn before the one whose validation they share (end_epochs):
    # (epoch, tally, seconds, due), recorded when that validation is in.
    sharing: list = field(default_factory=list)
    failed: set = field(default_factory=set)
    epoch_clock: float = field(default_factory=time.time)  # when the previous epoch ended
    # Training samples in the centre: those of every update applied, over all clients.
    samples_seen: int = 0
    sampled: SampledValidation | None = None  # --validate-every-samples, at the top (or only) master
    phases: dict = field(default_factory=lambda: {"wait": 0.0, "update": 0.0, "reply": 0.0, "validate": 0.0})
    updates: UpdateSummary = field(default_factory=UpdateSummary)  # since the last 'updates' record
    windows: WorkerWindows | None = None  # each worker's window by its speed (dynamic local steps)

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
        """The epochs every client still training has now ended: (epoch, tally, seconds).

        Epochs that end in one turn (one waited for a late worker) share the time since the
        last end equally: their samples were trained in it, and the later ones' own few
        microseconds gave rates of millions of samples a second."""
        ended = []
        while self.next_epoch in self.tallies and self._epoch_complete(self.next_epoch):
            epoch = self.next_epoch
            ended.append((epoch, self.tallies.pop(epoch)))
            self.next_epoch += 1
            self.tallies.setdefault(self.next_epoch, EpochTally())
        if not ended:
            return []
        now = time.time()
        seconds, self.epoch_clock = (now - self.epoch_clock) / len(ended), now
        self.members.forget_before(self.next_epoch)
        return [(epoch, tally, seconds) for epoch, tally in ended]

    def _epoch_complete(self, epoch: int) -> bool:
        """Every client expected has ended `epoch`; or, asynchronous, those that have not
        are late (`_late`): the run does not wait for them, their share is counted when it
        comes (tally_message), and the peer timeout only decides when a silent one is
        dropped. Sets the tally's `behind`. The run's last epoch waits for every client
        still in the run (the peer timeout drops a silent one): no later epoch would count
        a late share, which the master still applies before its clients are done."""
        expected = self.expected_in(epoch)
        if not expected:
            return False
        tally = self.tallies[epoch]
        behind = expected - tally.ended
        if not behind:
            return True
        last = epoch >= self.ctx.options.epochs - 1
        if self.ctx.options.synchronous or last or not all(self._late(i) for i in behind):
            return False
        tally.behind = len(behind)
        return True

    def _late(self, i: int) -> bool:
        """Whether client i, which has not ended the epoch, is too late to wait for: it sent
        nothing while another client trained a whole epoch (it is frozen, or was
        descheduled that long). A client that still sends updates is waited for, however
        far behind: its share belongs to the epoch, and asynchronous workers of one speed
        drift apart by several epochs by chance on a busy node (the others never wait)."""
        gone = set(self.dropped) | self.failed
        heard = self.clients[i].silence.last
        return any(
            began is not None and began > heard
            for j, began in enumerate(self.whole_epoch_began)
            if j != i and j not in gone
        )

    def behind(self) -> set[int]:
        """The workers still training that have not ended the last epoch that ended."""
        return {
            i
            for i in self.active
            if self.clients[i].kind == WORKER and i < len(self.reached) and self.reached[i] < self.next_epoch
        }

    def expected_in(self, epoch: int) -> set[int]:
        """The clients whose end of `epoch` the master waits for: the workers that share
        its data and the sub-masters, less those dropped or failed since."""
        gone = set(self.dropped) | self.failed
        workers = set(self.members.of(epoch, self.live_workers()))
        others = {i for i, c in enumerate(self.clients) if c.kind != WORKER}
        return (workers | others) - gone

    def live_workers(self) -> set[int]:
        return {
            i for i, c in enumerate(self.clients) if c.kind == WORKER and i not in self.dropped and i not in self.failed
        }

    def before_replies(self, applied: int, finished: list) -> None:
        """Between applying a round's updates and answering them (a sub-master talks to
        the top master here, so that its workers get the merged centre)."""

    def end_epochs(self, finished: list[tuple[int, EpochTally, float]]) -> None:
        """The epochs that ended in this loop turn (pop_finished_epochs), in order.

        Asynchronous, several can end in one turn: an epoch that waits for a worker ends
        when that worker turns out late (`_late`), which may be only once another worker
        has ended the next epoch too. They all end on one centre, which one validation
        measures: it is recorded in each of their records (the earlier ones say so in
        `validated_with_epoch`), and early stopping's patience counts it once. Validated
        once per epoch instead, the same weights gave the same value twice, and patience
        counted a validation without a single update between as one that did not improve."""
        due = [epoch for epoch, _, _ in finished if validation_due(self.ctx.options, epoch)]
        last = due[-1] if due and not self.ctx.options.synchronous else -1
        for epoch, tally, seconds in finished:
            self.end_epoch(epoch, tally, seconds, validated_later=epoch < last)

    def end_epoch(self, epoch: int, tally: EpochTally, seconds: float, validated_later: bool = False) -> None:
        """Every client has ended `epoch`: validate, report, decide, checkpoint.
        `validated_later`: a later epoch that ended in the same turn is validated, and
        this one's record waits for that validation (end_epochs)."""
        ctx = self.ctx
        label = m.label_of(epoch + 1) if ctx.checkpoint_due(epoch + 1) else None
        due = validation_due(self.ctx.options, epoch)
        if validated_later:
            collect_validation(self, block=True)  # the epochs enter the history in order
            self.sharing.append((epoch, tally, seconds, due))
        elif not due:
            collect_validation(self, block=True)  # the epochs enter the history in order
            finish_epoch(self, epoch, tally, seconds, None, self.samples_seen)
        elif ctx.options.synchronous:
            # Inline, after this round's replies went out: the workers compute meanwhile, and
            # the stop decision falls at the same step in every run (exact resume).
            t0 = time.perf_counter()
            average_state(self)
            val = ctx.backend.evaluate(*ctx.data.val_arrays())
            self.phases["validate"] += time.perf_counter() - t0
            finish_epoch(self, epoch, tally, seconds, val, self.samples_seen)
        else:
            collect_validation(self, block=True)  # one at a time, in epoch order
            average_state(self)
            group, self.sharing = [*self.sharing, (epoch, tally, seconds, True)], []
            self.validator.start(ctx.backend.params, ctx.backend.state, (group, self.samples_seen))
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

    def save_last_epoch(self) -> None:
        """At the end of an asynchronous run that trained all its epochs: make its last
        epoch's checkpoint the run's latest, whatever snapshot was in progress.

        Every worker wrote its share of it at its end and acknowledged it in its DONE; the
        centre now holds every update. A snapshot in progress may never complete: a
        worker's message carries one acknowledgement, the newest, so a worker that wrote
        a snapshot's share and then its last one acknowledges only the last (and without
        this, the run ended with a checkpoint epochs older than its last)."""
        if self.next_epoch == 0:
            return
        label = m.label_of(self.next_epoch)
        finish_checkpoints(self)  # what is complete is committed first
        latest = self.ctx.checkpoints.latest()
        if self.snapshot == label or (latest is not None and latest.name == label):
            return
        self.snapshot, self.snapshot_told, self.snapshot_due = label, set(), ""
        self.save(label)

    def save(self, label: str) -> None:
        """Write this rank's share of checkpoint `label` (on the writer's thread), as it is now.

        An asynchronous epoch enters the history when its background validation ends, and
        a snapshot written before then would resume past an epoch its history lacks. So the
        share is taken now and written, with the history and the early-stopping state, once
        that validation is in (flush_saves): the workers are served meanwhile, instead of
        all waiting on the master's validation at every checkpointed epoch."""
        average_state(self)
        now = {
            "version": self.version,
            "next_epoch": self.next_epoch,
            "samples_seen": self.samples_seen,
            "members": self.members.to_json(),
            "lr": self.lr.to_json(),
            **self.speeds_to_save(),
            **open_tallies(self, label),
        }
        self.unwritten.append((label, rank_state_arrays(self.ctx, self.opt, self.rule_state), now))
        self.flush_saves()

    def speeds_to_save(self) -> dict[str, Any]:
        """Dynamic local steps: the workers' measured speeds, for this rank's checkpoint share."""
        return {"speeds": self.windows.to_json()} if self.windows is not None else {}

    def load_speeds(self, extra: dict[str, Any]) -> None:
        """The speeds a checkpoint share holds (master/windows.py), on the same layout."""
        if self.windows is not None:
            self.windows.load_json(extra.get("speeds"))

    def flush_saves(self) -> None:
        """Hand the shares taken by `save` to the writer once no validation is running
        (nor an epoch waits for one: end_epochs)."""
        if self.validator.busy or self.sharing:
            return
        ctx = self.ctx
        for label, arrays, now in self.unwritten:
            extra = {**now, "early": ctx.early.to_json(), **ctx.history_file.checkpoint(self.history, self.writer)}
            write_rank_state(ctx, label, arrays, extra, writer=self.writer)
        self.unwritten.clear()

    def commit(self, label: str) -> None:
        """Every client and this rank wrote `label`: make it the run's latest checkpoint."""
        ctx = self.ctx
        meta = {
            "label": label,
            "layout": ctx.layout.to_dict(),
            "options": ctx.options.to_dict(),
            "version": self.version,
            "finished": sorted(self.clients[i].world_rank for i in self.finished),
            "world_ranks": ctx.world_ranks,
            "time": time.time(),
        }
        self.writer.submit(lambda: ctx.checkpoints.commit(label, meta))

    def lose(self, i: int, cause: str, gone: bool) -> None:
        """Client i died (`gone`) or froze. Asynchronous workers are dropped and the run goes
        on; otherwise the run cannot go on and this raises RunFailure."""
        client, ctx = self.clients[i], self.ctx
        what = f"{client.describe(ctx)} {cause}"
        info = ctx.peers.directory.infos.get(client.world_rank)
        if ctx.options.synchronous or client.kind != WORKER:
            if not gone and info is not None:
                gone = kill_frozen(info)  # the survivors can restart without it only once it is gone
            why = (
                "a synchronous round needs every worker"
                if client.kind == WORKER
                else "its workers' updates can no longer reach the centre"
            )
            failure = RankLost if cause == "died" else RankSilent
            raise failure(f"{what}: the run cannot go on ({why})", ranks=[client.world_rank], restartable=gone)
        # A frozen worker is left as it is: if it wakes up, its next update is answered
        # DROPPED and it leaves (the run's end removes it if it never does).
        self.dropped[i] = cause
        self.active.discard(i)
        self.snapshot_told.discard(i)
        if gone:
            self.channel.forget(i)
        left = len(self.live_workers())
        if left == 0:
            raise RankLost(
                f"{what}, and it was the last worker: the run cannot go on", ranks=[client.world_rank], restartable=gone
            )
        ctx.log.emit(
            "fault",
            {
                "rank": client.world_rank,
                "role": client.kind,
                "worker": client.index,
                "cause": cause,
                "workers_left": left,
                "host": info.host if info else "",
            },
            step=self.version,
            epoch=self.next_epoch,
        )
        ctx.warn(
            f"nbdist: {what}; the run goes on with {left} worker{'s' if left != 1 else ''}, "
            f"which share its data from the next epoch"
        )
