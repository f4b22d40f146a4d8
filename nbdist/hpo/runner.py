"""The study's coordinator: asks the searcher for points, hands them to free groups of
ranks as trials, tells the searcher each trial's figure of merit as it arrives, prunes
trials that fall behind, and keeps the run store up to date so that a study that is
interrupted resumes where it stopped.

Who trains the trials is an executor's business (`TrialExecutor`): groups of MPI ranks
under mpiexec (batch.py), groups of a notebook's engines (notebook.py), or a Python
function in this process (functions.py). The coordinator only starts trials on groups,
reads their reports, and asks a group to stop a trial.

Persistence, so that a resumed study re-runs only what did not finish: the searcher's
state is saved after every ask and every tell, and each trial's row as it starts and
ends. The searcher's `pending` points are exactly the trials that were handed out and
never told: a resumed study trains those again (under their old numbers) first.

A study recorded in a store may be shared by several jobs (several SLURM jobs on one
PostgreSQL store, or several processes on one SQLite file): the searcher then lives in
the store, not in one coordinator. Every ask and every tell is made inside the study's
lock (`RunStore.coordinate`): the coordinator loads the searcher's state, asks or tells,
saves it, and writes the trial rows it hands out under its own job name, all in one
transaction, so two jobs never get the same trial. A running trial whose job is gone
(killed, or ended without finishing it) is taken over by the next coordinator that
looks, once (`claim_trial`); `--resume-study` joins a study that other jobs still run.
A job with free groups and nothing to start keeps watching the study while other jobs'
trials run, so that it takes over those of a job that dies; its wait ends when every
trial is finished or adopted, and a job that stops beating is gone after STALE_SECONDS.
A trial that reaches --goal says so in its row, which stops every job of the study.
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from nbdist.errors import UserError
from nbdist.hpo.pruning import MedianPruner
from nbdist.hpo.searcher import Searcher, make_searcher, restore_searcher
from nbdist.hpo.trial import Trial, TrialError, fold_fom
from nbdist.options import StudyOptions, TrainOptions, parse_target
from nbdist.store import RunStore, store_path

__all__ = [
    "TrialExecutor",
    "EpochReport",
    "TrialFinished",
    "FoldOutcome",
    "StudyRunner",
    "StudyResult",
    "StudyError",
    "new_study_name",
    "saved_options",
    "resolve_options",
]

POLL_SECONDS = 0.2
HEARTBEAT_SECONDS = 5.0  # a shared study's coordinator says it is alive this often
WATCH_SECONDS = 1.0  # a shared study's job with nothing to start looks at the study this often


class StudyError(UserError):
    pass


# ----------------------------------------------------------------------------- events
@dataclass(slots=True)
class EpochReport:
    """A fold run of a running trial finished an epoch (its leader's epoch record)."""

    number: int
    fold: int
    epoch: int
    metrics: dict[str, Any]


@dataclass(slots=True)
class FoldOutcome:
    final: dict[str, Any] | None = None  # the fold run's final metrics (its leader's RunResult)
    error: str | None = None
    stop_reason: str = ""
    run_id: str | None = None
    ends_study: bool = False  # the error is in the study's settings: every trial would fail with it


@dataclass(slots=True)
class TrialFinished:
    """Every rank of the trial's group is done: its group is free again."""

    number: int
    folds: dict[int, FoldOutcome]


class TrialExecutor(ABC):
    """Trains trials on `groups` groups of ranks, one trial per group at a time."""

    groups: int

    @abstractmethod
    def start(self, group: int, trial: Trial) -> None:
        """Start training `trial` on `group` (which is free); returns at once."""

    @abstractmethod
    def poll(self, timeout: float) -> list[EpochReport | TrialFinished]:
        """What happened since the last poll, waiting at most `timeout` for something."""

    @abstractmethod
    def prune(self, group: int) -> None:
        """Ask the trial running on `group` to stop at its next step boundary."""

    def close(self) -> None:  # noqa: B027
        """The study is over (or interrupted): release the groups. By default there is
        nothing to release."""


# ----------------------------------------------------------------------------- result
@dataclass
class StudyResult:
    study: str
    store: str | None
    trials: list[dict[str, Any]]  # number, params, state, fom, fom_std, folds, generation, error
    best_params: dict[str, Any] | None
    best_fom: float | None
    reason: str
    seconds: float

    def __repr__(self) -> str:
        best = f"best {self.best_fom:.4g} with {self.best_params}" if self.best_params is not None else "no result"
        return f"<StudyResult {self.study}: {len(self.trials)} trials, {best}; {self.reason}>"


def resolve_options(study: dict[str, Any], train: dict[str, Any]) -> tuple[StudyOptions, TrainOptions]:
    """The options of a study from those given: over the defaults, or over the saved
    options of the study that --resume-study names (its budget, space, groups, ...)."""
    try:
        base_study, base_train = StudyOptions(), TrainOptions()
        if study.get("resume_study"):
            given_train = base_train.replace(**train)
            base_study, base_train = saved_options(
                store_path(given_train.store, given_train.runs_dir), study["resume_study"]
            )
        return base_study.replace(**study), base_train.replace(**train)
    except TypeError as exc:
        raise StudyError(str(exc)) from None


def saved_options(store: str | None, name: str) -> tuple[StudyOptions, TrainOptions]:
    """The options a study was started with (a resumed study keeps them unless given anew)."""
    if store is None:
        raise StudyError("--resume-study needs the run store the study was recorded in (not --store off)")
    with RunStore(store, create=False) as opened:
        saved = opened.study(name)["options"] or {}
    if "study" not in saved:
        raise StudyError(f"study {name!r} in {store} has no saved options: it cannot be resumed")
    return StudyOptions.from_dict(saved["study"]), TrainOptions.from_dict(saved["train"])


def new_study_name(options: StudyOptions) -> str:
    return options.study_name or f"{time.strftime('%Y%m%d-%H%M%S')}-{options.searcher.split('(')[0]}"


# ----------------------------------------------------------------------------- runner
@dataclass
class _Running:
    trial: Trial
    group: int | None
    pruning: bool = False


@dataclass
class StudyRunner:
    study: StudyOptions
    train: TrainOptions
    executor: TrialExecutor
    store_path: str | None
    say: Callable[[str], None] = print
    name: str = field(init=False)
    searcher: Searcher = field(init=False)
    pruner: MedianPruner | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.study.validate()
        self.stopping = ""  # set by stop(): the loop stops the running trials and ends
        self.failure: StudyError | None = None  # what ended the study before its trials could train
        self.name = self.study.resume_study or new_study_name(self.study)
        self.maximize = self.study.resolved_direction == "maximize"
        self.goal = parse_target(self.study.goal) if self.study.goal else None
        self.store = RunStore(self.store_path) if self.store_path is not None else None
        # This coordinator's name among the study's jobs: the trials it trains carry it.
        self.job = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._beat = time.monotonic()
        self._look_after = 0.0  # a shared study's job with nothing to start looks again then
        self._watching = False  # a shared study has trials running (here or in other jobs)
        self.results: list[dict[str, Any]] = []  # finished trials, in the order they finished
        self.requeue: list[Trial] = []  # trials to train again (a resumed study's unfinished ones)
        self.next_number = 0
        if self.study.prune:
            self.pruner = MedianPruner(maximize=self.maximize, warmup_trials=self.study.prune_warmup)
        if self.study.resume_study:
            self._resume()
        else:
            self._create()

    # -- setting up ----------------------------------------------------------------------
    def _create(self) -> None:
        self.searcher = make_searcher(
            self.study.searcher,
            self.study.space,
            direction=self.study.resolved_direction,
            seed=self.train.seed,
            trials=self.study.trials,
        )
        if self.store is not None:
            # One INSERT decides which of two jobs starting the same study at once creates it,
            # and writes the searcher's state with it: a job that joins with --resume-study
            # as soon as the study is in the store finds a state to resume from.
            if not self.store.create_study(
                self.name,
                searcher=self.study.searcher,
                space=str(self.searcher.space),
                options={"study": self.study.to_dict(), "train": self.train.to_dict()},
                objective=self.study.objective,
                direction=self.study.resolved_direction,
                searcher_state=self._state(),
            ):
                raise StudyError(
                    f"the store {self.store.label} has a study named {self.name!r} already: continue "
                    f"it (or join the jobs that run it) with --resume-study {self.name}, or give "
                    f"another --study-name"
                )
            self.store.join_study(self.name, self.job)

    def _resume(self) -> None:
        if self.store is None:
            raise StudyError("--resume-study needs the run store the study was recorded in (not --store off)")
        self.store.study(self.name)  # no such study: one error naming the store
        self.store.reopen_study(self.name)
        self.store.join_study(self.name, self.job)
        with self.store.coordinate(self.name):
            self._load_state()
            rows = self.store.trials(self.name)
            self._refresh_results(rows)
            others = self.store.live_jobs(self.name) - {self.job}
            # Points handed out and never recorded as trials (a store from before trial rows
            # were written with the ask): trained under new numbers.
            recorded = {self.searcher.space.key(t.params) for t in rows if t.state == "running"}
            number = max((t.number for t in rows), default=-1) + 1
            for params in self.searcher.pending:
                if self.searcher.space.key(params) not in recorded:
                    self.store.record_trial(self.name, number, params=dict(params), state="running", owner=self.job)
                    self.requeue.append(Trial(number, dict(params), None))
                    number += 1
            recovered = self._adopt_orphans()
        also = f"; {len(others)} other job(s) run it too" if others else ""
        self.say(
            f"nbdist: resuming study {self.name}: {len(self.results)} trials finished, "
            f"{len(recovered)} recovered from their runs, {len(self.requeue)} to train again{also}"
        )
        for trial, finished in recovered:
            self._on_finished(_Running(trial, group=None), finished)

    @property
    def _shared(self) -> RunStore:
        """The run store a resumable study keeps its state in: the methods that call this
        run only with one."""
        if self.store is None:
            raise RuntimeError("this study has no run store to keep its state in")
        return self.store

    def _load_state(self) -> None:
        """The study's searcher and pruner as the store has them (inside its lock)."""
        state = self._shared.study(self.name).get("searcher_state") or {}
        if "searcher" not in state:
            raise StudyError(f"study {self.name!r} has no saved searcher state: it cannot be resumed")
        self.searcher = restore_searcher(state["searcher"])
        if self.pruner is not None:
            self.pruner.load_state(state.get("pruner", []))

    def _refresh_results(self, rows: list[Any]) -> None:
        """The study's finished trials, whichever job trained them (and reached the goal)."""
        self.results = [{**self._row(t), "goal_reached": t.goal_reached} for t in rows if t.state != "running"]

    def _adopt_orphans(self) -> list[tuple[Trial, TrialFinished]]:
        """Inside the study's lock: take over the running trials whose job is gone: those
        to train again join the queue; those whose fold runs all completed are returned
        with their outcome."""
        live = self._shared.live_jobs(self.name)
        claimed = [
            Trial(t.number, t.params, t.generation)
            for t in self._shared.trials(self.name)
            if t.state == "running"
            and t.owner not in live
            and self._shared.claim_trial(self.name, t.number, self.job, t.owner)
        ]
        if claimed:
            self.say(
                f"nbdist: trial(s) {', '.join(str(t.number) for t in claimed)} of a job that is gone: taken over here"
            )
        # A trial whose every fold run ended well before its job was cut off is not
        # trained again: its runs are in the store, with their final metrics.
        outcomes = [(t, self._recorded(t.number)) for t in claimed]
        self.requeue += [t for t, finished in outcomes if finished is None]
        return [(t, f) for t, f in outcomes if f is not None]

    def _recorded(self, number: int) -> TrialFinished | None:
        """A trial's outcome from its fold runs in the store, when all of them completed."""
        from nbdist.hpo.trial import fold_of_run

        folds: dict[int, FoldOutcome] = {}
        for run in self._shared.runs(study=self.name):
            tagged = fold_of_run(run.id)
            if run.trial == number and run.status == "completed" and tagged is not None:
                folds[tagged[1]] = FoldOutcome(final=run.final, stop_reason=run.reason or "", run_id=run.id)
        return TrialFinished(number, folds) if len(folds) == self.study.folds else None

    @staticmethod
    def _row(t: Any) -> dict[str, Any]:
        return {
            "number": t.number,
            "params": t.params,
            "state": t.state,
            "fom": t.fom,
            "fom_std": t.fom_std,
            "folds": t.folds,
            "generation": t.generation,
            "error": t.error,
        }

    def _new_number(self) -> int:
        number, self.next_number = self.next_number, self.next_number + 1
        return number

    def _state(self) -> dict[str, Any]:
        """What the store keeps of the searcher and the pruner, to resume them."""
        return {"searcher": self.searcher.state(), "pruner": self.pruner.state() if self.pruner else []}

    def _save_state(self) -> None:
        if self.store is not None:
            self.store.save_searcher_state(self.name, self._state())

    # -- the loop ------------------------------------------------------------------------
    def run(self) -> StudyResult:
        started = time.time()
        running: dict[int, _Running] = {}  # trial number -> where it runs
        free = list(range(self.executor.groups))
        reason = ""
        try:
            while True:
                if not reason:
                    reason = self._stop_reason()
                if self.stopping and not reason:
                    reason = self.stopping
                    for slot in running.values():
                        if slot.group is not None:
                            self.executor.prune(slot.group)
                if not reason:
                    self._fill(free, running)
                if not running:
                    reason = reason or self._stop_reason()
                    if not reason and self._others_train():
                        self._heartbeat()
                        time.sleep(POLL_SECONDS)
                        continue
                    reason = reason or self._idle_reason()
                    break
                self._heartbeat()
                for event in self.executor.poll(POLL_SECONDS):
                    if isinstance(event, EpochReport):
                        self._on_epoch(event, running)
                    else:
                        slot = running.pop(event.number)
                        if slot.group is not None:
                            free.append(slot.group)
                        self._look_after = 0.0
                        self._on_finished(slot, event)
        finally:
            self.executor.close()
            if self.store is not None:
                self.store.leave_study(self.name, self.job)
                # The study goes on while another job runs it; the last one out ends it.
                if not self.store.live_jobs(self.name):
                    status = "completed" if reason and not self.stopping else "interrupted"
                    self.store.end_study(self.name, "failed" if self.failure else status)
        if self.failure is not None:
            raise self.failure
        return self._result(reason, time.time() - started)

    def stop(self, reason: str = "stopped") -> None:
        """From another thread: stop the running trials at their next step boundary and
        end the study; they stay unfinished, so that --resume-study trains them again."""
        self.stopping = reason

    def _others_train(self) -> bool:
        """A shared study with nothing to start here still has trials running in other
        jobs: this one watches, to take over those of a job that dies, or to train what
        their results let the searcher ask next."""
        return self.store is not None and not self.stopping and self._watching

    def _idle_reason(self) -> str:
        if self.searcher.exhausted:
            return "the searcher has no more points"
        return f"{len(self.results)} trials done"

    def _heartbeat(self) -> None:
        if self.store is not None and time.monotonic() - self._beat > HEARTBEAT_SECONDS:
            self._beat = time.monotonic()
            self.store.study_heartbeat(self.name, self.job)

    def _stop_reason(self) -> str:
        if self.goal is not None and any(r["goal_reached"] for r in self.results):
            return f"goal {self.goal} reached"
        if len(self.results) >= self.study.trials:
            return f"{self.study.trials} trials done"
        return ""

    def _fill(self, free: list[int], running: dict[int, _Running]) -> None:
        """Hand out trials to the free groups, as many as the budget allows."""
        if self.store is not None and free:
            self._fill_shared(free, running)
            return
        budget = self.study.trials - len(self.results) - len(running)
        while free and budget > 0:
            if self.requeue:
                trial = self.requeue.pop(0)
            else:
                points = self.searcher.ask(min(len(free), budget))
                if not points:  # an evolution waiting for its generation, or a grid run out
                    return
                generation = self.searcher.generation
                self.requeue += [Trial(self._new_number(), p, generation) for p in points]
                self._save_state()
                continue
            group = free.pop(0)
            trial.group, trial.started = group, time.time()
            running[trial.number] = _Running(trial, group)
            if self.store is not None:
                self.store.record_trial(
                    self.name,
                    trial.number,
                    params=trial.params,
                    state="running",
                    generation=trial.generation,
                    group=group,
                    started=trial.started,
                )
            self.executor.start(group, trial)
            budget -= 1

    def _fill_shared(self, free: list[int], running: dict[int, _Running]) -> None:
        """`_fill` for a study in a store, which other jobs may share: the budget counts
        every job's trials, and the points asked are recorded as this job's trials in the
        same transaction that saves the searcher that gave them (and that adopts the
        trials of jobs that are gone). With nothing to start, it looks again after
        WATCH_SECONDS or as soon as one of its trials ends."""
        if time.monotonic() < self._look_after:
            return
        starts: list[tuple[int, Trial]] = []
        with self._shared.coordinate(self.name):
            recovered = self._adopt_orphans()
            rows = self._shared.trials(self.name)
            self._refresh_results(rows)
            self._watching = any(t.state == "running" for t in rows)
            if not self._stop_reason():
                while free and self.requeue:
                    starts.append((free.pop(0), self.requeue.pop(0)))
                budget = self.study.trials - len(rows)
                if free and budget > 0:
                    self._load_state()
                    points = self.searcher.ask(min(len(free), budget))
                    number = max((t.number for t in rows), default=-1) + 1
                    for offset, params in enumerate(points):
                        starts.append((free.pop(0), Trial(number + offset, params, self.searcher.generation)))
                    self._save_state()
                for group, trial in starts:
                    trial.group, trial.started = group, time.time()
                    self._shared.record_trial(
                        self.name,
                        trial.number,
                        params=trial.params,
                        state="running",
                        generation=trial.generation,
                        group=group,
                        started=trial.started,
                        owner=self.job,
                    )
        for trial, finished in recovered:
            self._on_finished(_Running(trial, group=None), finished)
        for group, trial in starts:
            running[trial.number] = _Running(trial, group)
            self.executor.start(group, trial)
        if not starts and not recovered:
            self._look_after = time.monotonic() + WATCH_SECONDS

    def _on_epoch(self, event: EpochReport, running: dict[int, _Running]) -> None:
        slot = running.get(event.number)
        value = event.metrics.get(self.study.objective)
        if slot is None or value is None or not math.isfinite(value):
            return
        trial = slot.trial
        trial.curve.setdefault(event.epoch, {})[event.fold] = float(value)
        if len(trial.curve[event.epoch]) < self.study.folds or self.pruner is None or slot.pruning:
            return
        mean = statistics.fmean(trial.curve[event.epoch].values())
        if self.pruner.should_prune(event.epoch, mean):
            slot.pruning = True
            trial.pruned_at = event.epoch
            if slot.group is not None:
                self.executor.prune(slot.group)

    def _on_finished(self, slot: _Running, event: TrialFinished) -> None:
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
        errors: dict[int, str] = {}
        foms: dict[int, float] = {}
        for fold, outcome in event.folds.items():
            if outcome.error:
                errors[fold] = outcome.error
                continue
            try:
                foms[fold] = fold_fom(outcome.final or {}, self.study.objective)
            except TrialError as exc:
                if not slot.pruning:  # a pruned fold's figure of merit is its curve's
                    errors[fold] = str(exc)
        if slot.pruning and trial.pruned_at is not None:
            state = "pruned"
            values = list(trial.curve[trial.pruned_at].values())
        elif errors:
            state, values = "failed", []
        else:
            state, values = "complete", list(foms.values())
        fom = statistics.fmean(values) if values else None
        fom_std = statistics.pstdev(values) if len(values) > 1 else (0.0 if values else None)
        error = None if state != "failed" else "; ".join(f"fold {f}: {e}" for f, e in sorted(errors.items()))
        means = _mean_metrics([o.final for o in event.folds.values() if o.final]) if state == "complete" else {}
        row: dict[str, Any] = {
            "number": trial.number,
            "params": trial.params,
            "state": state,
            "fom": fom,
            "fom_std": fom_std,
            "folds": [foms[f] for f in sorted(foms)],
            "generation": trial.generation,
            "error": error,
            "goal_reached": bool(self.goal and means and self.goal.reached(means)),
        }
        if self.store is None:
            self._tell(trial, state, fom)
            self.results.append(row)
        else:
            with self.store.coordinate(self.name):
                mine = next((t.owner for t in self.store.trials(self.name) if t.number == trial.number), None)
                if mine != self.job:
                    # Taken over while this job seemed gone (paused past its heartbeat): the
                    # other job's result counts, this one is dropped, so it is told once.
                    self.say(f"nbdist: trial {trial.number} was taken over by another job; this result is dropped")
                    return
                self._load_state()
                self._tell(trial, state, fom)
                self.store.record_trial(
                    self.name,
                    trial.number,
                    params=trial.params,
                    state=state,
                    fom=fom,
                    fom_std=fom_std,
                    folds=row["folds"],
                    generation=trial.generation,
                    group=slot.group,
                    error=error,
                    started=trial.started,
                    ended=time.time(),
                    goal_reached=row["goal_reached"],
                )
                self.results.append(row)
                self._refresh_results(self.store.trials(self.name))
        self.say(self._line(row))

    def _tell(self, trial: Trial, state: str, fom: float | None) -> None:
        self.searcher.tell(trial.params, fom)
        if state == "complete" and self.pruner is not None:
            self.pruner.finished(
                {e: statistics.fmean(v.values()) for e, v in trial.curve.items() if len(v) == self.study.folds}
            )
        self._save_state()

    def _line(self, row: dict[str, Any]) -> str:
        params = ", ".join(f"{k}={_short(v)}" for k, v in row["params"].items())
        head = f"nbdist: trial {row['number']:>3} ({len(self.results)}/{self.study.trials}) {row['state']:<8}"
        if row["state"] == "failed":
            return f"{head} {params}: {row['error']}"
        spread = f" ± {row['fom_std']:.4f}" if self.study.folds > 1 else ""
        best = self.best()
        mark = "  *best*" if best is not None and best[0] == row["number"] else ""
        return f"{head} {self.study.objective} {row['fom']:.4f}{spread}  {params}{mark}"

    def best(self) -> tuple[int, float, dict[str, Any]] | None:
        done = [r for r in self.results if r["state"] == "complete" and r["fom"] is not None]
        if not done:
            return None
        best = (max if self.maximize else min)(done, key=lambda r: r["fom"])
        return best["number"], best["fom"], best["params"]

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
        )


def _mean_metrics(finals: list[dict[str, Any]]) -> dict[str, float]:
    keys = {k for f in finals for k, v in f.items() if isinstance(v, (int, float))}
    return {k: statistics.fmean(float(f[k]) for f in finals if k in f) for k in keys}


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
