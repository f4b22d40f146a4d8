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
"""

from __future__ import annotations

import math
import statistics
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable

from nbdist.errors import UserError
from nbdist.hpo.pruning import MedianPruner
from nbdist.hpo.searcher import Searcher, make_searcher, restore_searcher
from nbdist.hpo.trial import Trial, TrialError, fold_fom
from nbdist.options import StudyOptions, TrainOptions, parse_target
from nbdist.store import RunStore, StoreError, store_path

__all__ = ["TrialExecutor", "EpochReport", "TrialFinished", "FoldOutcome", "StudyRunner", "StudyResult",
           "StudyError", "new_study_name", "saved_options", "resolve_options"]

POLL_SECONDS = 0.2


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

    def close(self) -> None:
        """The study is over (or interrupted): release the groups."""


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
            base_study, base_train = saved_options(store_path(given_train.store, given_train.runs_dir),
                                                   study["resume_study"])
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
        self.searcher = make_searcher(self.study.searcher, self.study.space, direction=self.study.resolved_direction,
                                      seed=self.train.seed, trials=self.study.trials)
        if self.store is not None:
            try:
                self.store.study(self.name)
            except StoreError:
                pass
            else:
                raise StudyError(f"the store {self.store_path} has a study named {self.name!r} already: continue it "
                                 f"with --resume-study {self.name}, or give another --study-name")
            self.store.begin_study(self.name, searcher=self.study.searcher, space=str(self.searcher.space),
                                   options={"study": self.study.to_dict(), "train": self.train.to_dict()},
                                   objective=self.study.objective, direction=self.study.resolved_direction)
            self._save_state()

    def _resume(self) -> None:
        if self.store is None:
            raise StudyError("--resume-study needs the run store the study was recorded in (not --store off)")
        saved = self.store.study(self.name)
        state = saved.get("searcher_state") or {}
        if "searcher" not in state:
            raise StudyError(f"study {self.name!r} has no saved searcher state: it cannot be resumed")
        self.searcher = restore_searcher(state["searcher"])
        if self.pruner is not None:
            self.pruner.load_state(state.get("pruner", []))
        rows = self.store.trials(self.name)
        self.next_number = max((t.number for t in rows), default=-1) + 1
        finished = {t.number for t in rows if t.state != "running"}
        self.results = [self._row(t) for t in rows if t.number in finished]
        running = {self.searcher.space.key(t.params): t for t in rows if t.state == "running"}
        for params in self.searcher.pending:
            row = running.get(self.searcher.space.key(params))
            number = row.number if row is not None else self._new_number()
            self.requeue.append(Trial(number, dict(params), row.generation if row else None))
        self.store.begin_study(self.name, searcher=saved["searcher"], space=saved["space"], options=saved["options"],
                               objective=saved["objective"], direction=saved["direction"])
        # A trial whose every fold run ended well before the study was cut off is not
        # trained again: its runs are in the store, with their final metrics.
        recovered = [(t, self._recorded(t.number)) for t in self.requeue]
        self.requeue = [t for t, finished in recovered if finished is None]
        self.say(f"nbdist: resuming study {self.name}: {len(self.results)} trials finished, "
                 f"{sum(f is not None for _, f in recovered)} recovered from their runs, "
                 f"{len(self.requeue)} to train again")
        for trial, finished in recovered:
            if finished is not None:
                self._on_finished(_Running(trial, group=None), finished)

    def _recorded(self, number: int) -> TrialFinished | None:
        """A trial's outcome from its fold runs in the store, when all of them completed."""
        from nbdist.hpo.ranks import fold_of_run

        folds: dict[int, FoldOutcome] = {}
        for run in self.store.runs(study=self.name):
            tagged = fold_of_run(run.id)
            if run.trial == number and run.status == "completed" and tagged is not None:
                folds[tagged[1]] = FoldOutcome(final=run.final, stop_reason=run.reason or "", run_id=run.id)
        return TrialFinished(number, folds) if len(folds) == self.study.folds else None

    @staticmethod
    def _row(t: Any) -> dict[str, Any]:
        return {"number": t.number, "params": t.params, "state": t.state, "fom": t.fom, "fom_std": t.fom_std,
                "folds": t.folds, "generation": t.generation, "error": t.error}

    def _new_number(self) -> int:
        number, self.next_number = self.next_number, self.next_number + 1
        return number

    def _save_state(self) -> None:
        if self.store is not None:
            self.store.save_searcher_state(self.name, {"searcher": self.searcher.state(),
                                                       "pruner": self.pruner.state() if self.pruner else []})

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
                        self.executor.prune(slot.group)
                if not reason:
                    self._fill(free, running)
                if not running:
                    reason = reason or ("the searcher has no more points" if self.searcher.exhausted
                                        else f"{len(self.results)} trials done")
                    break
                for event in self.executor.poll(POLL_SECONDS):
                    if isinstance(event, EpochReport):
                        self._on_epoch(event, running)
                    else:
                        slot = running.pop(event.number)
                        free.append(slot.group)
                        self._on_finished(slot, event)
        finally:
            self.executor.close()
            if self.store is not None:
                status = "completed" if reason and not self.stopping else "interrupted"
                self.store.end_study(self.name, "failed" if self.failure else status)
        if self.failure is not None:
            raise self.failure
        return self._result(reason, time.time() - started)

    def stop(self, reason: str = "stopped") -> None:
        """From another thread: stop the running trials at their next step boundary and
        end the study; they stay unfinished, so that --resume-study trains them again."""
        self.stopping = reason

    def _stop_reason(self) -> str:
        if self.goal is not None and any(r.get("goal_reached") for r in self.results):
            return f"goal {self.goal} reached"
        if len(self.results) >= self.study.trials:
            return f"{self.study.trials} trials done"
        return ""

    def _fill(self, free: list[int], running: dict[int, _Running]) -> None:
        """Hand out trials to the free groups, as many as the budget allows."""
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
                self.store.record_trial(self.name, trial.number, params=trial.params, state="running",
                                        generation=trial.generation, group=group, started=trial.started)
            self.executor.start(group, trial)
            budget -= 1

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
        self.searcher.tell(trial.params, fom)
        if state == "complete" and self.pruner is not None:
            self.pruner.finished({e: statistics.fmean(v.values()) for e, v in trial.curve.items()
                                  if len(v) == self.study.folds})
        self._save_state()
        means = _mean_metrics([o.final for o in event.folds.values() if o.final]) if state == "complete" else {}
        row = {"number": trial.number, "params": trial.params, "state": state, "fom": fom, "fom_std": fom_std,
               "folds": [foms[f] for f in sorted(foms)], "generation": trial.generation, "error": error,
               "goal_reached": bool(self.goal and means and self.goal.reached(means))}
        self.results.append(row)
        if self.store is not None:
            self.store.record_trial(self.name, trial.number, params=trial.params, state=state, fom=fom,
                                    fom_std=fom_std, folds=row["folds"], generation=trial.generation,
                                    group=slot.group, error=error, started=trial.started, ended=time.time())
        self.say(self._line(row))

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
        trials = sorted(({k: v for k, v in r.items() if k != "goal_reached"} for r in self.results),
                        key=lambda r: r["number"])
        return StudyResult(self.name, self.store_path, trials, best[2] if best else None, best[1] if best else None,
                           reason or "interrupted", seconds)


def _mean_metrics(finals: list[dict[str, Any]]) -> dict[str, float]:
    keys = {k for f in finals for k, v in f.items() if isinstance(v, (int, float))}
    return {k: statistics.fmean(float(f[k]) for f in finals if k in f) for k in keys}


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
