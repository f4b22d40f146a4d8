"""A study under mpiexec: rank 0 coordinates, the other ranks form N_G groups of N_F fold
runs each (the rank layout, docs/explanation/architecture.md section 2), and every group
trains one trial at a time.

    coordinator (rank 0)                      group g (its first rank leads)
      TRIAL (number, params)  ------------->  bcast to the group; each fold run trains
      <-------------  EPOCH (number, fold, epoch, metrics)   from each fold's leader
      PRUNE number  ----------------------->  to the group's fold leaders: stop the run
      <-------------  DONE (number, outcome per fold)        from the group leader
      STOP  ------------------------------->  the study is over: the ranks return

These are small pickled messages, a few per epoch: the training itself moves its
weights and gradients as buffers inside each fold run, as any run does. A fold leader
reports its epochs and reads prune requests from its metric log's flushes (a RecordSink),
so the training loops carry no study code. Every wait polls (waiting.py), so a signal
always gets through, and has a deadline (STUDY_WAIT).

A trial that fails on one rank (its code, its data) is that trial's failure: the fold's
other ranks hear of it over their run's control channel, and the study goes on. A rank
that dies (MPI's fault tolerance reports it) takes its group's collectives down: the
coordinator names it, tells the other groups to stop and ends the study with one error;
`--resume-study` continues it.
"""

from __future__ import annotations

import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from nbdist.hpo.runner import EpochReport, FoldOutcome, TrialExecutor, TrialFinished
from nbdist.hpo.trial import Trial
from nbdist.layout import Communicators, Layout
from nbdist.options import StudyOptions, TrainOptions
from nbdist.roles.fold import train_fold
from nbdist.train.definition import ModelDefinition
from nbdist.train.stopping import StopFlag
from nbdist.transport.collectives import Collectives
from nbdist.transport.faults import RankLost
from nbdist.transport.study_channel import (
    TAG_DONE,
    TAG_EPOCH,
    TAG_PRUNE,
    TAG_TRIAL,
    CoordinatorChannel,
    GroupChannel,
    RanksFailed,
)
from nbdist.transport.waiting import CommFailure

__all__ = ["MPIGroups", "serve_group"]

# How long a group waits for the coordinator's next message, and its ranks for each other
# between trials (the coordinator's searcher may take a while; a frozen one must not).
STUDY_WAIT = 600.0


class MPIGroups(TrialExecutor):
    """The coordinator's view of the groups: who leads each, what each is training."""

    def __init__(self, world: Any, layout: Layout):
        self.channel = CoordinatorChannel(world)
        self.groups = layout.groups
        self.leaders = [layout.fold_ranks(g, 0)[0] for g in range(layout.groups)]
        self.fold_leaders = [[layout.fold_ranks(g, f)[0] for f in range(layout.folds)] for g in range(layout.groups)]
        self.running: dict[int, int] = {}  # group -> trial number
        self._group_ranks = [
            {r for f in range(layout.folds) for r in layout.fold_ranks(g, f)} for g in range(layout.groups)
        ]

    def start(self, group: int, trial: Trial) -> None:
        self.running[group] = trial.number
        self.channel.send(("trial", trial.number, trial.params), self.leaders[group], TAG_TRIAL)

    def prune(self, group: int) -> None:
        number = self.running.get(group)
        for rank in self.fold_leaders[group]:
            self.channel.send(number, rank, TAG_PRUNE)

    def poll(self, timeout: float) -> list[EpochReport | TrialFinished]:
        deadline = time.monotonic() + timeout
        events: list[EpochReport | TrialFinished] = []
        while True:
            while (received := self._next()) is not None:
                tag, message = received
                if tag == TAG_EPOCH:
                    events.append(EpochReport(*message))
                elif tag == TAG_DONE:
                    number, folds = message
                    self.running = {g: n for g, n in self.running.items() if n != number}
                    events.append(TrialFinished(number, folds))
            if events or time.monotonic() > deadline:
                return events
            time.sleep(0.005)

    def _next(self) -> tuple[int, Any] | None:
        """(tag, message) of a message that is in, or None; a rank that died ends the study:
        its group cannot finish its trial."""
        try:
            return self.channel.next_message()
        except RanksFailed as failure:
            dead = failure.ranks
            groups = sorted({g for g, ranks in enumerate(self._group_ranks) for r in dead if r in ranks})
            if not groups:
                return None
            self.running = {g: n for g, n in self.running.items() if g not in groups}
            self.close()
            raise RankLost(
                f"rank{'s' if len(dead) > 1 else ''} {', '.join(map(str, dead))} of group "
                f"{', '.join(map(str, groups))} died: the study cannot go on; continue it with "
                f"--resume-study",
                ranks=dead,
            ) from None

    def close(self) -> None:
        for leader in self.leaders:
            self.channel.send_if_alive(("stop",), leader, TAG_TRIAL)  # that group's leader may be gone
        self.channel.flush(STUDY_WAIT)


