"""A study's set-up and its records: the searcher and scheduler it starts with or resumes,
and the run store's rows of its trials and their events.

In a store, every decision is made inside the study's lock (`RunStore.coordinate`): the
coordinator loads the searcher's and the scheduler's state, decides, saves them, and
writes the trial rows it hands out under its own job name, all in one transaction, so that
several jobs may share the study (nbdist.hpo.shared).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from nbdist.errors import UserError
from nbdist.hpo.executor import TrialExecutor
from nbdist.hpo.outcome import Settled
from nbdist.hpo.schedulers import PAUSED, SCHEDULERS, STOPPED, Scheduler, Setting, Work
from nbdist.hpo.searcher import make_searcher, restore_searcher
from nbdist.hpo.shared import SharedStudy
from nbdist.hpo.study_setup import StudyError, new_study_name, scheduler_spec
from nbdist.hpo.trial import CHANGEABLE_HELP, Segment, Trial, changeable, fold_of_run
from nbdist.options import StudyOptions, TrainOptions, parse_target
from nbdist.store import RunStore

__all__ = ["StudyRecords"]


class StudyRecords(SharedStudy):
    """The runner's state and everything it writes (nbdist.hpo.runner runs the loop)."""

    WATCH_SECONDS = 1.0  # a shared study's job with nothing to start looks at the study this often

    def __init__(
        self,
        study: StudyOptions,
        train: TrainOptions,
        executor: TrialExecutor,
        store_path: str | None,
        say: Callable[[str], None] = print,
    ):
        self.study, self.train, self.executor, self.store_path, self.say = study, train, executor, store_path, say
        self.study.validate()
        self.stopping = ""  # set by stop(): the loop stops the running trials and ends
        self.failure: UserError | None = None  # what ended the study before its trials could train
        self.name = self.study.resume_study or new_study_name(self.study)
        self.objectives = self.study.objectives
        self.directions = self.study.resolved_directions
        self.maximize = self.directions[0] == "maximize"
        self.goal = parse_target(self.study.goal, "--goal") if self.study.goal else None
        self.store = RunStore(self.store_path) if self.store_path is not None else None
        # This coordinator's name among the study's jobs: the trials it trains carry it.
        self.job = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._beat = time.monotonic()
        self._t0 = time.monotonic()
        self._look_after = 0.0  # a shared study's job with nothing to start looks again then
        self._watching = False  # a shared study has trials running (here or in other jobs)
        self._timed_out = False
        self._budget_short = False  # the last look for work found the epochs budget too short
        self.results: list[dict[str, Any]] = []  # finished trials, in the order they finished
        # Segments to train first (a resumed study's), as they were recorded when they started.
        self.requeue: list[tuple[Trial, Segment]] = []
        self.fresh: list[Trial] = []  # trials to train again from scratch (a resumed study's)
        self.paused: dict[int, Trial] = {}  # trials between two segments
        self.next_number = 0
        self.spent = 0  # epochs trained, over all trials
        self._events: list[tuple[int, str, int, dict[str, Any]]] = []  # not yet in the store
        self._events_at = time.monotonic()
        self._rows: list[Any] = []
        if self.study.resume_study:
            self._resume()
        else:
            self._create()
        for note in [*self.searcher.notes(), *self.scheduler.notes()]:
            self.say(f"nbdist: note: {note}")

    # -- setting up ----------------------------------------------------------------------
    def _make_scheduler(self) -> Scheduler:
        scheduler = SCHEDULERS.build(scheduler_spec(self.study))
        scheduler.bind(
            Setting(
                epochs=self.train.epochs,
                groups=self.executor.groups,
                trials=self.study.trials,
                space=self.searcher.space,
                maximize=self.maximize,
                seed=self.train.seed,
                objectives=len(self.objectives),
                in_process=self.executor.in_process,
                changeable=lambda name: changeable(name, self.train),
                changeable_help=CHANGEABLE_HELP,
            )
        )
        return scheduler

    def _check_objectives(self) -> None:
        if len(self.objectives) > 1 and not self.searcher.multi_objective:
            raise StudyError(
                f"searcher {self.searcher.name} optimises one objective; a study of {len(self.objectives)} "
                f"({', '.join(self.objectives)}) needs one that takes several: random, grid or "
                f"optuna(sampler=nsga2|tpe|...)"
            )

    def _create(self) -> None:
        self.searcher = make_searcher(
            self.study.searcher,
            self.study.space,
            direction=self.directions[0],
            seed=self.train.seed,
            trials=self.study.trials,
        )
        if len(self.directions) > 1 and hasattr(self.searcher, "use_directions"):
            self.searcher.use_directions(self.directions)
        self._check_objectives()
        self.scheduler = self._make_scheduler()
        if self.store is not None:
            # One INSERT decides which of two jobs starting the same study at once creates it,
            # and writes the searcher's state with it: a job that joins with --resume-study
            # as soon as the study is in the store finds a state to resume from.
            if not self.store.create_study(
                self.name,
                searcher=self.study.searcher,
                space=str(self.searcher.space),
                options={"study": self.study.to_dict(), "train": self.train.to_dict(), **self._layout()},
                objective=self.study.objective,
                direction=self.study.direction or ",".join(self.directions),
                searcher_state=self._state(),
            ):
                raise StudyError(
                    f"the store {self.store.label} has a study named {self.name!r} already: continue "
                    f"it (or join the jobs that run it) with --resume-study {self.name}, or give "
                    f"another --study-name"
                )
            self.store.join_study(self.name, self.job)

    def _layout(self) -> dict[str, Any]:
        """The groups' MPI ranks, for the study's dashboard (none for an in-process study)."""
        layout = self.executor.layout
        return {} if layout is None else {"layout": layout.to_dict()}

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
            self.spent = sum(t.epochs or 0 for t in rows if t.state != "running")
            others = self.store.live_jobs(self.name) - {self.job}
            # Points handed out and never recorded as trials (a store from before trial rows
            # were written with the ask): trained under new numbers.
            recorded = {self.searcher.space.key(t.asked or t.params) for t in self._trials_of(rows, "running")}
            number = max((t.number for t in rows), default=-1) + 1
            for params in self.searcher.pending:
                if self.searcher.space.key(params) not in recorded:
                    self.store.record_trial(self.name, number, params=dict(params), state="running", owner=self.job)
                    self.fresh.append(Trial(number, dict(params), None, asked=dict(params)))
                    number += 1
            recovered = self._adopt_orphans()
        also = f"; {len(others)} other job(s) run it too" if others else ""
        self.say(
            f"nbdist: resuming study {self.name}: {len(self.results)} trials finished, {len(self.paused)} paused, "
            f"{len(recovered)} recovered from their runs, {len(self.requeue) + len(self.fresh)} to train again{also}"
        )
        for slot, finished in recovered:
            self._on_finished(slot, finished)  # type: ignore[attr-defined]

    @property
    def scheduler_text(self) -> str:
        return f"scheduler {scheduler_spec(self.study)}"

    # -- the searcher's and the scheduler's state ----------------------------------------
    def _state(self) -> dict[str, Any]:
        """What the store keeps of the searcher and the scheduler, to resume them."""
        return {"searcher": self.searcher.state(), "scheduler": self.scheduler.state()}

    def _save_state(self) -> None:
        if self.store is not None:
            self.store.save_searcher_state(self.name, self._state())

    def _load_state(self) -> None:
        """The study's searcher and scheduler as the store has them (inside its lock)."""
        if self.store is None:
            return
        state = self.store.study(self.name).get("searcher_state") or {}
        if "searcher" not in state:
            raise StudyError(f"study {self.name!r} has no saved searcher state: it cannot be resumed")
        self.searcher = restore_searcher(state["searcher"])
        if not hasattr(self, "scheduler"):
            self.scheduler = self._make_scheduler()
        saved = state.get("scheduler")
        if saved is None and state.get("pruner"):  # a study from before schedulers: its median pruner's
            saved = {"finished": state["pruner"]}
        self.scheduler.load_state(saved or {})

    # -- the store's rows ----------------------------------------------------------------
    def _row(self, t: Any) -> dict[str, Any]:
        return {
            "number": t.number,
            "params": t.params,
            "state": t.state,
            "fom": t.fom,
            "fom_std": t.fom_std,
            "folds": t.folds,
            "generation": t.generation,
            "error": t.error,
            "epochs": t.epochs,
            "values": t.values,
            "goal_reached": t.goal_reached,
        }

    def _refresh_results(self, rows: list[Any]) -> None:
        """The study's finished and paused trials, whichever job trained them."""
        self._rows = rows
        self.results = [self._row(t) for t in rows if t.state not in ("running", "paused")]
        self.paused = {t.number: t for t in self._trials_of(rows, "paused")}

    def _trials_of(self, rows: list[Any], state: str) -> list[Trial]:
        """The rows in `state` as Trials, with their fold runs and the parameters asked."""
        runs = self._runs_by_trial()
        asked = self._asked_params()
        return [
            Trial(
                t.number,
                t.params,
                t.generation,
                group=t.group,
                epochs=t.epochs or 0,
                value=t.fom,
                runs=runs.get(t.number, {}),
                asked=asked.get(t.number, t.params),
            )
            for t in rows
            if t.state == state
        ]

    def _runs_by_trial(self) -> dict[int, dict[int, str]]:
        """trial -> fold -> its latest run's name (a trial trained again gets a -N run)."""
        found: dict[int, dict[int, tuple[float, str]]] = {}
        for run in self.store.runs(study=self.name) if self.store is not None else []:
            tagged = fold_of_run(run.id)
            if tagged is not None:
                then = run.started or 0.0
                if then >= found.setdefault(tagged[0], {}).get(tagged[1], (-1.0, ""))[0]:
                    found[tagged[0]][tagged[1]] = (then, run.id)
        return {n: {f: name for f, (_, name) in folds.items()} for n, folds in found.items()}

    def _asked_params(self) -> dict[int, dict[str, Any]]:
        """What the searcher proposed for trials whose parameters PBT changed since."""
        if self.store is None:
            return {}
        return {e["number"]: e["data"] for e in self.store.trial_events(self.name, kind="asked")}

    def _created(self) -> int:
        """How many trials the study has (every job's)."""
        return max(self.next_number, len(self._rows))

    def _new_number(self) -> int:
        number = max(self.next_number, max((t.number for t in self._rows), default=-1) + 1)
        self.next_number = number + 1
        return number

    # -- writing what happens ------------------------------------------------------------
    def _record_start(self, trial: Trial, segment: Segment, work: Work) -> None:
        """A segment starts (inside the lock): the trial's row, and the segment as an event
        (a resumed study goes on from it)."""
        if trial.asked is not None and not trial.epochs and work.trial is None:
            self._events.append((trial.number, "asked", 0, dict(trial.asked)))
            self._events.append((trial.number, "params", 0, dict(trial.params)))
        self._events.append((trial.number, "segment", segment.start, segment.to_dict()))
        if self.store is None:
            self._events.clear()
            return
        self.store.record_trial(
            self.name,
            trial.number,
            params=trial.params,
            state="running",
            generation=trial.generation,
            group=trial.group,
            started=trial.started,
            owner=self.job,
            epochs=trial.epochs,
        )
        self._flush_events()

    def _settled_row(self, trial: Trial, settled: Settled) -> dict[str, Any]:
        return {
            "number": trial.number,
            "params": trial.params,
            "state": settled.state,
            "fom": settled.fom,
            "fom_std": settled.fom_std,
            "folds": settled.folds,
            "generation": trial.generation,
            "error": settled.error,
            "epochs": settled.epochs,
            "values": settled.values,
            "goal_reached": bool(self.goal and settled.means and self.goal.reached(settled.means)),
        }

    def _record_end(self, trial: Trial, group: int | None, settled: Settled, row: dict[str, Any]) -> None:
        if settled.state in ("paused", "pruned", "stopped"):
            self._events.append((trial.number, settled.state, settled.epochs, {"value": settled.fom}))
        if self.store is None:
            self._events.clear()
            return
        self.store.record_trial(
            self.name,
            trial.number,
            params=trial.params,
            state=settled.state,
            fom=settled.fom,
            fom_std=settled.fom_std,
            folds=settled.folds,
            generation=trial.generation,
            group=group,
            error=settled.error,
            started=trial.started,
            ended=None if settled.outcome == PAUSED else time.time(),
            goal_reached=row["goal_reached"],
            epochs=settled.epochs,
            values=settled.values,
        )
        self._flush_events()

    def _flush_events(self, due: bool = False) -> None:
        """The trials' events into the store (at once, or every EVENTS_EVERY s when `due`)."""
        if self.store is None:
            self._events.clear()
            return
        if not self._events or (due and time.monotonic() - self._events_at < 1.0):
            return
        events, self._events = self._events, []
        self._events_at = time.monotonic()
        self.store.record_trial_events(self.name, events)

    def _finish_paused(self) -> None:
        """The study is over: trials still paused at a rung end there, 'stopped' with their
        value (they were told to the searcher so when they paused). In a shared study the
        last job out does it."""
        with self._locked():
            if self.store is not None:
                if self.store.live_jobs(self.name) - {self.job}:
                    return
                self._refresh_results(self.store.trials(self.name))
            if self.paused:
                numbers = ", ".join(str(n) for n in sorted(self.paused))
                self.say(f"nbdist: trial(s) {numbers} end where they paused, never promoted (stopped)")
            for trial in sorted(self.paused.values(), key=lambda t: t.number):
                settled = Settled(STOPPED, "stopped", trial.epochs, fom=trial.value)
                row = self._settled_row(trial, settled)
                self._record_end(trial, trial.group, settled, row)
                self.results.append(row)
            self.paused.clear()
            self._flush_events()

    def _close(self, reason: str) -> None:
        self.executor.close()
        if self.store is not None:
            self.store.leave_study(self.name, self.job)
            # The study goes on while another job runs it; the last one out ends it.
            if not self.store.live_jobs(self.name):
                status = "completed" if reason and not self.stopping else "interrupted"
                self.store.end_study(self.name, "failed" if self.failure else status)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The study's lock, when it is in a store (a transaction: what is written in it
        is written together)."""
        if self.store is None:
            yield
        else:
            with self.store.coordinate(self.name):
                yield
