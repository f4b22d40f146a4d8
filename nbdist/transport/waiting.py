"""Waiting on MPI requests without blocking inside MPI, and never forever.

A rank blocked in MPI_Wait runs no Python signal handler (a stop request would not get
through), burns the core another rank needs when oversubscribed, and never learns that
the peer it waits for died or froze. So every wait here polls `Test` back to back for a
short while (replies usually come within microseconds), yielding the core between polls,
then polls between short sleeps that give the core away; and while it polls it watches

- a deadline: `timeout` seconds without completion raise `WaitTimeout` (the caller
  knows whom it waited for and turns that into a RankSilent naming the peer);
- MPI's own failure reports: with fault tolerance on (ULFM, see faults.py) a request
  whose peer died completes with an error, raised here as `CommFailure`;
- the process's `Watch`: the flag a notebook's give-up sets (`abandon()`) and the run's
  control channel, on which another rank says that the run cannot go on.

A node whose ranks fit its cores needs no sleeps at all (`poll_without_sleeping`, the
run's --busy-poll): a rank that slept while its peer computed wakes slowly, on a core
whose caches went cold (a master's step took several times as long after a sleep as after
polling: bench/results/2026-11-25-overhead.md), and notices its message up to a sleep
late; polling keeps the core busy, which costs only where another rank needed it. With
--busy-poll auto a rank polls only while its core is its own: the waits look at its wait
for a core now and then (core_share.py) and sleep again while other work shares the core.

The sleeps stay short because a sleeping rank stalls its partner, not only itself: a
large message is a rendezvous, so the peer's blocking `Send` (and every round of an
`Iallreduce`) waits until this rank polls again. Sleeps that grew to milliseconds cost the
master/worker exchange milliseconds per update, so they stop growing at LONGEST_SLEEP;
polling at that pace costs a small part of a core while a rank waits long.

A wait that gives up (a deadline, a failure, a give-up) leaves its requests pending, and so
does a channel dropped with a receive posted: MPI may still complete them, writing into
the receive's buffer. The buffer belongs to the Request (mpi4py keeps it there), so the
requests go to `keep_pending` and stay alive until they complete: otherwise a late reply
from a master that had not yet heard of a failure lands in memory the next job of the same
engine has reused, and that engine dies of it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Sequence

from mpi4py import MPI

from nbdist.transport.core_share import CoreWatch

__all__ = [
    "poll_without_sleeping",
    "wait",
    "wait_all",
    "wait_for",
    "test_all",
    "wait_some",
    "wait_until",
    "test_each",
    "receive_object",
    "WaitTimeout",
    "CommFailure",
    "Abandoned",
    "abandon",
    "forget_abandon",
    "watch_with",
    "keep_pending",
    "release_completed",
    "FOREVER",
]

SPIN_SECONDS = 2e-4
FIRST_SLEEP = 5e-5
LONGEST_SLEEP = 2e-4
# How often a wait looks at the watch (the control channel's probe costs a microsecond).
WATCH_EVERY = 5e-3
FOREVER = None  # no deadline: only for waits whose peer is watched otherwise (see callers)

_yield = getattr(os, "sched_yield", lambda: time.sleep(0))
# How long a wait polls before it starts sleeping: SPIN_SECONDS, or for ever where the
# run's ranks have a core each (poll_without_sleeping).
_spin_seconds = SPIN_SECONDS
# --busy-poll auto: whether the rank's core is still its own (None: the choice is fixed).
_core_watch: CoreWatch | None = None


def poll_without_sleeping(enabled: bool, while_core_free: bool = False) -> None:
    """Whether this process's waits poll for their whole length (each poll still yields
    the core and watches its deadline) instead of sleeping after SPIN_SECONDS.
    `while_core_free` (--busy-poll auto): only while the calling thread (the rank's main
    thread) does not wait for its core behind other work, by core_share.py's rule,
    looked at by the waits every core_share.WINDOW seconds."""
    global _spin_seconds, _core_watch
    if _core_watch is not None:
        _core_watch.close()
    _core_watch = CoreWatch(polling=True) if enabled and while_core_free else None
    _spin_seconds = float("inf") if enabled else SPIN_SECONDS


def _follow_core_watch(watch: CoreWatch, now: float) -> float:
    """The spin time core_share's rule gives from now on (--busy-poll auto)."""
    global _spin_seconds
    _spin_seconds = float("inf") if watch.check(now) else SPIN_SECONDS
    return _spin_seconds