class _Reporter:
    """A fold leader's metric sink during a trial: its epochs to the coordinator, and
    the coordinator's prune request into the run's stop flag."""

    def __init__(self, channel: GroupChannel, number: int, fold: int, stop: StopFlag):
        self.channel, self.number, self.fold, self.stop = channel, number, fold, stop

    def __call__(self, batch: list[dict[str, Any]]) -> None:
        for record in batch:
            if record["kind"] == "epoch":
                report = (self.number, self.fold, record["epoch"], record["values"])
                self.channel.report(report, TAG_EPOCH)
        if self.number in self.channel.pending(TAG_PRUNE):
            self.stop.request("pruned: worse than the median of earlier trials")

    def finish(self) -> None:
        self.channel.flush(STUDY_WAIT)


def _receive(channel: GroupChannel, tag: int) -> Any:
    """A pickled message from the coordinator, waited for without blocking inside MPI."""
    try:
        return channel.receive(tag, STUDY_WAIT)
    except CommFailure:
        raise RankLost(
            "the study's coordinator (rank 0) died: the study cannot go on; continue it with --resume-study", ranks=[0]
        ) from None


def serve_group(
    world: Any,
    comms: Communicators,
    layout: Layout,
    study: str,
    options: StudyOptions,
    train: TrainOptions,
    definition: ModelDefinition | Callable[[], ModelDefinition],
    stop: StopFlag,
) -> None:
    """A non-coordinator rank: train the trials the coordinator hands this rank's group,
    until it says stop. Collective over the group."""
    role = comms.role
    group, (_, fold) = comms.group, role.run
    fold_leader = comms.run.Get_rank() == 0
    collectives = Collectives(lambda: STUDY_WAIT)
    channel = GroupChannel(world)
    while True:
        message = _receive(channel, TAG_TRIAL) if group.Get_rank() == 0 else None
        message = collectives.allgather(group, message, "the study's next trial")[0]
        if message[0] == "stop":
            return
        _, number, params = message
        trial_stop = StopFlag()
        if stop.requested:
            trial_stop.request(stop.reason)
        reporter = _Reporter(channel, number, fold, trial_stop) if fold_leader else None
        _forward(stop, trial_stop)
        try:
            outcome = train_fold(
                study, number, params, train, options, definition, comms.run, fold, trial_stop, sink=reporter
            )
        except Exception as exc:  # this rank's own failure: the fold's others were told (control channel)
            sys.stderr.write(f"nbdist: rank {role.rank} failed in trial {number}:\n{traceback.format_exc()}")
            sys.stderr.flush()
            outcome = FoldOutcome(error=f"rank {role.rank} failed: {type(exc).__name__}: {exc}")
        finally:
            _forward(stop, None)
        if reporter is not None:
            reporter.finish()
        row = [
            fold,
            fold_leader,
            {
                "final": outcome.final,
                "stop_reason": outcome.stop_reason,
                "run_id": outcome.run_id,
                "error": outcome.error,
                "ends_study": outcome.ends_study,
            },
        ]
        outcomes = collectives.allgather(group, row, f"the end of trial {number}")
        if group.Get_rank() == 0:
            folds = _merge([(f, leader, FoldOutcome(**values)) for f, leader, values in outcomes], layout.folds)
            channel.send((number, folds), TAG_DONE, STUDY_WAIT)


def _merge(outcomes: list[tuple[int, bool, FoldOutcome]], folds: int) -> dict[int, FoldOutcome]:
    """One outcome per fold: its leader's result, with the first error any of its ranks saw."""
    merged = {f: FoldOutcome() for f in range(folds)}
    for fold, leader, outcome in outcomes:
        if leader:
            error = merged[fold].error
            merged[fold] = outcome
            merged[fold].error = error or outcome.error
        elif outcome.error and not merged[fold].error:
            merged[fold].error = outcome.error
    return merged


_forwarded: list[StopFlag | None] = [None]


def _forward(study_stop: StopFlag, trial_stop: StopFlag | None) -> None:
    """While a trial trains, the study's stop signal (SIGUSR1/SIGTERM) stops it too."""
    _forwarded[0] = trial_stop

    def handler(signum: int, _frame: object) -> None:
        reason = f"stopped by {signal.Signals(signum).name}"
        study_stop.request(reason)
        if _forwarded[0] is not None:
            _forwarded[0].request(reason)

    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, handler)
