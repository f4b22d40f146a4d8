"""A study shared by several jobs (several SLURM jobs on one PostgreSQL store, or several
processes on one SQLite file), and a study resumed after its job died.

Every decision is made inside the study's lock (`RunStore.coordinate`). A running trial
whose job is gone (killed, or ended without finishing it) is taken over by the next
coordinator that looks, once (`claim_trial`): a trial whose fold runs all got to the end of
its segment is settled from them; another goes on from its checkpoint (a scheduler's
segment, with PBT's copies that were committed before not made again) or trains again. A
job with free groups and nothing to start keeps watching the study while other jobs'
trials run, to take over those of a job that dies; it is gone after STALE_SECONDS
without a beat.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nbdist.hpo.executor import FoldOutcome, Running, TrialFinished
from nbdist.hpo.schedulers import Scheduler
from nbdist.hpo.trial import Segment, Trial, exploit_label, fold_of_run
from nbdist.options import StudyOptions, TrainOptions
from nbdist.store import RunStore

__all__ = ["SharedStudy", "HEARTBEAT_SECONDS"]

HEARTBEAT_SECONDS = 5.0  # a shared study's coordinator says it is alive this often


class SharedStudy:
    """What StudyRecords does for a study in a store that other jobs may share."""

    # What StudyRecords (records.py), which this is mixed into, gives.
    name: str
    job: str
    study: StudyOptions
    train: TrainOptions
    store: RunStore | None
    scheduler: Scheduler
    requeue: list[tuple[Trial, Segment]]
    fresh: list[Trial]
    stopping: str
    say: Callable[[str], None]
    _beat: float
    _watching: bool
    _rows: list[Any]
    _refresh_results: Callable[[list[Any]], None]
    _load_state: Callable[[], None]
    _trials_of: Callable[[list[Any], str], list[Trial]]
    _runs_by_trial: Callable[[], dict[int, dict[int, str]]]

    @property
    def _shared(self) -> RunStore:
        """The run store a shared or resumed study keeps its state in: the methods that
        call this run only with one."""
        if self.store is None:
            raise RuntimeError("this study has no run store to keep its state in")
        return self.store

    def _sync_with_store(self) -> list[tuple[Running, TrialFinished]]:
        """Inside the study's lock: adopt the trials of jobs that are gone, read every job's
        rows, load the searcher and the scheduler."""
        recovered = self._adopt_orphans()
        rows = self._shared.trials(self.name)
        self._refresh_results(rows)
        self._watching = any(t.state == "running" for t in rows)
        self._load_state()
        return recovered

    def _adopt_orphans(self) -> list[tuple[Running, TrialFinished]]:
        """Inside the study's lock: take over the running trials whose job is gone. Those
        whose fold runs all reached the end of their segment are returned with their
        outcome; the others go on from their checkpoints or train again."""
        live = self._shared.live_jobs(self.name)
        rows = self._shared.trials(self.name)
        self._rows = rows
        orphans = {t.number for t in rows if t.state == "running" and t.owner not in live}
        owners = {t.number: t.owner for t in rows}
        claimed = [
            trial
            for trial in self._trials_of(rows, "running")
            if trial.number in orphans
            and self._shared.claim_trial(self.name, trial.number, self.job, owners[trial.number])
        ]
        if claimed:
            self.say(
                f"nbdist: trial(s) {', '.join(str(t.number) for t in claimed)} of a job that is gone: taken over here"
            )
        segments = self._segments()
        recovered = []
        for trial in claimed:
            segment = segments.get(trial.number)
            finished = self._recorded(trial.number, segment)
            if finished is not None:
                recovered.append((Running(trial, trial.group, segment), finished))
            elif segment is not None and (segment.start or self.scheduler.pauses):
                trial.epochs = segment.start
                segment.runs = {**segment.runs, **trial.runs}
                self.requeue.append((trial, segment))
            else:
                trial.runs, trial.epochs = {}, 0
                self.fresh.append(trial)
        return recovered

    def _drop_done_copies(self, trial: Trial, segment: Segment) -> None:
        """A segment of `trial` trained again after a kill: PBT's copies that were committed
        before it are not made again (a receiver's run holds its `exploit-<epoch>` checkpoint)."""
        if segment.exchange_epoch is None:
            return
        runs = self._runs_by_trial()
        if segment.receive_from is not None and self._copied(runs.get(trial.number, {}), segment.exchange_epoch):
            segment.receive_from = None
        kept = [
            (group, number)
            for group, number in zip(segment.send_to, segment.receivers, strict=False)
            if not self._copied(runs.get(number, {}), segment.exchange_epoch)
        ]
        segment.send_to, segment.receivers = [g for g, _ in kept], [n for _, n in kept]

    def _copied(self, runs: dict[int, str], epoch: int) -> bool:
        label = exploit_label(epoch)
        return len(runs) == self.study.folds and all(
            (Path(self.train.runs_dir) / name / "checkpoints" / label).is_dir() for name in runs.values()
        )

    def _segments(self) -> dict[int, Segment]:
        """Each trial's last segment, as its start was recorded."""
        last: dict[int, Segment] = {}
        for event in self._shared.trial_events(self.name, kind="segment"):
            last[event["number"]] = Segment.from_dict(event["data"])
        return last

    def _recorded(self, number: int, segment: Segment | None) -> TrialFinished | None:
        """A trial's outcome from its fold runs in the store, when all of them got to the
        end of its segment (a whole trial: completed)."""
        target = None if segment is None else (segment.pause_at or segment.epochs)
        folds: dict[int, FoldOutcome] = {}
        for run in self._shared.runs(study=self.name):
            tagged = fold_of_run(run.id)
            if run.trial != number or tagged is None:
                continue
            if target is None:
                done = run.status == "completed"
            else:
                reached = int((run.final or {}).get("epoch", 0))
                done = run.status in ("completed", "stopped") and reached >= target
            if done:
                folds[tagged[1]] = FoldOutcome(final=run.final, stop_reason=run.reason or "", run_id=run.id)
        return TrialFinished(number, folds) if len(folds) == self.study.folds else None

    def _still_mine(self, number: int) -> bool:
        """Inside the lock: whether this job still owns the trial. One taken over while this
        job seemed gone (paused past its heartbeat) counts as the other job's: its result
        here is dropped, so that it is told once."""
        mine = next((t.owner for t in self._shared.trials(self.name) if t.number == number), None)
        if mine != self.job:
            self.say(f"nbdist: trial {number} was taken over by another job; this result is dropped")
            return False
        return True

    def _others_train(self) -> bool:
        """A shared study with nothing to start here still has trials running in other
        jobs: this one watches, to take over those of a job that dies, or to train what
        their results let the scheduler start next."""
        return self.store is not None and not self.stopping and self._watching

    def _heartbeat(self) -> None:
        if self.store is not None and time.monotonic() - self._beat > HEARTBEAT_SECONDS:
            self._beat = time.monotonic()
            self.store.study_heartbeat(self.name, self.job)
