"""The handle of a training running on a notebook's cluster.

    job = nbdist.train(build_model, cluster=cluster)    # returns at once
    job.status, job.history                             # live, while it trains
    job.wait(); job.result                              # final metrics, weights path
    job.stop()                                          # every rank stops at a step boundary

A monitor thread on the client polls the records the ranks stream in, records them in
the run store (the notebook is a notebook job's one store writer), keeps the progress
line under the cell up to date, and watches for a rank that failed, or an engine that
died, while the others still train. Nothing waits forever: after a failure (or a stop
request that the ranks did not follow in time) the ranks are told to give up (SIGUSR2);
ranks still running `ABANDON_SECONDS` later are left behind, the job fails naming them,
and the cluster counts them as dead until it is healed (`%distnn cluster start`).
"""

from __future__ import annotations

import html
import signal
import threading
import time
from pathlib import Path
from typing import Any

from nbdist.cluster import HEAL_HINT
from nbdist.engine import LIVE_PREFIX, EngineOutcome
from nbdist.job_failures import JobError, remote_text, run_ending, unwrap, verdict
from nbdist.job_progress import ProgressLine
from nbdist.liveness import DeadEngine
from nbdist.metrics.collect import LiveRecords
from nbdist.metrics.frames import epochs_frame, history_frame, staleness_frame
from nbdist.metrics.record import stopped_on_request
from nbdist.options import TrainOptions
from nbdist.store import RunFeed, store_label

__all__ = ["Job", "JobError"]

POLL_SECONDS = 0.25
# After one rank failed, how long the others get to end on their own (the core reports
# the failures it sees, a NaN loss, a worker's error, to the other ranks) before the
# client makes them give up with SIGUSR2.
FAILURE_GRACE_SECONDS = 3.0
# After SIGUSR2, how long the ranks get before the job leaves them behind: a rank that
# still runs then is blocked where no signal reaches it (a blocking MPI call, the model's
# own code), and only a restart of its engine frees it.
ABANDON_SECONDS = 10.0

# How often a blocking wait wakes to let the main thread see a Ctrl-C. A SIGINT that a
# thread other than the main one takes (Linux gives a process's signal to another thread
# when the main one already has one pending; signal.pthread_kill) leaves a main thread
# asleep on a lock with no timeout until the lock is released: the whole job. A timed wait
# returns to the interpreter, which raises KeyboardInterrupt.
INTERRUPT_CHECK_SECONDS = 0.2


