"""The handle of a training running on a notebook's cluster.

    job = nbdist.train(build_model, cluster=cluster)    # returns at once
    job.status, job.history                             # live, while it trains
    job.wait(); job.result                              # final metrics, weights path
    job.stop()                                          # every rank stops at a step boundary

A monitor thread on the client polls the records the ranks stream in, records them in
the run store (the notebook is a notebook job's one store writer), keeps the progress
line under the cell up to date, and watches for a rank that failed while the others
still train (they are then asked to stop, so a failure never leaves a hang).
"""

from __future__ import annotations

import html
import signal
import threading
import time
from pathlib import Path
from typing import Any

from nbdist.engine import LIVE_PREFIX, EngineOutcome
from nbdist.errors import TrainingError
from nbdist.metrics.collect import LiveRecords
from nbdist.options import TrainOptions
from nbdist.store import RunFeed
from nbdist.train.progress import stopped_on_request

__all__ = ["Job", "JobError"]

POLL_SECONDS = 0.25
# After one rank failed, how long the others get to end on their own (the core reports
# the failures it sees, a NaN loss, a worker's error, to the other ranks) before the
# client makes them give up with SIGUSR2.
FAILURE_GRACE_SECONDS = 3.0


class JobError(TrainingError):
    """A job that failed: the message names the rank(s) and what happened there."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail  # a traceback from the rank, for unexpected failures


class Job:
    """`engines`: the engine ids the job runs on when not the whole cluster (a study's
    trial on one group): stops and give-ups are then signalled to those engines only.
    `study`: the study a trial job's runs belong to, for the store."""

    def __init__(self, cluster: Any, async_result: Any, options: TrainOptions, *, layout: dict[str, Any],
                 store: str | None = None, show_progress: bool = True, engines: list[int] | None = None,
                 study: str | None = None):
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
        self._failure_noticed: float | None = None
        self._abandon_sent = False
        self._outcomes: list[EngineOutcome] | None = None
        self._error: JobError | None = None
        self._done = threading.Event()
        self._progress = _Progress(self) if show_progress else None
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
        into columns): kind 'train' (per rank, a few per second), 'update' (the master's,
        with staleness), 'epoch' (the run's, with validation), 'phase' and 'run'."""
        import pandas as pd

        rows = [{**{k: v for k, v in r.items() if k != "values"}, **r["values"]} for r in self.records]
        frame = pd.DataFrame(rows)
        if not frame.empty:
            frame = frame.sort_values("time", kind="stable").reset_index(drop=True)
        return frame

    @property
    def epochs(self) -> Any:
        """The run's per-epoch metrics (train and validation loss, accuracy, throughput)."""
        import pandas as pd

        rows = [r["values"] for r in self.records if r["kind"] == "epoch"]
        return pd.DataFrame(rows)

    def dashboard(self, period_ms: int = 1000) -> Any:
        """The live dashboard of this job (Panel): displayed under the cell, it updates
        while the job trains. Panel and HoloViews are imported only here."""
        from nbdist.dashboard import dashboard

        return dashboard(job=self, period_ms=period_ms).servable()

    # -- control ----------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> "Job":
        """Block until the job ends (KeyboardInterrupt stops it). Raises JobError if it
        failed, TimeoutError if `timeout` seconds pass first."""
        try:
            if not self._done.wait(timeout):
                raise TimeoutError(f"the job is still {self.status} after {timeout} s")
        except KeyboardInterrupt:
            self.stop()
            print(f"nbdist: interrupted; the job {self.status}"
                  + (f": {self.result.stop_reason}" if self.status == "stopped" else ""), flush=True)
            return self
        if self._error is not None:
            raise self._error
        return self

    def stop(self, timeout: float = 30.0) -> "Job":
        """Ask every rank to stop at its next step boundary (a final checkpoint is written
        when checkpointing is on) and wait for them."""
        if not self.done:
            self._stop_requested = True
            self._signal(signal.SIGUSR1)
            if not self._done.wait(timeout):
                raise TimeoutError(f"the ranks did not stop within {timeout} s")
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
            while not self._result.ready():
                self.live.poll()
                self._record_in_store()
                self._check_partial_failure()
                if self._progress:
                    self._progress.update()
                time.sleep(POLL_SECONDS)
            # The records travel on another channel than the result: wait until the
            # engines' last published batches are in, so history ends with the last epoch.
            self._result.wait_for_output(10)
            self._finish()
        except Exception as exc:  # noqa: BLE001 - never die silently: the job reports it
            self._error = self._error or JobError(f"the job's monitor failed: {type(exc).__name__}: {exc}")
        finally:
            self.ended = time.time()
            self.live.poll()
            self._record_in_store(final=True)
            self._done.set()
            if self._progress:
                self._progress.update(final=True)

    def _signal(self, signum: int) -> None:
        self.cluster.signal(signum, engines=self.engines)

    def _record_in_store(self, final: bool = False) -> None:
        """New records into the store, each run's to its own row; at the end, how each
        run ended. A store that fails is reported on the job and never stops the training."""
        if self.store is None or self.store_error is not None:
            return
        records = self.live.records
        try:
            new, self._stored = records[self._stored:], len(records)
            by_run: dict[str, list[dict[str, Any]]] = {}
            for record in new:
                by_run.setdefault(record["run"], []).append(record)
            for run_id, batch in by_run.items():
                if run_id not in self._feeds:
                    run_dir = Path(self.options.resume or Path(self.options.runs_dir) / run_id)
                    self._feeds[run_id] = RunFeed(self.store, run_id, run_dir, options=self.options.to_dict(),
                                                  layout=self.layout, study=self.study, trial=batch[0]["trial"])
                self._feeds[run_id].add(batch)
            if final:
                for run_id, feed in self._feeds.items():
                    feed.end(*self._ending(run_id))
        except Exception as exc:  # noqa: BLE001 - the training matters more than its record
            self.store_error = f"{type(exc).__name__}: {exc}"
            print(f"nbdist: the run store {self.store} failed, the job goes on unrecorded: {self.store_error}",
                  flush=True)

    def _ending(self, run_id: str) -> tuple[str, str | None, dict[str, Any] | None]:
        if self._error is not None:
            return "failed", str(self._error), None
        result = next((o.result for o in self._outcomes or []
                       if o.result is not None and getattr(o.result, "run_id", None) == run_id), None)
        if result is None:
            return "failed", "the job ended without a result", None
        if getattr(result, "error", None):
            return "failed", result.error, None
        return ("stopped" if stopped_on_request(result.stop_reason) else "completed"), result.stop_reason, result.final

    def _finished_outcomes(self) -> list[EngineOutcome]:
        outcomes = []
        for child in getattr(self._result, "_children", []):
            if child.done() and child.exception() is None:
                outcomes.append(_unwrap(child.result()))
        return outcomes

    def _check_partial_failure(self) -> None:
        failed = [o for o in self._finished_outcomes() if not isinstance(o, EngineOutcome) or o.error]
        if not failed or self._abandon_sent:
            return
        now = time.monotonic()
        if self._failure_noticed is None:
            self._failure_noticed = now
        elif now - self._failure_noticed > FAILURE_GRACE_SECONDS:
            # A rank failed outside the paths the core reports on: the others are waiting
            # for its next message and would wait forever.
            self._abandon_sent = True
            self._signal(signal.SIGUSR2)

    def _finish(self) -> None:
        outcomes: list[EngineOutcome] = []
        for rank, child in enumerate(self._result._children):
            value = child.exception() or _unwrap(child.result())
            if not isinstance(value, EngineOutcome):
                # Raised outside run_training: the call never reached the rank's code
                # (e.g. a function the engine cannot unpickle).
                value = EngineOutcome(rank, error=_remote_text(value))
            outcomes.append(value)
        self._outcomes = outcomes
        # The ranks that gave up because of another's failure say nothing new.
        errors = [o for o in outcomes if o.error and not o.abandoned] or [o for o in outcomes if o.error]
        if errors:
            self._error = _one_error(errors, len(outcomes))


def _unwrap(value: Any) -> Any:
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def _remote_text(value: Any) -> str:
    # ipyparallel's RemoteError carries the remote exception's name and value.
    name, text = getattr(value, "ename", None), getattr(value, "evalue", None)
    if name:
        return f"{name}: {text}"
    return f"{type(value).__name__}: {value}"


def _one_error(errors: list[EngineOutcome], ranks_in_job: int) -> JobError:
    """One message for the user: the same error from every rank is said once; different
    ones are said per rank, first the ranks with their own failure."""
    texts: dict[str, list[int]] = {}
    for o in errors:
        texts.setdefault(o.error, []).append(o.rank)
    detail = next((o.detail for o in errors if o.detail), "")
    hint = "; its traceback: job.error.detail" if detail else ""
    if len(texts) == 1:
        (text, ranks), = texts.items()
        if "rank" not in text and not errors[0].user_error:
            # User errors were agreed by all ranks and already say where; name the rest.
            where = "every rank" if len(ranks) == ranks_in_job else f"rank{'s' if len(ranks) > 1 else ''} " + ", ".join(map(str, ranks))
            text = f"{text} (on {where})"
        return JobError(text + hint, detail)
    parts = [f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}: {t}" for t, r in texts.items()]
    return JobError("; ".join(parts[:3]) + hint, detail)


class _Progress:
    """The live line under the cell: epoch, samples/s, loss, validation metric."""

    def __init__(self, job: Job):
        self.job = job
        self.handle = None
        self._last = ""
        try:
            from IPython import get_ipython
            from IPython.display import display

            shell = get_ipython()
            # Only in a kernel (JupyterLab, nbclient): a terminal would print every update.
            if shell is not None and type(shell).__name__ == "ZMQInteractiveShell":
                self.handle = display(self, display_id=True)
        except ImportError:
            pass

    def update(self, final: bool = False) -> None:
        if self.handle is None:
            return
        text = self.summary()
        if text != self._last or final:
            self._last = text
            self.handle.update(self)

    def summary(self) -> dict[str, Any]:
        job = self.job
        records = job.live.records
        epochs = [r["values"] for r in records if r["kind"] == "epoch"]
        latest: dict[int, dict[str, Any]] = {}
        for r in records:
            if r["kind"] == "train":
                latest[r["rank"]] = r["values"]
        speed = sum(v.get("samples_per_s") or 0.0 for v in latest.values())
        losses = [v["loss"] for v in latest.values() if v.get("loss") is not None]
        state = {"status": job.status, "epoch": epochs[-1]["epoch"] if epochs else 0,
                 "epochs": job.options.epochs, "samples_per_s": speed,
                 "loss": sum(losses) / len(losses) if losses else None,
                 "seconds": (job.ended or time.time()) - job.started}
        if epochs:
            state.update({k: v for k, v in epochs[-1].items() if k.startswith("val_")})
        return state

    def _text(self) -> str:
        s = self.summary()
        parts = [f"nbdist {s['status']}", f"epoch {s['epoch']}/{s['epochs']}",
                 f"{s['samples_per_s']:.0f} samples/s"]
        if s["loss"] is not None:
            parts.append(f"loss {s['loss']:.4f}")
        parts += [f"{k} {v:.4f}" for k, v in s.items() if k.startswith("val_") and v is not None]
        parts.append(f"{s['seconds']:.1f} s")
        if self.job.error is not None:
            parts.append(f"error: {self.job.error}")
        return " | ".join(parts)

    def __repr__(self) -> str:
        return self._text()

    def _repr_html_(self) -> str:
        s = self.summary()
        return (f'<div><progress value="{s["epoch"]}" max="{s["epochs"]}" style="width:16em"></progress> '
                f'<code>{html.escape(self._text())}</code></div>')

