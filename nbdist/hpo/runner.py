"""The study's coordinator: asks its scheduler what each free group of ranks trains next
(a new trial the searcher proposes, or a paused one resumed from its checkpoint), hands
it out, reads each epoch's report and lets the scheduler stop a trial right after the
epoch it judged, tells the searcher each trial's result as what it is (finished, or
stopped after so many epochs), and keeps the run store up to date so that a study that
is interrupted resumes where it stopped.

Who trains the trials is an executor's business (nbdist.hpo.executor): groups of MPI
ranks under mpiexec, groups of a notebook's engines, or a Python function in this
process. The coordinator only starts segments on groups, reads their reports, and asks a
group to stop.

Persistence, so that a resumed study re-runs only what did not finish: the searcher's
and the scheduler's states are saved after every decision, each trial's row as it
starts, pauses and ends, and each segment it starts as a trial event. The searcher's
`pending` points are exactly the trials handed out and never told: a resumed study trains
those again (under their old numbers) first; a trial paused and resumed by its scheduler
goes on from its checkpoint.

A study recorded in a store may be shared by several jobs (several SLURM jobs on one
PostgreSQL store, or several processes on one SQLite file): the searcher and the
scheduler then live in the store, not in one coordinator. Every decision is made inside
the study's lock (`RunStore.coordinate`), so two jobs never get the same trial
(nbdist.hpo.records). A trial that reaches --goal says so in its row, which stops every
job of the study.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

from nbdist.hpo.executor import EpochReport, FoldOutcome, Running, TrialExecutor, TrialFinished
from nbdist.hpo.outcome import Settled, pareto_front, settle
from nbdist.hpo.records import StudyRecords
from nbdist.hpo.schedulers import COMPLETE, FAILED, PAUSED, Work
from nbdist.hpo.study_setup import StudyError, new_study_name, resolve_options, saved_options
from nbdist.hpo.trial import Segment, Trial

__all__ = [
    "TrialExecutor",
    "EpochReport",
    "TrialFinished",
    "FoldOutcome",
    "StudyRunner",
    "StudyResult",
    "StudyError",
    "furthest_words",
    "new_study_name",
    "saved_options",
    "resolve_options",
]

POLL_SECONDS = 0.2
EVENTS_EVERY = 1.0  # seconds between writes of the trials' intermediate values to the store
OUT_OF_TIME = "stopped: the study's time budget is spent"


# ----------------------------------------------------------------------------- result
@dataclass
class StudyResult:
    study: str
    store: str | None
    trials: list[dict[str, Any]]  # number, params, state, fom, fom_std, folds, generation, error, epochs, values
    best_params: dict[str, Any] | None
    best_fom: float | None
    reason: str
    seconds: float
    pareto: list[dict[str, Any]] = field(default_factory=list)  # a multi-objective study's front
    # With no trial complete, the one a scheduler took furthest (StudyRunner.furthest).
    furthest: dict[str, Any] | None = None

    def __repr__(self) -> str:
        if self.pareto:
            best = f"a Pareto front of {len(self.pareto)}"
        elif self.best_params is not None:
            best = f"best {self.best_fom:.4g} with {self.best_params}"
        elif self.furthest is not None:
            best = f"none complete, {furthest_words(self.furthest)}"
        else:
            best = "no result"
        return f"<StudyResult {self.study}: {len(self.trials)} trials, {best}; {self.reason}>"


def furthest_words(far: dict[str, Any]) -> str:
    """How a study's repr names the trial taken furthest (StudyRunner.furthest)."""
    return f"furthest trial {far['number']}: {far['fom']:.4g} after {far['epochs']} epochs"


