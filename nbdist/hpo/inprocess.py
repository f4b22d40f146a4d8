"""Studies of a Python function, in this process: the same coordinator, searchers,
schedulers, run store and dashboard as a study of trainings, for an objective that is
cheap to evaluate (or to try a searcher or a scheduler).

    result = nbdist.hpo.optimize(lambda p: (p["x"] - 2) ** 2, space="x=real(-5,5)", trials=30)

The objective takes the trial's parameters and gives its figure of merit in one of four ways:

- returns it (one epoch);
- returns a sequence of values, one per epoch (a learning curve computed whole: the
  scheduler sees it an epoch at a time, but stopping it saves nothing);
- yields one value per epoch (a generator): the study asks for the next epoch only when
  the scheduler lets the trial go on, so a pruned trial really stops, and a trial paused
  at an ASHA rung waits, suspended, until it is promoted;
- takes a second argument, `report`, and calls `report(epoch, value)` after each epoch
  (as Optuna's `trial.report`): the call returns when the trial may go on, and raises
  `TrialStopped` when the scheduler stopped it (let it propagate).

In a multi-objective study (`objective_name="acc,size"`) each value is a tuple, or a
dict, with one entry per objective.
"""

from __future__ import annotations

import inspect
import math
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from nbdist.hpo.executor import EpochReport, FoldOutcome, TrialExecutor, TrialFinished
from nbdist.hpo.runner import StudyError, StudyResult, StudyRunner
from nbdist.hpo.trial import Segment, Trial, pause_reason
from nbdist.options import StudyOptions, TrainOptions

__all__ = ["FunctionExecutor", "optimize", "TrialStopped"]

# A report waits at most this long for the study's word (the study answers at once: a
# longer wait means it is gone).
REPORT_WAIT = 3600.0


class TrialStopped(Exception):
    """Raised by `report(epoch, value)` when the study stopped the trial."""


class _Reported:
    """An objective that calls report(epoch, value), run on a thread of its own: each
    report hands the value over and waits for the study's word."""

    def __init__(self, objective: Callable[..., Any], params: dict[str, Any]):
        self.words: queue.Queue[str] = queue.Queue()
        self.values: queue.Queue[tuple] = queue.Queue()
        self.epoch = 0

        def report(epoch: int, value: Any) -> None:
            self.values.put(("value", int(epoch), value))
            word = self.words.get(timeout=REPORT_WAIT)
            if word == "stop":
                raise TrialStopped("the study stopped this trial")

        def body() -> None:
            try:
                if self.words.get(timeout=REPORT_WAIT) == "stop":
                    return
                result = objective(params, report)
                self.values.put(("return", result))
            except TrialStopped:
                self.values.put(("stopped",))
            except BaseException as exc:  # the trial's failure, told to the study
                self.values.put(("error", exc))

        self.thread = threading.Thread(target=body, name="nbdist-objective", daemon=True)
        self.thread.start()

    def next(self, timeout: float) -> tuple | None:
        """('value', epoch, v), ('return', result), ('error', exc), or None (not yet)."""
        if not getattr(self, "_asked", False):
            self.words.put("go")
            self._asked = True
        try:
            message = self.values.get(timeout=timeout)
        except queue.Empty:
            return None
        self._asked = False
        return message

    def close(self) -> None:
        self.words.put("stop")
        self.thread.join(timeout=5.0)


class _Curve:
    """One trial's values, an epoch at a time, whatever form the objective gives them in."""

    def __init__(self, objective: Callable[..., Any], params: dict[str, Any], names: list[str]):
        self.names = names
        self.epoch = 0
        self.last: dict[str, float] = {}
        self.error: str | None = None
        self.done = False
        self._values: Iterator[Any] | None = None
        self._reported: _Reported | None = None
        try:
            if _takes_report(objective):
                self._reported = _Reported(objective, params)
            elif inspect.isgeneratorfunction(objective):
                self._values = iter(objective(params))
            else:
                value = objective(params)
                if isinstance(value, Iterator):  # a generator made by a plain function: still per epoch
                    self._values = value
                    return
                whole = isinstance(value, Sequence) and not isinstance(value, str) and not self._one_epoch(value)
                self._values = iter(value if whole else [value])
        except Exception as exc:  # the user's objective failed: the trial fails
            self.fail(exc)

    def _one_epoch(self, value: Any) -> bool:
        """A tuple of one value per objective, in a multi-objective study."""
        return len(self.names) > 1 and len(value) == len(self.names) and not isinstance(value[0], (Sequence, Mapping))

    def fail(self, exc: BaseException) -> None:
        if isinstance(exc, KeyboardInterrupt):
            raise exc  # the kernel's interrupt: the study stops, the trial stays unfinished
        self.error, self.done = f"{type(exc).__name__}: {exc}", True

    def advance(self, timeout: float) -> bool | None:
        """The next epoch's values into `last`: True, False at the end, None not yet."""
        if self.done:
            return False
        if self._reported is not None:
            message = self._reported.next(timeout)
            if message is None:
                return None
            if message[0] == "error":
                self.fail(message[1])
                return False
            if message[0] == "value":
                self.epoch, self.last = message[1], self._metrics(message[2])
                return True
            if message[0] == "return" and message[1] is not None:
                self.last = self._metrics(message[1])
            self.done = True
            return False
        try:
            value = next(self._values)  # type: ignore[arg-type]
        except StopIteration:
            self.done = True
            return False
        except Exception as exc:  # the user's generator failed: the trial fails
            self.fail(exc)
            return False
        self.epoch, self.last = self.epoch + 1, self._metrics(value)
        return True

    def _metrics(self, value: Any) -> dict[str, float]:
        if isinstance(value, Mapping):
            return {k: float(v) for k, v in value.items()}
        if len(self.names) > 1:
            return {name: float(v) for name, v in zip(self.names, value, strict=True)}
        return {self.names[0]: float(value)}

    def close(self) -> None:
        self.done = True
        if self._reported is not None:
            self._reported.close()
        elif hasattr(self._values, "close"):
            self._values.close()  # type: ignore[union-attr]


