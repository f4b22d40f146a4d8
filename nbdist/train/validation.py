"""Validating the centre in the background while the master keeps serving workers.

An asynchronous master that validated inline would leave every worker that reports
during validation waiting for its reply. Instead the master copies the centre (one
memcpy) into a second replica of the model and evaluates it on a thread; torch and
TensorFlow release the GIL inside their kernels, so the serving loop goes on. The result is picked up at the
next loop turn. (Synchronous masters validate inline, after sending the round's replies,
while the workers compute: that keeps stop decisions at the same step in every run.)

`--validate-every-samples N` adds validations between the epochs' ones, each time the
training samples seen (over all workers) pass another multiple of N (`SampleMarks`).
A master validates those on a replica of their own (`SampledValidation`), so that they
never hold back an epoch's validation, nor the epoch's one them; allreduce ranks
validate them together, at the step that passes the mark.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from nbdist.backends.base import Backend, BatchStats
from nbdist.metrics.log import RunLog
from nbdist.train.progress import sample_validation

__all__ = ["BackgroundValidator", "SampleMarks", "SampledValidation"]


class BackgroundValidator:
    __slots__ = ("_make_replica", "_replica", "_x", "_y", "_thread", "_pending", "_result", "_error")

    def __init__(self, make_replica: Callable[[], Backend], x: Any, y: Any):
        self._make_replica = make_replica
        self._replica: Backend | None = None  # made on the first start, in the serving thread
        self._x, self._y = x, y
        self._thread: threading.Thread | None = None
        self._pending: Any = None
        self._result: BatchStats | None = None
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None

    def start(self, params: np.ndarray, state: np.ndarray, tag: Any) -> None:
        """Evaluate a snapshot of (params, state); `tag` comes back with the result."""
        if self._replica is None:
            self._replica = self._make_replica()
        replica = self._replica
        replica.params[:] = params
        replica.state[:] = state
        self._pending, self._result, self._error = tag, None, None
        self._thread = threading.Thread(target=self._run, args=(replica,), name="nbdist-validation", daemon=True)
        self._thread.start()

    def _run(self, replica: Backend) -> None:
        try:
            self._result = replica.evaluate(self._x, self._y)
        except BaseException as exc:  # re-raised in the serving thread by poll()
            self._error = exc

    def poll(self, block: bool = False) -> tuple[Any, BatchStats] | None:
        """(tag, stats) once the running validation has finished, else None."""
        if self._thread is None or (not block and self._thread.is_alive()):
            return None
        self._thread.join()
        self._thread = None
        if self._error is not None:
            raise self._error
        if self._result is None:
            raise RuntimeError("the validation thread ended without a result or an error")
        return self._pending, self._result


class SampleMarks:
    """Multiples of `every` training samples: `due(seen)` once `seen` has reached the
    next one not yet validated. Passing several marks in one step (or while a master's
    previous validation still runs) makes one validation, of the weights at `seen`."""

    __slots__ = ("every", "next")

    def __init__(self, every: int, seen: int = 0):
        self.every = int(every)
        self.next = 0
        self.passed(seen)

    def due(self, seen: int) -> bool:
        return seen >= self.next

    def passed(self, seen: int) -> None:
        """The weights at `seen` samples are being validated: wait for the next multiple."""
        self.next = (int(seen) // self.every + 1) * self.every


class SampledValidation:
    """A master's validations every N samples: on a replica of their own, in the
    background, one at a time. A mark passed while the previous one still runs is
    validated when it has finished, at the samples seen by then (the record says which)."""

    __slots__ = ("marks", "validator", "metric_name")

    def __init__(self, every: int, seen: int, validator: BackgroundValidator, metric_name: str | None):
        self.marks = SampleMarks(every, seen)
        self.validator = validator
        self.metric_name = metric_name

    def due(self, seen: int) -> bool:
        """Whether to start a validation now (after `collect`)."""
        return not self.validator.busy and self.marks.due(seen)

    def start(self, params: np.ndarray, state: np.ndarray, seen: int, version: int, epoch: int) -> None:
        self.marks.passed(seen)
        self.validator.start(params, state, (seen, version, epoch))

    def collect(self, log: RunLog, block: bool = False) -> None:
        """Record the validation that has finished, if any, as a 'val' record."""
        done = self.validator.poll(block)
        if done is not None:
            (seen, version, epoch), val = done
            log.emit(
                "val", {**sample_validation(seen, val, self.metric_name), "version": version}, step=version, epoch=epoch
            )