# ----------------------------------------------------------------------------- runner
class StudyRunner(StudyRecords):
    """Runs a study on `executor`'s groups (see the module docstring); `run()` returns its result."""

    def run(self) -> StudyResult:
        started = time.time()
        running: dict[int, Running] = {}  # trial number -> where it runs
        free = list(range(self.executor.groups))
        reason = ""
        try:
            while True:
                if not reason:
                    reason = self._stop_reason()
                if self.stopping and not reason:
                    reason = self.stopping
                    for slot in running.values():
                        self.executor.stop(slot.placed, self.stopping)
                if not reason and self._out_of_time() and not self._timed_out:
                    self._timed_out = True
                    for slot in running.values():
                        slot.trial.stop_reason = slot.trial.stop_reason or OUT_OF_TIME
                        self.executor.stop(slot.placed, OUT_OF_TIME)
                if not reason:
                    self._fill(free, running)
                if not running:
                    reason = reason or self._stop_reason()
                    if not reason and self._others_train():
                        self._heartbeat()
                        time.sleep(POLL_SECONDS)
                        continue
                    if not reason:
                        self._finish_paused()
                    reason = reason or self._idle_reason()
                    break
                self._heartbeat()
                self._flush_events(due=True)
                for event in self.executor.poll(POLL_SECONDS):
                    if isinstance(event, EpochReport):
                        self._on_epoch(event, running)
                    else:
                        slot = running.pop(event.number)
                        free.append(slot.placed)
                        self._look_after = 0.0
                        self._on_finished(slot, event)
        finally:
            self._flush_events()
            try:
                if reason and not self.stopping and self.failure is None:
                    self._finish_paused()
            finally:
                self._close(reason)
        if self.failure is not None:
            raise self.failure
        return self._result(reason, time.time() - started)

    def stop(self, reason: str = "stopped") -> None:
        """From another thread: stop the running trials at their next step boundary and
        end the study; they stay unfinished, so that --resume-study trains them again."""
        self.stopping = reason

    # -- when to end ---------------------------------------------------------------------
    def _out_of_time(self) -> bool:
        return self.study.budget_time is not None and time.monotonic() - self._t0 >= self.study.budget_time

    def _epochs_left(self, running: dict[int, Running], starting: list[Running]) -> float:
        if self.study.budget_epochs is None:
            return math.inf
        committed = sum(_length(s.segment) for s in [*running.values(), *starting])
        return self.study.budget_epochs - self.spent - committed

    def _idle_reason(self) -> str:
        if self._timed_out or self._out_of_time():
            return f"the time budget of {self.study.budget_time:g} s is spent"
        if self.study.budget_epochs is not None and self._budget_short:
            return f"the budget of {self.study.budget_epochs} epochs is spent ({self.spent} trained)"
        if self.searcher.exhausted:
            return "the searcher has no more points"
        return f"{len(self.results)} trials done"

    def _stop_reason(self) -> str:
        if self.goal is not None and any(r["goal_reached"] for r in self.results):
            return f"goal {self.goal} reached"
        if len(self.results) >= self.scheduler.trials():
            return f"{self.scheduler.trials()} trials done"
        return ""

    # -- handing out work ----------------------------------------------------------------
    def _fill(self, free: list[int], running: dict[int, Running]) -> None:
        """Hand out segments to the free groups, as many as the scheduler and the budget
        allow. In a store, inside the study's lock: the budget counts every job's trials,
        and what is handed out is recorded as this job's in the same transaction that saves
        the searcher and scheduler that chose it (and that adopts the trials of jobs that
        are gone). With nothing to start, a shared study looks again after WATCH_SECONDS
        or as soon as one of its trials ends."""
        if not free or time.monotonic() < self._look_after:
            return
        starts: list[Running] = []
        recovered: list[tuple[Running, TrialFinished]] = []
        with self._locked():
            if self.store is not None:
                recovered = self._sync_with_store()
            if not self._stop_reason() and not self._out_of_time():
                self._budget_short = False
                while free:
                    slot = self._next_slot(free, running, starts)
                    if slot is None:
                        break
                    starts.append(slot)
                if starts:
                    self._save_state()
        for slot, finished in recovered:
            self._on_finished(slot, finished)
        for slot in starts:
            running[slot.trial.number] = slot
            self.executor.start(slot.placed, slot.trial, slot.planned)
        if self.store is not None and not starts and not recovered:
            self._look_after = time.monotonic() + self.WATCH_SECONDS

    def _next_slot(self, free: list[int], running: dict[int, Running], starts: list[Running]) -> Running | None:
        """The next segment to start on one of the `free` groups (taken from them), or None."""
        left = self._epochs_left(running, starts)
        if self.requeue:
            trial, segment = self.requeue[0]
            if _length(segment) > left:
                self._budget_short = True
                return None
            self.requeue.pop(0)
            self._drop_done_copies(trial, segment)
            # A recorded segment goes on as it was planned (PBT's exchange with the groups it named).
            group = trial.group if trial.group in free else free[0]
            free.remove(group)
            trial.group, trial.started = group, trial.started or time.time()
            self._record_start(trial, segment, Work(trial.number, segment.pause_at))
            return Running(trial, group, segment)
        else:
            new_allowed = self._created() < self.scheduler.trials()
            work = self.scheduler.next(new_allowed, left)
            if work is None:
                self._budget_short = left < math.inf and (new_allowed or bool(self.paused))
                return None
            chosen = self._trial_for(work)
            if chosen is None:  # an evolution waiting for its generation, or a grid run out
                return None
            trial = chosen
            if work.trial is None:
                work.params = dict(trial.params)  # what the new trial trains with (PB2 models it)
            self.scheduler.started(trial.number, work)
        group = trial.group if trial.group in free else free[0]
        free.remove(group)
        known = {**self.paused, **{s.trial.number: s.trial for s in [*running.values(), *starts]}}
        segment = self._segment(trial, work, known)
        trial.group = group
        trial.started = trial.started or time.time()
        slot = Running(trial, group, segment)
        self._record_start(trial, segment, work)
        return slot

    def _trial_for(self, work: Work) -> Trial | None:
        if work.trial is not None:
            return self.paused.pop(work.trial)
        if self.fresh:
            return self.fresh.pop(0)
        points = self.searcher.ask(1)
        if not points:
            return None
        number = self._new_number()
        return Trial(number, points[0], self.searcher.generation, asked=dict(points[0]))

    def _segment(self, trial: Trial, work: Work, known: dict[int, Trial]) -> Segment:
        """The segment `work` asks of `trial`, with PBT's exchange resolved to groups."""
        segment = Segment(
            start=trial.epochs,
            epochs=self.scheduler.epochs,
            pause_at=work.pause_at,
            gated=self.scheduler.decides_each_epoch,
            runs=dict(trial.runs),
        )
        if work.exchange is not None:
            source = known[work.exchange.source]
            segment.receive_from = (source.placed, source.number)
            segment.exchange_epoch = work.exchange.epoch
            previous, trial.params = trial.params, self.scheduler.params_for(work, source.params)
            self._events.append(
                (
                    trial.number,
                    "exploit",
                    work.exchange.epoch,
                    {
                        "source": source.number,
                        "params": trial.params,
                        "previous": previous,
                        **self.scheduler.explore_note(work),
                    },
                )
            )
            self._events.append((trial.number, "params", work.exchange.epoch, dict(trial.params)))
        if work.send_to:
            segment.send_to = [known[n].placed for n in work.send_to]
            segment.receivers = list(work.send_to)
            segment.exchange_epoch = trial.epochs
        if trial.epochs and work.trial is not None and not work.exchange:
            self._events.append((trial.number, "promoted", trial.epochs, {"to": work.pause_at or segment.epochs}))
        return segment

    # -- what the groups report ----------------------------------------------------------
    def _on_epoch(self, event: EpochReport, running: dict[int, Running]) -> None:
        slot = running.get(event.number)
        if slot is None:
            return
        trial = slot.trial
        value = event.metrics.get(self.objectives[0])
        if value is not None and math.isfinite(value):
            trial.curve.setdefault(event.epoch, {})[event.fold] = float(value)
            if len(trial.curve[event.epoch]) == self.study.folds:
                mean = trial.mean_at(event.epoch)
                self._events.append(
                    (trial.number, "value", event.epoch, {"value": mean, "folds": trial.curve[event.epoch]})
                )
                if not trial.stop_reason and mean is not None:
                    reason = self.scheduler.on_epoch(trial.number, event.epoch, mean)
                    if reason:
                        trial.stop_reason, trial.pruned_at = reason, event.epoch
                        self.executor.stop(slot.placed, reason)
        self.executor.answer(event, trial.stop_reason)

    def _on_finished(self, slot: Running, event: TrialFinished) -> None:
        trial = slot.trial
        if self.stopping:
            return  # interrupted, not finished: its row stays "running", a resume trains it again
        fatal = next((o.error for o in event.folds.values() if o.ends_study and o.error), None)
        if fatal is not None:
            # A mistake in the study's own settings (an --objective its runs do not report):
            # one error now, not every trial trained and marked failed. The trial stays
            # unfinished, so that the study resumed with the fix trains it.
            self.failure = StudyError(fatal)
            self.stop(fatal)
            return
        settled = settle(trial, slot.segment, event.folds, self.objectives)
        start = slot.segment.start if slot.segment is not None else 0
        self.spent += max(0, settled.epochs - start)
        trial.epochs, trial.value = settled.epochs, settled.fom
        trial.runs.update({f: o.run_id for f, o in event.folds.items() if o.run_id})
        row = self._settled_row(trial, settled)
        with self._locked():
            if self.store is not None and not self._still_mine(trial.number):
                return
            self._load_state()
            self.scheduler.reached(trial.number, settled.epochs, settled.fom, settled.outcome)
            self._tell(trial, settled)
            self._record_end(trial, slot.group, settled, row)
            self._save_state()
            if settled.outcome == PAUSED:
                self.paused[trial.number] = trial
            else:
                self.results.append(row)
            if self.store is not None:
                self._refresh_results(self.store.trials(self.name))
        self.say(self._line(row, trial, settled))

    def _tell(self, trial: Trial, settled: Settled) -> None:
        several = settled.values is not None and self.searcher.takes_values
        value: Any = settled.values if several else settled.fom
        if settled.outcome == FAILED:
            value = None
        self.searcher.tell(
            trial.asked or trial.params, value, stopped_at=None if settled.outcome == COMPLETE else settled.epochs
        )

    def _line(self, row: dict[str, Any], trial: Trial, settled: Settled) -> str:
        params = ", ".join(f"{k}={_short(v)}" for k, v in row["params"].items())
        # Finished trials of the study's: under a scheduler, paused ones are not (yet).
        done = f"{len(self.results)}/{self.scheduler.trials()} finished"
        head = f"nbdist: trial {row['number']:>3} ({done}) {row['state']:<8}"
        if row["state"] == "failed":
            return f"{head} {params}: {row['error']}"
        if row["fom"] is None:
            return f"{head} after epoch {row['epochs']} (no value yet)  {params}"
        if row["values"] is not None:
            shown = ", ".join(f"{n} {v:.4g}" for n, v in zip(self.objectives, row["values"], strict=True))
        else:
            spread = f" ± {row['fom_std']:.4f}" if self.study.folds > 1 and row["fom_std"] is not None else ""
            shown = f"{self.objectives[0]} {row['fom']:.4f}{spread}"
        where = ""
        if settled.outcome != COMPLETE:
            where = f" at {self.scheduler.describe(trial.number, settled.epochs)}"
        best = self.best()
        mark = "  *best*" if best is not None and best[0] == row["number"] else ""
        return f"{head} {shown}{where}  {params}{mark}"

    # -- results -------------------------------------------------------------------------
    def best(self) -> tuple[int, float, dict[str, Any]] | None:
        done = [r for r in self.results if r["state"] == "complete" and r["fom"] is not None]
        if not done:
            return None
        best = (max if self.maximize else min)(done, key=lambda r: r["fom"])
        return best["number"], best["fom"], best["params"]

    def furthest(self) -> dict[str, Any] | None:
        """Where no trial completed (its scheduler stopped or pruned every one): the trial
        that trained the most epochs, the best of those, as successive halving ranks them
        (a value after more epochs is not comparable with one after fewer); else None."""
        if self.best() is not None:
            return None
        cut = [r for r in self.results if r["state"] in ("stopped", "pruned") and r["fom"] is not None]
        if not cut:
            return None
        deepest = max(r["epochs"] for r in cut)
        at_depth = [r for r in cut if r["epochs"] == deepest]
        return (max if self.maximize else min)(at_depth, key=lambda r: r["fom"])

    def pareto(self) -> list[dict[str, Any]]:
        """A multi-objective study's Pareto front (empty for one objective)."""
        if len(self.objectives) < 2:
            return []
        return pareto_front(self.results, [d == "maximize" for d in self.directions])

    def _result(self, reason: str, seconds: float) -> StudyResult:
        best = self.best()
        trials = sorted(
            ({k: v for k, v in r.items() if k != "goal_reached"} for r in self.results), key=lambda r: r["number"]
        )
        return StudyResult(
            self.name,
            self.store_path,
            trials,
            best[2] if best else None,
            best[1] if best else None,
            reason or "interrupted",
            seconds,
            pareto=[{k: v for k, v in r.items() if k != "goal_reached"} for r in self.pareto()],
            furthest=self.furthest(),
        )


def _length(segment: Segment | None) -> int:
    if segment is None:
        return 0
    return max(0, (segment.pause_at or segment.epochs) - segment.start)


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