def _takes_report(objective: Callable[..., Any]) -> bool:
    try:
        return len(inspect.signature(objective).parameters) >= 2
    except (TypeError, ValueError):
        return False


class FunctionExecutor(TrialExecutor):
    """One group: the calling process. Each poll advances the running trial by one epoch,
    after the study has had its say on the last one."""

    groups = 1
    in_process = True

    def __init__(self, objective: Callable[..., Any], names: list[str], epochs: int | None = None):
        self.objective, self.names, self.epochs = objective, names, epochs
        self._trial: Trial | None = None
        self._segment: Segment | None = None
        self._curve: _Curve | None = None
        self._stop = ""
        self._suspended: dict[int, _Curve] = {}  # trials paused by their scheduler

    def start(self, group: int, trial: Trial, segment: Segment) -> None:
        curve = self._suspended.pop(trial.number, None)
        self._trial, self._segment, self._stop = trial, segment, ""
        self._curve = curve if curve is not None else _Curve(self.objective, dict(trial.params), self.names)

    def poll(self, timeout: float) -> list[EpochReport | TrialFinished]:
        trial, curve, segment = self._trial, self._curve, self._segment
        if trial is None or curve is None or segment is None:
            return []
        pause = segment.pause_at is not None and curve.epoch >= segment.pause_at
        ended = self._stop or pause or (self.epochs is not None and curve.epoch >= self.epochs)
        if not ended:
            moved = curve.advance(timeout)
            if moved is None:
                return []
            if moved:
                return [EpochReport(trial.number, 0, curve.epoch, dict(curve.last))]
        self._trial = None
        final = {**curve.last, "epoch": curve.epoch} if curve.last else {}
        error = curve.error
        for name, value in final.items():
            if error is None and name != "epoch" and not math.isfinite(value):
                error = f"the objective {name} is {value}"
        reason = self._stop
        if pause and not self._stop and error is None:
            reason = pause_reason(curve.epoch)
            self._suspended[trial.number] = curve
        else:
            curve.close()
        return [TrialFinished(trial.number, {0: FoldOutcome(final=final, error=error, stop_reason=reason)})]

    def stop(self, group: int, reason: str) -> None:
        self._stop = reason or "stopped"

    def close(self) -> None:
        for curve in self._suspended.values():
            curve.close()
        self._suspended.clear()
        if self._curve is not None:
            self._curve.close()


def optimize(
    objective: Callable[..., Any],
    *,
    space: str,
    searcher: str = "bayes",
    trials: int = 20,
    objective_name: str = "fom",
    direction: str | None = None,
    scheduler: str = "fifo",
    epochs: int | None = None,
    budget_epochs: int | None = None,
    budget_time: float | None = None,
    prune: bool = False,
    prune_warmup: int = 3,
    goal: str | None = None,
    store: str | None = None,
    study_name: str | None = None,
    resume_study: str | None = None,
    seed: int = 0,
    say: Callable[[str], None] = print,
) -> StudyResult:
    """Minimise (or maximise) `objective` over `space`.

    Parameters
    ----------
    objective: the function of a trial's parameters (see the module docstring for the
        forms its values may take: returned, yielded per epoch, or reported).
    objective_name: what the value is called; its direction follows it as on the command
        line (accuracies and AUCs are maximised) unless `direction` says.
    scheduler: fifo, median, asha(min_epochs, max_epochs, reduction) or hyperband(...);
        asha and hyperband need `epochs`, the most a trial yields.
    epochs: the epochs (values) a trial gives at most.
    budget_epochs, budget_time: the study's budget besides `trials`: epochs over all
        trials, seconds.
    store, study_name, resume_study: an SQLite run store records the trials; a study
        resumes from it.

    Returns
    -------
    StudyResult: every trial, the best parameters and value, why the study ended.

    Example
    -------
    >>> def curve(p):
    ...     for epoch in range(1, 10):
    ...         yield p["x"] + 1 / epoch
    >>> optimize(curve, space="x=real(0,1)", searcher="random", scheduler="asha(min_epochs=1)",
    ...          epochs=9, trials=12, say=lambda _: None).best_fom < 0.5
    True
    """
    options = StudyOptions(
        space=space,
        searcher=searcher,
        trials=trials,
        objective=objective_name,
        direction=direction,
        scheduler=scheduler,
        budget_epochs=budget_epochs,
        budget_time=budget_time,
        prune=prune,
        prune_warmup=prune_warmup,
        goal=goal,
        study_name=study_name,
        resume_study=resume_study,
    )
    names = [name.strip() for name in objective_name.split(",")]
    if epochs is None and (budget_epochs is not None or scheduler.split("(")[0].strip() in ("asha", "hyperband")):
        need = "budget_epochs" if budget_epochs is not None else f"scheduler {scheduler!r}"
        raise StudyError(f"optimize({need}) needs epochs=: the most epochs (values) a trial gives")
    # Without `epochs`, a trial goes on while the objective gives values.
    train = TrainOptions(seed=seed, epochs=epochs or UNBOUNDED)
    runner = StudyRunner(options, train, FunctionExecutor(objective, names, epochs), store, say)
    return runner.run()


UNBOUNDED = 10**9
