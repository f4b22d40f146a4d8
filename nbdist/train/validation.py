"""Validating the centre in the background while the master keeps serving workers.

An asynchronous master that validated inline would leave every worker that reports
during validation waiting for its reply. Instead the master copies the centre (one
memcpy) into a second replica of the model and evaluates it on a thread; torch and
TensorFlow release the GIL inside their kernels, so the serving loop goes on. The result is picked up at the
next loop turn. (Synchronous masters validate inline, after sending the round's replies,
while the workers compute: that keeps stop decisions at the same step in every run.)
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

from nbdist.backends.base import Backend, BatchStats

__all__ = ["BackgroundValidator"]


class BackgroundValidator:
    __slots__ = ("_make_replica", "_replica", "_x", "_y", "_thread", "_pending", "_result", "_error")

    def __init__(self, make_replica: Callable[[], Backend], x: Any, y: Any):
        self._make_replica, self._replica = make_replica, None
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
        self._replica.params[:] = params
        self._replica.state[:] = state
        self._pending, self._result, self._error = tag, None, None
        self._thread = threading.Thread(target=self._run, name="nbdist-validation", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._replica.evaluate(self._x, self._y)
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
        return self._pending, self._result
