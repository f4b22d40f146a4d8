"""A study from a notebook: the kernel coordinates, the cluster's engines form the groups.

    study = nbdist.study(build_model, space="lr=log(1e-4,1e-1) hidden=int(16,256)", cluster=cluster,
                         searcher="bayes", trials=20, groups=2, folds=2, workers=1)
    study.trials          # a DataFrame, growing while it runs
    study.wait(); study.best_params
    study.dashboard()     # history, importances, learning curves, ..., live

The engines split into their groups' and folds' communicators once (engine.open_study);
each trial is then a job on its group's engines only (a `Job` with those engines), so
the groups train different trials at the same time, each streaming its records to the
notebook, and a prune or a failure is signalled to that group alone.
"""

from __future__ import annotations

import html
import threading
import time
from typing import Any

from nbdist.hpo.runner import (
    EpochReport,
    FoldOutcome,
    StudyResult,
    StudyRunner,
    TrialExecutor,
    TrialFinished,
    furthest_words,
    new_study_name,
)
from nbdist.hpo.trial import Segment, Trial, fold_of_run, trial_options
from nbdist.job import JobError, wait_interruptibly
from nbdist.layout import Layout
from nbdist.options import StudyOptions, TrainOptions

__all__ = ["EngineGroups", "Study"]

CLOSE_SECONDS = 30.0


class EngineGroups(TrialExecutor):
    def __init__(
        self,
        cluster: Any,
        layout: Layout,
        study: str,
        train: TrainOptions,
        options: StudyOptions,
        store: str | None,
        what: dict[str, Any],
    ):
        from nbdist import engine

        self.cluster, self.layout, self.study = cluster, layout, study
        self.train, self.options, self.store, self.what = train, options, store, what
        self.groups = layout.groups
        self.engines = [
            [cluster.engine_of(r) for f in range(layout.folds) for r in layout.fold_ranks(g, f)]
            for g in range(layout.groups)
        ]
        self.run_layout = Layout.for_world(
            layout.ranks_per_run,
            workers=train.workers,
            masters=train.masters,
            procs_per_worker=train.procs_per_worker,
            topology=train.topology,
        ).to_dict()
        self.jobs: dict[int, tuple[Any, Trial, int]] = {}  # group -> (job, trial, records read)
        cluster.view.apply_sync(engine.open_study, study, layout.to_dict())

    def start(self, group: int, trial: Trial, segment: Segment) -> None:
        from nbdist import engine
        from nbdist.job import Job

        # A dead engine ends the study at once (the trial stays to train on --resume-study),
        # instead of failing every trial given to its group.
        self.cluster.check_alive(engines=self.engines[group])
        view = self.cluster.client[self.engines[group]]
        result = view.apply_async(
            engine.run_trial,
            self.study,
            trial.number,
            trial.params,
            self.train.to_dict(),
            self.options.to_dict(),
            segment=segment.to_dict(),
            **self.what,
        )
        job = Job(
            self.cluster,
            result,
            trial_options(self.train, trial.params),
            layout=self.run_layout,
            store=self.store,
            show_progress=False,
            engines=self.engines[group],
            study=self.study,
        )
        self.jobs[group] = (job, trial, 0)

    def poll(self, timeout: float) -> list[EpochReport | TrialFinished]:
        deadline = time.monotonic() + timeout
        while True:
            events: list[EpochReport | TrialFinished] = []
            for group, (job, trial, read) in list(self.jobs.items()):
                job.live.poll()
                records, read = job.live.since(read)
                for record in records:
                    tagged = fold_of_run(record["run"]) if record["kind"] == "epoch" else None
                    if tagged is not None:
                        events.append(EpochReport(trial.number, tagged[1], record["epoch"], record["values"]))
                self.jobs[group] = (job, trial, read)
                if job.done:
                    del self.jobs[group]
                    events.append(TrialFinished(trial.number, self._folds(group, job)))
            if events or time.monotonic() > deadline:
                return events
            time.sleep(0.05)

    def _folds(self, group: int, job: Any) -> dict[int, FoldOutcome]:
        """Each fold's outcome from its ranks': the leader's result, the first error of any."""
        folds = {f: FoldOutcome() for f in range(self.layout.folds)}
        for outcome in job.outcomes:
            role = self.layout.role(outcome.rank) if outcome.rank >= 0 else None
            if role is None or role.fold is None:
                continue
            fold = folds[role.fold]
            result = outcome.result
            if isinstance(result, FoldOutcome) and result.final is not None:
                error = fold.error
                folds[role.fold] = fold = result
                fold.error = error or result.error
            error = outcome.error if not outcome.abandoned else None
            error = error or (result.error if isinstance(result, FoldOutcome) else None)
            if error and not fold.error:
                fold.error = error
                fold.ends_study = isinstance(result, FoldOutcome) and result.ends_study
        if job.error is not None:
            for fold in folds.values():
                fold.error = fold.error or str(job.error)
        return folds

    def stop(self, group: int, reason: str) -> None:
        """A signal: the trial's runs stop at their next step boundary (a notebook's engines
        take no message while they train)."""
        import signal

        if group in self.jobs:
            self.cluster.signal(signal.SIGUSR1, engines=self.engines[group])

    def close(self) -> None:
        from nbdist import engine

        for group, (job, _, _) in list(self.jobs.items()):
            try:
                job.stop()
            except JobError as exc:  # ranks left behind: the cluster now counts them as dead
                print(f"nbdist: trial on group {group}: {exc}", flush=True)
        self.jobs.clear()
        dead = {d.engine_id for d in self.cluster.dead_engines(ping=False)}
        live = [i.engine_id for i in self.cluster.info if i.engine_id not in dead]
        if live:
            # Bounded: the study's end must not hang on an engine that cannot answer.
            self.cluster.client[live].apply_async(engine.close_study, self.study).wait(CLOSE_SECONDS)