def wait_interruptibly(done: threading.Event, timeout: float | None) -> bool:
    """`done.wait(timeout)`, woken every INTERRUPT_CHECK_SECONDS so that KeyboardInterrupt
    is raised within that time of a Ctrl-C; whether `done` was set."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = (
            INTERRUPT_CHECK_SECONDS if deadline is None else min(INTERRUPT_CHECK_SECONDS, deadline - time.monotonic())
        )
        if left <= 0:
            return done.is_set()
        if done.wait(left):
            return True


class Job:
    """The notebook's handle on a training running on a cluster's engines.

    `nbdist.train(..., cluster=...)` and `%%distnn train` return one at once; it follows
    the ranks' live records (`history`, `epochs`, `staleness`, `dashboard()`), records
    them in the run store, and stops (`stop()`) or waits for (`wait()`) the training.
    Nothing it does blocks without a deadline.

    Args:
        cluster: The `nbdist.Cluster` whose engines train.
        async_result: ipyparallel's result of the training task on the engines.
        options: The run's validated `TrainOptions`.
        layout: The run's rank layout (`Layout.to_dict()`).
        store: The run store the job is recorded in (None: not recorded).
        show_progress: Show a live progress line under the cell.
        engines: The engine ids the job runs on when not the whole cluster (a study's
            trial on one group): stops and give-ups are then signalled to those only.
        study: The study a trial job's runs belong to, for the store.

    Example:
        In a notebook, with a started cluster (see `nbdist.Cluster`)::

            job = nbdist.train(build_model, cluster=cluster, epochs=10)
            job.epochs               # per-epoch metrics so far, live
            job.wait(timeout=600)    # or job.stop(): every rank stops at a step boundary
            job.status, job.result.final, job.result.weights_path
    """

    def __init__(
        self,
        cluster: Any,
        async_result: Any,
        options: TrainOptions,
        *,
        layout: dict[str, Any],
        store: str | None = None,
        show_progress: bool = True,
        engines: list[int] | None = None,
        study: str | None = None,
    ):
        self.cluster = cluster
        self.options = options
        self.layout = layout
        self.store = store  # the run store file this job is recorded in (None: not recorded)
        self.engines = engines
        self.study = study
        self._result = async_result
        self.live = LiveRecords(async_result, LIVE_PREFIX)
        self._feeds: dict[str, RunFeed] = {}  # run id -> its feed (a trial job trains one run per fold)
        self._stored = 0  # records already written to the store
        self.store_error: str | None = None
        self.started = time.time()
        self.ended: float | None = None
        self._stop_requested = False
        # The rank of each of the job's engines, in the order of the result's children.
        self._engine_ids = list(engines) if engines is not None else [i.engine_id for i in cluster.info]
        self._ranks = [cluster.rank_of(e) for e in self._engine_ids]
        self._abandon_at: float | None = None  # monotonic time to send SIGUSR2, once there is a reason
        self._abandon_why = ""  # the stop request that the ranks did not follow in time, if that is why
        self._abandoned_at: float | None = None
        self._abandon_seconds = ABANDON_SECONDS
        self._gave_up = False
        self._outcomes: list[EngineOutcome] | None = None
        self._error: JobError | None = None
        self.warning = ""  # what went wrong in a job that still ended well (ranks lost, a restart)
        self._done = threading.Event()
        self._progress = ProgressLine(self) if show_progress else None
        self._monitor = threading.Thread(target=self._watch, name="nbdist-job-monitor", daemon=True)
        self._monitor.start()

    # -- state ------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def status(self) -> str:
        """running, stopping, completed, stopped or failed."""
        if not self.done:
            return "stopping" if self._stop_requested else "running"
        if self._error is not None:
            return "failed"
        result = self.result
        return "stopped" if result is not None and stopped_on_request(result.stop_reason) else "completed"

    @property
    def result(self) -> Any:
        """The RunResult of the run's leader (run_dir, final metrics, weights_path);
        None while running. Raises the job's error if it failed."""
        if not self.done:
            return None
        if self._error is not None:
            raise self._error
        return next((o.result for o in self._outcomes or [] if o.result is not None), None)

    @property
    def error(self) -> JobError | None:
        return self._error

    @property
    def outcomes(self) -> list[EngineOutcome]:
        """Each rank's outcome, in rank order, once the job is done (empty before)."""
        return list(self._outcomes or [])

    @property
    def run_id(self) -> str | None:
        """The run's name (its directory's name), once the first record has arrived."""
        records = self.live.records
        return records[0]["run"] if records else None

    @property
    def records(self) -> list[dict[str, Any]]:
        self.live.poll()
        return list(self.live.records)

    @property
    def history(self) -> Any:
        """Every metric record so far, one row each, as a pandas DataFrame (values flattened
        into columns): kind 'train' (per rank, a few per second), 'updates' (the master's,
        per half second: how many updates it applied per worker rank and their staleness
        histogram; one 'update' record per update with --trace-updates), 'epoch' (the
        run's, with validation), 'val' (--validate-every-samples: a validation after
        samples_seen samples), 'phase' and 'run'."""
        return history_frame(self.records)

    @property
    def staleness(self) -> Any:
        """The staleness of the updates the master applied, per worker rank (a DataFrame:
        rank, updates, mean, min, max; empty for allreduce, which has no master)."""
        return staleness_frame(self.records)

    @property
    def epochs(self) -> Any:
        """The run's per-epoch metrics (train and validation loss, accuracy, throughput), one
        row per epoch: after a restart (--max-restarts) the epochs trained again from the last
        checkpoint replace the ones first reported (every record stays in .history)."""
        return epochs_frame(self.records)

    def dashboard(self, period_ms: int = 1000) -> Any:
        """The live dashboard of this job (Panel): displayed under the cell, it updates
        while the job trains. Panel and HoloViews are imported only here.

        Args:
            period_ms: How often the plots take the new records, in milliseconds.

        Returns:
            A servable Panel layout: the last expression of a cell, or `panel serve`.
        """
        from nbdist.dashboard import dashboard

        return dashboard(job=self, period_ms=period_ms).servable()

    # -- control ----------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> Job:
        """Block until the job ends; an interrupt (Ctrl-C, the kernel's stop button) stops
        it instead. A failed rank or a dead engine ends the job within
        FAILURE_GRACE_SECONDS + ABANDON_SECONDS.

        Args:
            timeout: Seconds to wait at most (None: until the job ends).

        Returns:
            The job itself, ended (`status`, `result`).

        Raises:
            JobError: The job failed: one error naming the rank that failed first.
            TimeoutError: `timeout` seconds passed first; the job goes on.
        """
        try:
            if not wait_interruptibly(self._done, timeout):
                raise TimeoutError(f"the job is still {self.status} after {timeout} s")
        except KeyboardInterrupt:
            try:
                self.stop()
            finally:
                print(
                    f"nbdist: interrupted; the job {self.status}"
                    + (f": {self.result.stop_reason}" if self.status == "stopped" else ""),
                    flush=True,
                )
            return self
        if self._error is not None:
            raise self._error
        return self

    def stop(self, timeout: float = 30.0, abandon_timeout: float = ABANDON_SECONDS) -> Job:
        """Ask every rank to stop at its next step boundary (a final checkpoint is written
        when checkpointing is on) and wait for them. It never waits much longer than the
        two timeouts together.

        Args:
            timeout: Seconds the ranks have to stop before they are told to give up
                (SIGUSR2, no checkpoint).
            abandon_timeout: Seconds after that before ranks still running are left
                behind.

        Returns:
            The job itself, ended (its `status` is `stopped`).

        Raises:
            JobError: Ranks were left behind: the error names them and says that the
                cluster needs a restart.
        """
        if not self.done:
            if not self._stop_requested:
                self._stop_requested = True
                self._signal(signal.SIGUSR1)
            self._abandon_seconds = abandon_timeout
            self._abandon_by(
                time.monotonic() + timeout, f"did not stop within {timeout:g} s of the stop request (SIGUSR1)"
            )
            # The monitor thread ends the job by then, whatever the ranks do.
            if not self._done.wait(timeout + abandon_timeout + 10 * POLL_SECONDS + 5.0):
                raise JobError(
                    f"the job did not end within {timeout + abandon_timeout:g} s of the stop request; {HEAL_HINT}"
                )
        if self._error is not None and self._abandon_why:
            raise self._error
        return self

    def __repr__(self) -> str:
        text = f"<nbdist.Job {self.options.topology} {self.status}"
        if self.done and self._error is None and self.result is not None:
            text += f", {self.result.stop_reason}, run {self.result.run_dir}"
        elif self._error is not None:
            text += f": {self._error}"
        return text + ">"

    def _repr_html_(self) -> str:
        return f"<code>{html.escape(repr(self))}</code>"

    # -- monitor thread ---------------------------------------------------------------
    def _watch(self) -> None:
        try:
            while not self._result.ready() and not self._gave_up:
                self.live.poll()
                self._record_in_store()
                self._escalate()
                if self._progress:
                    self._progress.update()
                time.sleep(POLL_SECONDS)
            if not self._gave_up and not self.cluster.dead_engines(ping=False, engines=self._engine_ids):
                # The records travel on another channel than the result: wait until the
                # engines' last published batches are in, so history ends with the last epoch
                # (a dead engine sends nothing more).
                self._result.wait_for_output(10)
            self._finish()
        except Exception as exc:  # never die silently: the job reports it
            self._error = self._error or JobError(f"the job's monitor failed: {type(exc).__name__}: {exc}")
        finally:
            self.ended = time.time()
            self.live.poll()
            self._record_in_store(final=True)
            self._done.set()
            if self._progress:
                self._progress.update(final=True)

    def _signal(self, signum: int) -> None:
        try:
            self.cluster.signal(signum, engines=self.engines)
        except Exception as exc:  # the escalation goes on without this signal
            print(
                f"nbdist: could not signal the job's ranks ({signal.Signals(signum).name}): "
                f"{type(exc).__name__}: {exc}",
                flush=True,
            )

    def _abandon_by(self, when: float, why: str = "") -> None:
        """SIGUSR2 at `when` (monotonic) unless the job has ended or an earlier one is due."""
        if self._abandon_at is None or when < self._abandon_at:
            self._abandon_at = when
            self._abandon_why = why

    def _escalate(self) -> None:
        """A failed rank or a dead engine: the others get FAILURE_GRACE_SECONDS to end on
        their own, then SIGUSR2 (give up), then ABANDON_SECONDS before the job leaves them."""
        now = time.monotonic()
        if self._abandon_at is None and self._failed():
            # A rank failed outside the paths the core reports on, or its engine died:
            # the others may be waiting for its next message, forever.
            self._abandon_by(now + FAILURE_GRACE_SECONDS)
        if self._abandon_at is not None and self._abandoned_at is None and now >= self._abandon_at:
            self._abandoned_at = now
            self._signal(signal.SIGUSR2)
        if self._abandoned_at is not None and now >= self._abandoned_at + self._abandon_seconds:
            self._gave_up = True

    def _failed(self) -> bool:
        # With MPI fault tolerance on, the ranks left learn of a dead rank themselves and go
        # on without it, restart or end with one error, each within its deadlines: a dead
        # engine is theirs to handle. Without, they would wait for it forever.
        dead = {d.engine_id for d in self.cluster.dead_engines(ping=False, engines=self._engine_ids)}
        if dead and not all(i.fault_tolerant for i in self.cluster.info):
            return True
        for child, engine_id in zip(self._result._children, self._engine_ids, strict=True):
            if child.done() and engine_id not in dead:
                value = child.exception() or unwrap(child.result())
                if not isinstance(value, EngineOutcome) or value.error:
                    return True
        return False

    def _record_in_store(self, final: bool = False) -> None:
        """New records into the store, each run's to its own row; at the end, how each
        run ended. A store that fails is reported on the job and never stops the training."""
        if self.store is None or self.store_error is not None:
            return
        try:
            new, self._stored = self.live.since(self._stored)
            by_run: dict[str, list[dict[str, Any]]] = {}
            for record in new:
                by_run.setdefault(record["run"], []).append(record)
            for run_id, batch in by_run.items():
                if run_id not in self._feeds:
                    run_dir = Path(self.options.resume or Path(self.options.runs_dir) / run_id)
                    self._feeds[run_id] = RunFeed(
                        self.store,
                        run_id,
                        run_dir,
                        options=self.options.to_dict(),
                        layout=self.layout,
                        study=self.study,
                        trial=batch[0]["trial"],
                    )
                self._feeds[run_id].add(batch)
            if final:
                for run_id, feed in self._feeds.items():
                    feed.end(*run_ending(self._error, self._outcomes, run_id))
        except Exception as exc:  # the training matters more than its record
            self.store_error = f"{type(exc).__name__}: {exc}"
            print(
                f"nbdist: the run store {store_label(self.store)} failed, the job goes on unrecorded: "
                f"{self.store_error}",
                flush=True,
            )

    def _finish(self) -> None:
        lost = {d.engine_id: d for d in self.cluster.dead_engines(ping=False, engines=self._engine_ids)}
        outcomes: list[EngineOutcome] = []
        dead: dict[int, DeadEngine] = {}
        stuck: list[int] = []
        for index, child in enumerate(self._result._children):
            rank, engine_id = self._ranks[index], self._engine_ids[index]
            value = (child.exception() or unwrap(child.result())) if child.done() else None
            if isinstance(value, EngineOutcome):
                pass
            elif engine_id in lost:
                dead[rank] = lost[engine_id]
                value = EngineOutcome(rank, error=f"died: {lost[engine_id].why}", failed_at=lost[engine_id].since)
            elif not child.done():
                stuck.append(engine_id)
                value = EngineOutcome(rank, error="still running")
            else:
                # Raised outside run_training: the call never reached the rank's code
                # (e.g. a function the engine cannot unpickle).
                value = EngineOutcome(rank, error=remote_text(value))
            outcomes.append(value)
        self._outcomes = outcomes
        stuck_ranks = [self._ranks[self._engine_ids.index(e)] for e in stuck]
        if stuck:
            self.cluster.mark_stuck(
                stuck, f"still running a job {self._abandon_seconds:g} s after being told to give up (SIGUSR2)"
            )
        error, warning = verdict(outcomes, dead, stuck_ranks, self._abandon_seconds, self._abandon_why)
        self.warning = warning or ""
        if self.warning:
            print(f"nbdist: {self.warning}", flush=True)
        self._error = error or self._error