class Abandoned(BaseException):
    """Raised in a rank's wait after `abandon()`: a peer it waits for failed where no
    message can say so, and the job gave up. A BaseException, so that no `except
    Exception` in user code holds the rank back."""


class WaitTimeout(Exception):
    """A wait ran past its deadline; `seconds` is how long it waited."""

    def __init__(self, seconds: float):
        super().__init__(f"no completion within {seconds:.1f} s")
        self.seconds = seconds


class CommFailure(Exception):
    """MPI reported that a request cannot complete: its peer failed (ULFM's
    MPI_ERR_PROC_FAILED) or its communicator was revoked. `error_class` is MPI's."""

    def __init__(self, error: MPI.Exception):
        super().__init__(str(error))
        self.error_class: int | None = error.Get_error_class()  # None: not MPI's (torch's)


_abandoned = False
# The run's control channel check (set while a run trains; see control.py), called every
# WATCH_EVERY seconds by every wait of this process.
_watch: Callable[[], None] | None = None


def abandon() -> None:
    """Make every wait of this process give up (safe to call from a signal handler: it
    only sets a flag; the wait raises Abandoned from its own loop, at a point where no
    library is half-way through anything)."""
    global _abandoned
    _abandoned = True


def forget_abandon() -> None:
    global _abandoned
    _abandoned = False


# Requests left pending by a wait that gave up or an owner that went away (module doc).
_kept: list[MPI.Request] = []
# Past this many, keeping one more first lets go of those that completed meanwhile (a long
# run that drops requests in flight must not hold their buffers to its end).
KEPT_BEFORE_RELEASE = 64


def keep_pending(requests: Iterable[MPI.Request]) -> None:
    """Keep these requests (and so their buffers) alive until they complete; null and
    completed ones are let go by `release_completed`. Owners call it from `__del__`, so
    it never raises: at interpreter exit MPI may be finalized and this module torn down."""
    try:
        if MPI.Is_finalized():
            return  # nothing will write into them any more
        _kept.extend(r for r in requests if r != MPI.REQUEST_NULL)
        if len(_kept) > KEPT_BEFORE_RELEASE:
            release_completed()
    except Exception:
        pass


def release_completed() -> int:
    """Let go of the kept requests that have completed (or failed) since; how many are
    still pending. A job calls it at its start, for what the one before left."""
    still: list[MPI.Request] = []
    for request in _kept:
        try:
            if not request.Test():
                still.append(request)
        except MPI.Exception:
            pass  # completed with an error: MPI is done with its buffer
    _kept[:] = still
    return len(still)


class watch_with:
    """`with watch_with(check):` every wait inside also calls `check()` now and then
    (it raises to end the wait: another rank's failure, say). Restores the previous
    watch on exit, so nested runs (a study's trial in a group) keep theirs."""

    def __init__(self, check: Callable[[], None] | None):
        self.check: Callable[[], None] | None = check
        self.previous: Callable[[], None] | None = None

    def __enter__(self) -> watch_with:
        global _watch
        self.previous, _watch = _watch, self.check
        return self

    def __exit__(self, *exc: object) -> None:
        global _watch
        _watch = self.previous


class _Backoff:
    __slots__ = ("spin_until", "delay", "deadline", "started", "next_watch")

    def __init__(self, timeout: float | None):
        now = time.perf_counter()
        self.started = now
        if _core_watch is not None and now >= _core_watch.next_look:
            _follow_core_watch(_core_watch, now)
        self.spin_until = now + _spin_seconds
        self.delay = 0.0
        self.deadline = None if timeout is None else now + timeout
        self.next_watch = now + WATCH_EVERY

    def pause(self) -> None:
        if _abandoned:
            raise Abandoned()
        now = time.perf_counter()
        if now >= self.next_watch:
            self.next_watch = now + WATCH_EVERY
            if _watch is not None:
                _watch()
            if _core_watch is not None and now >= _core_watch.next_look:
                self.spin_until = self.started + _follow_core_watch(_core_watch, now)  # a long wait adapts too
            if self.deadline is not None and now > self.deadline:
                raise WaitTimeout(now - self.started)
        if now < self.spin_until:
            _yield()  # oversubscribed, another rank runs; otherwise this returns at once
            return
        self.delay = min(self.delay * 2 or FIRST_SLEEP, LONGEST_SLEEP)
        time.sleep(self.delay)


