"""Waiting on MPI requests without blocking inside MPI.

A rank blocked in MPI_Wait runs no Python signal handler (a stop request would not get
through) and, oversubscribed, burns the core another rank needs. So waits here poll
Test back to back for a short while (replies usually come within microseconds), yielding
the core between polls, then poll between short sleeps that give the core away.

The sleeps stay short because a sleeping rank stalls its partner, not only itself: a
large message is a rendezvous, so the peer's blocking `Send` (and every round of an
`Iallreduce`) waits until this rank polls again. Sleeps that grew to 2 ms cost the
master/worker exchange several milliseconds per update (a worker's compute share went
from 0.82 to 0.90 of its step time with the 0.2 ms cap, bench/overhead.py); polling
every 0.2 ms costs about 6% of a core while a rank waits long.
"""

from __future__ import annotations

import os
import time
from typing import Sequence

from mpi4py import MPI

__all__ = ["wait", "wait_all", "wait_some", "wait_until", "Abandoned", "abandon", "forget_abandon"]

SPIN_SECONDS = 2e-4
FIRST_SLEEP = 5e-5
LONGEST_SLEEP = 2e-4

_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


class Abandoned(BaseException):
    """Raised in a rank's wait after `abandon()`: a peer it waits for failed where no
    message can say so, and the job gave up. A BaseException, so that no `except
    Exception` in user code holds the rank back."""


_abandoned = False


def abandon() -> None:
    """Make every wait of this process give up (safe to call from a signal handler: it
    only sets a flag; the wait raises Abandoned from its own loop, at a point where no
    library is half-way through anything)."""
    global _abandoned
    _abandoned = True


def forget_abandon() -> None:
    global _abandoned
    _abandoned = False


class _Backoff:
    __slots__ = ("spin_until", "delay")

    def __init__(self) -> None:
        self.spin_until = time.perf_counter() + SPIN_SECONDS
        self.delay = 0.0

    def pause(self) -> None:
        if _abandoned:
            raise Abandoned()
        if time.perf_counter() < self.spin_until:
            _yield()  # oversubscribed, another rank runs; otherwise this returns at once
            return
        self.delay = min(self.delay * 2 or FIRST_SLEEP, LONGEST_SLEEP)
        time.sleep(self.delay)


def wait(request: MPI.Request, status: MPI.Status | None = None) -> None:
    backoff = _Backoff()
    while not request.Test(status):
        backoff.pause()


def wait_all(requests: Sequence[MPI.Request]) -> None:
    backoff = _Backoff()
    while not MPI.Request.Testall(requests):
        backoff.pause()


def wait_some(requests: list[MPI.Request]) -> list[int]:
    """Indices of the requests that completed (at least one, unless all are null)."""
    backoff = _Backoff()
    while True:
        done = MPI.Request.Testsome(requests)
        if done is None:  # every request is null
            return []
        if done:
            return list(done)
        backoff.pause()


def wait_until(request: MPI.Request, timeout: float) -> bool:
    """Wait at most `timeout` seconds; False if the request is still pending (it is
    left as it is: the caller goes on without it)."""
    deadline = time.monotonic() + timeout
    backoff = _Backoff()
    while not request.Test():
        if time.monotonic() > deadline:
            return False
        backoff.pause()
    return True
