"""A study under mpiexec: rank 0 coordinates, the other ranks form N_G groups of N_F fold
runs each (the rank layout, docs/explanation/architecture.md section 2), and every group
trains one segment of a trial at a time.

    coordinator (rank 0)                      group g (its first rank leads)
      TRIAL (number, params, segment)  ---->  to the group; PBT's copies first (exchange.py),
                                              then each fold run trains, from its checkpoint
      <-------------  EPOCH (number, fold, epoch, metrics)   from each fold's leader, as the
                                                             epoch ends
      VERDICT (number, epoch, word)  ------>  the study's word: go on, or stop after this
                                              epoch (a gated segment waits for it)
      <-------------  DONE (number, outcome per fold)        from the group leader
      STOP  ------------------------------->  the study is over: the ranks return

These are small pickled messages, one or two per epoch: the training itself moves its
weights and gradients as buffers inside each fold run, as any run does. A fold leader
reports an epoch where its run decides on it (train/stopping.TrialStopping), so the
study's decision reaches the run right after the epoch it judged: a segment whose
scheduler decides at every epoch (a pruner) waits there for the verdict; another only
looks for a stop that came meanwhile. Every wait polls (waiting.py), so a signal always
gets through, and has a deadline (STUDY_WAIT).

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

from nbdist.hpo.executor import EpochReport, FoldOutcome, TrialExecutor, TrialFinished
from nbdist.hpo.trial import Segment, Trial
from nbdist.layout import Communicators, Layout
from nbdist.options import StudyOptions, TrainOptions
from nbdist.roles.exchange import Kept, exchange
from nbdist.roles.fold import train_fold
from nbdist.train.definition import ModelDefinition
from nbdist.train.stopping import StopFlag
from nbdist.transport.collectives import Collectives
from nbdist.transport.faults import RankLost
from nbdist.transport.study_channel import (
    TAG_DONE,
    TAG_EPOCH,
    TAG_TRIAL,
    TAG_VERDICT,
    CoordinatorChannel,
    GroupChannel,
    RanksFailed,
)
from nbdist.transport.waiting import CommFailure, WaitTimeout

__all__ = ["MPIGroups", "serve_group"]

# How long a group waits for the coordinator's next message, and its ranks for each other
# between trials (the coordinator's searcher may take a while; a frozen one must not).
STUDY_WAIT = 600.0


class MPIGroups(TrialExecutor):
    """The coordinator's view of the groups: who leads each, what each is training."""

    def __init__(self, world: Any, layout: Layout):
        self.channel = CoordinatorChannel(world)
        self.layout, self.groups = layout, layout.groups
        self.leaders = [layout.fold_ranks(g, 0)[0] for g in range(layout.groups)]
        self.fold_leaders = [[layout.fold_ranks(g, f)[0] for f in range(layout.folds)] for g in range(layout.groups)]
        self.running: dict[int, tuple[int, Segment]] = {}  # group -> (trial number, segment)
        self._group_ranks = [
            {r for f in range(layout.folds) for r in layout.fold_ranks(g, f)} for g in range(layout.groups)
        ]

    def start(self, group: int, trial: Trial, segment: Segment) -> None:
        self.running[group] = (trial.number, segment)
        self.channel.send(("trial", trial.number, trial.params, segment.to_dict()), self.leaders[group], TAG_TRIAL)

    def stop(self, group: int, reason: str) -> None:
        if group not in self.running:
            return
        number = self.running[group][0]
        for rank in self.fold_leaders[group]:
            self.channel.send((number, -1, reason or "stopped"), rank, TAG_VERDICT)

    def answer(self, report: EpochReport, stop_reason: str) -> None:
        for group, (number, segment) in self.running.items():
            if number == report.number and segment.gated:
                self.channel.send(
                    (number, report.epoch, stop_reason), self.fold_leaders[group][report.fold], TAG_VERDICT
                )

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
                    self.running = {g: r for g, r in self.running.items() if r[0] != number}
                    events.append(TrialFinished(number, folds))
            if events or time.monotonic() > deadline:
                return events
            # A gated run waits for the answer to its report: look again soon.
            time.sleep(0.001)

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
            self.running = {g: r for g, r in self.running.items() if g not in groups}
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


class _Asker:
    """A fold leader's line to the study at each epoch's end (TrialStopping's `ask`): the
    epoch's metrics go to the coordinator at once; a gated segment then waits for the
    verdict on it, another takes a stop that came meanwhile. Returns the word to stop
    ('' to go on)."""

    def __init__(self, channel: GroupChannel, number: int, fold: int, gated: bool, stop: StopFlag):
        self.channel, self.number, self.fold, self.gated, self.stop = channel, number, fold, gated, stop

    def __call__(self, epoch: int, metrics: dict[str, Any]) -> str:
        self.channel.report((self.number, self.fold, epoch, dict(metrics)), TAG_EPOCH)
        deadline = time.monotonic() + STUDY_WAIT
        answered = False
        while True:
            # Verdicts on an earlier trial of this group, come too late, are dropped.
            verdicts = [(e, word) for n, e, word in self.channel.pending(TAG_VERDICT) if n == self.number]
            word = next((word for _, word in verdicts if word), "")
            answered = answered or any(e == epoch for e, _ in verdicts)
            if word or answered or not self.gated or self.stop.requested:
                return word
            if time.monotonic() > deadline:
                raise WaitTimeout(STUDY_WAIT)
            time.sleep(0.0005)


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
    """A non-coordinator rank: train the segments of trials the coordinator hands this
    rank's group, until it says stop. Collective over the group."""
    role = comms.role
    group, (_, fold) = comms.group, role.run
    fold_leader = comms.run.Get_rank() == 0
    collectives = Collectives(lambda: STUDY_WAIT)
    channel = GroupChannel(world)
    kept = Kept()  # this rank's share of the last checkpoint its group's trial wrote
    while True:
        message = _receive(channel, TAG_TRIAL) if group.Get_rank() == 0 else None
        message = collectives.allgather(group, message, "the study's next trial")[0]
        if message[0] == "stop":
            return
        _, number, params, segment = message
        segment = Segment.from_dict(segment)
        trial_stop = StopFlag()
        if stop.requested:
            trial_stop.request(stop.reason)
        ask = _Asker(channel, number, fold, segment.gated, trial_stop) if fold_leader else None
        _forward(stop, trial_stop)
        try:
            exchange(world, comms, layout, collectives, kept, number, train.runs_dir, segment, STUDY_WAIT)
            outcome = train_fold(
                study,
                number,
                params,
                train,
                options,
                definition,
                comms.run,
                fold,
                trial_stop,
                segment=segment,
                ask=ask,
                asks=True,
                keep=kept.keeper(number),
            )
        except Exception as exc:  # this rank's own failure: the fold's others were told (control channel)
            sys.stderr.write(f"nbdist: rank {role.rank} failed in trial {number}:\n{traceback.format_exc()}")
            sys.stderr.flush()
            outcome = FoldOutcome(error=f"rank {role.rank} failed: {type(exc).__name__}: {exc}")
        finally:
            _forward(stop, None)
        if fold_leader:
            channel.flush(STUDY_WAIT)
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
