"""--busy-poll auto on a node whose cores turn out to be shared: each rank watches how long
it waits for a core, and stops polling while other work wants it.

A rank that polls without sleeping is fastest while it has a core to itself, and slowest
when another process wants that core: its polls keep the core from the other work, the
scheduler shares the core out between them, and a rank that computes waits its turn behind
a rank (or another job) that only polls. Whether that is happening shows in the rank's own
numbers: the kernel counts, per thread, the time it ran and the time it was runnable but
waited for a core (the scheduler's run-queue delay, /proc/thread-self/schedstat).

The rule (`keep_polling`), applied by a rank to its own main thread over each WINDOW seconds:

- polling, it stops once it waited for a core more than SHARED of the time it was runnable
  in a window: something else wants its core (another job or a user's process on the node,
  a rank of another launch, a thread of its own);
- sleeping between polls, it polls again after a window in which it waited for a core less
  than FREE of that time: the other work is gone. Between FREE and SHARED nothing changes,
  so that a rank whose waits and sleeps move its share a little does not flap;
- a window in which it was runnable less than MIN_RUNNABLE seconds (it slept or was
  blocked for most of it) says nothing: the decision stays as it was.

The rule sees the rank's whole window, its computing too, not only its waits: a rank that
sleeps in its waits on a shared node still waits for its core when it wakes and while it
computes, which keeps it sleeping until the node is free again.

Why not the load average or the run queue at start-up: the one-minute load average still
holds a job that ended seconds ago (a benchmark's previous launch, this launch's own set-up)
and not yet one that has just started, and /proc/stat's procs_running counts this launch's
own ranks, which at start-up may be computing or sleeping: both misjudge a node whose
sharing comes and goes, while a rank's wait for its core is exactly what the sharing costs
it. Where the kernel does not keep these numbers (no /proc/thread-self/schedstat), auto
keeps its start-up decision (transport/node.py).
"""

from __future__ import annotations

import os
import time

__all__ = ["CoreWatch", "keep_polling", "SHARED", "FREE", "WINDOW", "MIN_RUNNABLE"]

# Shares of a window's runnable time spent waiting for a core (run-queue delay).
SHARED = 0.10  # above: the core is shared, stop polling
FREE = 0.02  # below: the core is the rank's own again, poll
WINDOW = 1.0  # seconds between two looks at the counters
MIN_RUNNABLE = 0.05  # seconds runnable in a window below which the window says nothing

SCHEDSTAT = "/proc/thread-self/schedstat"


def keep_polling(polling: bool, ran: float, waited: float) -> bool:
    """Whether a rank polls without sleeping in its next window, given whether it did in
    this one (`polling`) and this window's seconds on a core (`ran`) and runnable but
    waiting for one (`waited`). The rule is the module's docstring's."""
    runnable = ran + waited
    if runnable < MIN_RUNNABLE:
        return polling
    share = waited / runnable
    if polling:
        return share <= SHARED
    return share < FREE


def read_schedstat(fd: int) -> tuple[float, float]:
    """(seconds on a core, seconds runnable but waiting for one) of the thread `fd` was
    opened for, since it started."""
    ran, waited = os.pread(fd, 128, 0).split()[:2]
    return int(ran) / 1e9, int(waited) / 1e9


class CoreWatch:
    """The rule over the windows of the thread that made it (a rank's main thread): `check(now)`
    (time.perf_counter's), cheap before the window's end, says whether to poll without
    sleeping from now on. `path`: the counters' file (the calling thread's by default)."""

    __slots__ = ("fd", "polling", "next_look", "last")

    def __init__(self, polling: bool = True, now: float | None = None, path: str = SCHEDSTAT):
        now = time.perf_counter() if now is None else now
        self.polling = polling
        self.next_look = now + WINDOW
        try:
            self.fd: int | None = os.open(path, os.O_RDONLY)
            self.last = read_schedstat(self.fd)
        except (OSError, ValueError):
            self.fd, self.last = None, (0.0, 0.0)  # no counters here: the decision stays

    def check(self, now: float) -> bool:
        if now < self.next_look or self.fd is None:
            return self.polling
        self.next_look = now + WINDOW
        ran, waited = read_schedstat(self.fd)
        self.polling = keep_polling(self.polling, ran - self.last[0], waited - self.last[1])
        self.last = (ran, waited)
        return self.polling

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