class Study:
    """A hyper-parameter study running on a notebook's cluster.

    `nbdist.study(..., cluster=...)` and `%%distnn study` return one at once. The
    coordinator runs on a thread of the kernel: it asks the searcher for parameters,
    trains each trial's folds on a group of engines (the cluster's engines are cut into
    `groups` x `folds` runs), tells the searcher each trial's figure of merit and records
    everything in the run store, so that `--resume-study` can continue it.

    Args:
        cluster: The `nbdist.Cluster` whose engines train the trials.
        options: The study's validated `StudyOptions`.
        train: The `TrainOptions` every trial trains with (its parameters override the
            options they name).
        what: The model, loss, metric and data (or the cell) every engine builds from.
        store: The run store the study is recorded in (None: not recorded).
        show_progress: Show a live line per trial under the cell.

    Raises:
        UserError: One clear error for what is wrong before any engine trains: a bad
            option or space (`OptionsError`, `TrialError`), a cluster whose engines do
            not make `groups` x `folds` runs (`LayoutError`), a dead engine
            (`ClusterError`).

    Example:
        In a notebook, with a started cluster of 2 engines (see `nbdist.Cluster`)::

            def build_model(params):  # runs on every engine
                from torch import nn

                return nn.Sequential(nn.Linear(64, params["hidden"]), nn.ReLU(),
                                     nn.Linear(params["hidden"], 10))

            study = nbdist.study(build_model, cluster=cluster, trials=4, groups=2,
                                 space="lr=log(1e-3,0.3) hidden=int(16,128)",
                                 topology="allreduce", workers=1, epochs=2)
            study.trials             # finished trials so far, live
            study.wait()
            study.best_params, study.best_fom
    """

    def __init__(
        self,
        cluster: Any,
        options: StudyOptions,
        train: TrainOptions,
        *,
        what: dict[str, Any],
        store: str | None,
        show_progress: bool = True,
    ):
        from nbdist.hpo.reads import check_space_is_read
        from nbdist.hpo.trial import check_study
        from nbdist.train.definition import definition_of

        check_study(options, train)
        if what.get("model") is not None:  # a cell's names are the engines': its trials report them
            model = definition_of(what["model"], loss=what.get("loss"), metric=what.get("metric", "accuracy"))
            check_space_is_read(options, train, model)
        cluster.check_alive()
        self.options, self.train, self.store = options, train, store
        self.layout = Layout.for_world(
            cluster.n,
            workers=train.workers,
            masters=train.masters,
            procs_per_worker=train.procs_per_worker,
            topology=train.topology,
            groups=options.groups,
            folds=options.folds,
        )
        self.lines: list[str] = []
        self._display: _Lines | None = None
        self.name = options.resume_study or new_study_name(options)
        if not options.resume_study:
            options = self.options = options.replace(study_name=self.name)
        executor = EngineGroups(cluster, self.layout, self.name, train, options, store, what)
        try:
            self.runner = StudyRunner(options, train, executor, store, self._say)
        except BaseException:
            executor.close()
            raise
        self.started = time.time()
        self._result: StudyResult | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._display = _Lines.under_the_cell(self) if show_progress else None
        self._thread = threading.Thread(target=self._run, name="nbdist-study", daemon=True)
        self._thread.start()

    def _say(self, line: str) -> None:
        self.lines.append(line)
        if self._display is not None:
            self._display.update()
        else:
            print(line, flush=True)

    def _run(self) -> None:
        try:
            self._result = self.runner.run()
        except BaseException as exc:  # reported by wait()/result
            self._error = exc
        finally:
            self._done.set()
            if self._display is not None:
                self._display.update()

    # -- state ---------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def status(self) -> str:
        if not self.done:
            return "stopping" if self.runner.stopping else "running"
        if self._error is not None:
            return "failed"
        return "stopped" if self.runner.stopping else "completed"

    @property
    def result(self) -> StudyResult | None:
        if self._error is not None:
            raise self._error
        return self._result

    @property
    def trials(self) -> Any:
        """Every finished trial: its parameters, figure of merit (mean over folds), its
        spread over the folds, state (complete, pruned, stopped, failed), generation, the
        epochs it trained and, in a multi-objective study, its values."""
        import pandas as pd

        rows = [
            {
                "trial": r["number"],
                **r["params"],
                "fom": r["fom"],
                "fom_std": r["fom_std"],
                "state": r["state"],
                "generation": r["generation"],
                "epochs": r.get("epochs"),
                **({"values": r["values"]} if r.get("values") is not None else {}),
                "error": r["error"],
            }
            for r in list(self.runner.results)
        ]
        frame = pd.DataFrame(rows)
        return frame.sort_values("trial").reset_index(drop=True) if not frame.empty else frame

    @property
    def best_params(self) -> dict[str, Any] | None:
        best = self.runner.best()
        return best[2] if best else None

    @property
    def pareto(self) -> list[dict[str, Any]]:
        """A multi-objective study's Pareto front so far: the complete trials no other beats
        in every objective (empty for one objective)."""
        return self.runner.pareto()

    @property
    def best_fom(self) -> float | None:
        best = self.runner.best()
        return best[1] if best else None

    @property
    def furthest(self) -> dict[str, Any] | None:
        """With no trial complete, the one the scheduler took furthest (`StudyResult.furthest`)."""
        return self.runner.furthest()

    # -- control -------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> Study:
        """Block until the study ends; an interrupt stops it instead (`--resume-study`
        continues it).

        Args:
            timeout: Seconds to wait at most (None: until the study ends).

        Returns:
            The study itself, ended (`trials`, `best_params`, `best_fom`, `result`).

        Raises:
            TimeoutError: `timeout` seconds passed first; the study goes on.
        """
        try:
            if not wait_interruptibly(self._done, timeout):
                raise TimeoutError(f"the study is still {self.status} after {timeout} s")
        except KeyboardInterrupt:
            self.stop()
            print(f"nbdist: interrupted; study {self.name} stopped (continue it with --resume-study {self.name})")
            return self
        if self._error is not None:
            raise self._error
        return self

    def stop(self, timeout: float = 60.0) -> Study:
        """Stop the running trials at their next step boundary and end the study.

        Args:
            timeout: Seconds to wait for the study to end.

        Returns:
            The study itself, stopped.

        Raises:
            TimeoutError: The study did not end within `timeout` seconds.
        """
        self.runner.stop("stopped")
        if not self._done.wait(timeout):
            raise TimeoutError(f"the study did not stop within {timeout} s")
        return self

    def dashboard(self, period_ms: int = 1000) -> Any:
        """The study's live dashboard (nbdist.dashboard.study): optimisation history,
        parallel coordinates, slice, contour, parameter importances, learning curves with
        pruned and promoted trials marked, the Pareto front of several objectives, a PBT
        population's lineage and schedules, the trial table with each trial's runs, notes.

        Args:
            period_ms: How often the page reads the store's new rows, in milliseconds.

        Returns:
            A servable Panel layout, live under the cell.

        Raises:
            ValueError: The study is not recorded in a run store (`store="off"`).
        """
        from nbdist.dashboard import dashboard

        if self.store is None:
            raise ValueError("the study is not recorded in a run store (--store off): it has no dashboard")
        return dashboard(self.store, study=self.name, period_ms=period_ms, runs=False).servable()

    def __repr__(self) -> str:
        best = f", best {self.options.objective} {self.best_fom:.4g}" if self.best_fom is not None else ""
        if not best and (far := self.furthest) is not None:  # looked for only where no best
            best = f", none complete ({furthest_words(far)})"
        return (
            f"<nbdist.Study {self.name} {self.status}: {len(self.runner.results)}/{self.options.trials} trials{best}>"
        )

    def _repr_html_(self) -> str:
        return f"<code>{html.escape(repr(self))}</code>"


class _Lines:
    """The study's lines under the cell, updated as trials end (in a kernel; a terminal
    gets them printed as they come)."""

    def __init__(self, study: Study, handle: Any):
        self.study, self.handle = study, handle

    @classmethod
    def under_the_cell(cls, study: Study) -> _Lines | None:
        try:
            from IPython import get_ipython
            from IPython.display import display
        except ImportError:
            return None
        shell = get_ipython()
        if shell is None or type(shell).__name__ != "ZMQInteractiveShell":
            return None
        lines = cls(study, None)
        lines.handle = display(lines, display_id=True)
        return lines

    def update(self) -> None:
        self.handle.update(self)

    def __repr__(self) -> str:
        return "\n".join([repr(self.study), *self.study.lines[-12:]])


def study_on_cluster(
    cluster: Any,
    options: StudyOptions,
    train: TrainOptions,
    *,
    store: str | None,
    show_progress: bool = True,
    **what: Any,
) -> Study:
    return Study(cluster, options, train, what=what, store=store, show_progress=show_progress)