def wait(request: MPI.Request, *, timeout: float | None = FOREVER) -> None:
    wait_all([request], timeout=timeout)


def wait_all(requests: Sequence[MPI.Request], *, timeout: float | None = FOREVER) -> None:
    try:
        backoff = _Backoff(timeout)
        while True:
            if test_all(requests):
                return
            try:
                backoff.pause()
            except WaitTimeout:
                # A process that was suspended (SIGSTOP) finds its deadline long passed when
                # it wakes up, while what it waited for may have arrived meanwhile: look once
                # more before giving up.
                if test_all(requests):
                    return
                raise
    except BaseException:
        keep_pending(requests)
        raise


def test_all(requests: Sequence[MPI.Request]) -> bool:
    """Whether every request has completed, without waiting; CommFailure if one failed."""
    try:
        return MPI.Request.Testall(requests)
    except MPI.Exception as exc:
        raise CommFailure(exc) from None


def wait_for(done: Callable[[], bool], *, timeout: float | None = FOREVER) -> None:
    """`wait_all` for another library's pending work: `done()` says whether it finished
    (and raises CommFailure, or a subclass, when it failed)."""
    backoff = _Backoff(timeout)
    while not done():
        try:
            backoff.pause()
        except WaitTimeout:
            if done():  # suspended past the deadline meanwhile: look once more (as wait_all)
                return
            raise


def test_each(requests: Sequence[MPI.Request]) -> tuple[list[int], list[tuple[int, CommFailure]]]:
    """Test every request on its own: (indices that completed, (index, failure) of those
    that failed). Unlike Testsome, a failed request does not hide the ones that completed
    with it (mpi4py raises Testsome's MPI_ERR_IN_STATUS and drops the rest)."""
    done, failed = [], []
    for i, request in enumerate(requests):
        if request == MPI.REQUEST_NULL:
            continue
        try:
            if request.Test():
                done.append(i)
        except MPI.Exception as exc:
            failed.append((i, CommFailure(exc)))
    return done, failed


def wait_some(
    requests: list[MPI.Request], *, timeout: float | None = FOREVER
) -> tuple[list[int], list[tuple[int, CommFailure]]]:
    """(completed indices, failed (index, failure)) once at least one request completed
    or failed; ([], []) when every request is null or `timeout` seconds passed first."""
    backoff = _Backoff(None)
    deadline = None if timeout is None else time.perf_counter() + timeout
    while True:
        if all(r == MPI.REQUEST_NULL for r in requests):
            return [], []
        done, failed = test_each(requests)
        if done or failed:
            return done, failed
        if deadline is not None and time.perf_counter() > deadline:
            return [], []
        try:
            backoff.pause()
        except BaseException:  # given up: Abandoned, or the run's watch raised
            keep_pending(requests)
            raise


def wait_until(request: MPI.Request, timeout: float) -> bool:
    """Wait at most `timeout` seconds; False if the request is still pending (it is
    left as it is: the caller goes on without it). A failed request counts as done."""
    try:
        wait(request, timeout=timeout)
    except WaitTimeout:
        return False
    except CommFailure:
        return True
    return True


def receive_object(comm: MPI.Comm, source: int, tag: int, *, timeout: float | None = FOREVER) -> object:
    """A small pickled message (an error's text, a study's control message), waited for
    with a matched probe: nothing blocks inside MPI, and the receive never guesses a size."""
    backoff = _Backoff(timeout)
    while True:
        try:
            message = comm.improbe(source=source, tag=tag)
        except MPI.Exception as exc:
            raise CommFailure(exc) from None
        if message is not None:
            return message.recv()
        backoff.pause()
