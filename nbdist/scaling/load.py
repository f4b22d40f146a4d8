"""What else the node's cores did meanwhile: other processes' CPU use, from /proc.

A scaling study on a shared machine (a login node, a laptop, a development box) shares the
cores with processes that are not its own. The model predicts the ranks on the cores they
get; this meter says how many that was: every SAMPLE_EVERY seconds it reads the cores'
busy time (/proc/stat) and the study's own processes' CPU time (/proc/PID/stat), so that
for any window, the cores the other processes used are the busy time less the study's own.
On an allocation of one's own that is about nothing; elsewhere it is what the points and
the calibration are corrected for (the docs' performance-model page says how). Where
/proc is not there (not Linux), the meter reads nothing and counts no other load.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from pathlib import Path

__all__ = ["CpuMeter", "SAMPLE_EVERY", "MIN_RUNNABLE", "thread_turns", "window_load"]

SAMPLE_EVERY = 0.1
MIN_RUNNABLE = 0.02  # the share of a window a process must be runnable for its core share to count


def _schedstat(pid: int) -> tuple[float, float] | None:
    """(seconds on a core, seconds runnable but waiting for one) of `pid`'s main thread."""
    try:
        ran, waited = Path(f"/proc/{pid}/schedstat").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return int(ran) / 1e9, int(waited) / 1e9


def _ticks() -> float:
    try:
        return float(os.sysconf("SC_CLK_TCK"))
    except (ValueError, OSError, AttributeError):
        return 100.0


class CpuMeter:
    """Samples the node's busy time and `pids`' CPU time on a thread until `stop()`."""

    def __init__(self, pids: list[int]):
        self.pids = list(pids)
        self.hz = _ticks()
        self.times: list[float] = []
        self.busy: list[float] = []  # seconds of all cores busy, cumulative
        self.ours: list[float] = []  # seconds of the study's processes, cumulative
        # per process of `pids`: (seconds on a core, seconds runnable but waiting for one),
        # cumulative, from the kernel's schedstat of its main thread (None where unread)
        self.sched: list[list[tuple[float, float] | None]] = []
        self._stop = threading.Event()
        self.available = Path("/proc/stat").exists()
        self._thread = threading.Thread(target=self._run, name="nbdist-cpu-meter", daemon=True)
        if self.available:
            self._sample()
            self._thread.start()

    def _sample(self) -> None:
        try:
            fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
        except OSError:
            return
        values = [int(v) for v in fields]
        busy = (sum(values[:8]) - values[3] - values[4]) / self.hz  # all but idle and iowait (guests are in user)
        ours = 0.0
        sched: list[tuple[float, float] | None] = []
        for pid in self.pids:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                sched.append(None)
                continue
            after = stat.rsplit(")", 1)[1].split()
            ours += (int(after[11]) + int(after[12])) / self.hz  # utime, stime
            sched.append(_schedstat(pid))
        self.times.append(time.time())
        self.busy.append(busy)
        self.ours.append(ours)
        self.sched.append(sched)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY):
            self._sample()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)

    def _at(self, when: float) -> int:
        return min(max(bisect.bisect_left(self.times, when), 0), len(self.times) - 1)

    def schedule(self, start: float, end: float, count: int) -> list[tuple[float, float | None] | None]:
        """For each of the first `count` processes between `start` and `end`: the share of
        the window its main thread ran (cores it used), and the share of its runnable time
        it spent on a core, ran / (ran + waited for one): what the scheduler gave it of a
        core whenever it wanted one (None where it was runnable too little to say). None
        for a process whose counters could not be read."""
        found: list[tuple[float, float | None] | None] = [None] * count
        if not self.available or len(self.times) < 2:
            return found
        first, last = self._at(start), self._at(end)
        seconds = self.times[last] - self.times[first]
        for i in range(min(count, len(self.pids))):
            a, b = self.sched[first][i], self.sched[last][i]
            if a is None or b is None or seconds <= 0:
                continue
            ran, waited = b[0] - a[0], b[1] - a[1]
            share = ran / (ran + waited) if ran + waited >= MIN_RUNNABLE * seconds else None
            found[i] = (ran / seconds, share)
        return found

    def ours_cores(self, start: float, end: float) -> float:
        """The cores the study's own processes kept busy between `start` and `end`."""
        if not self.available or len(self.times) < 2:
            return 0.0
        first, last = self._at(start), self._at(end)
        seconds = self.times[last] - self.times[first]
        return max(0.0, (self.ours[last] - self.ours[first]) / seconds) if seconds > 0 else 0.0

    def others(self, start: float, end: float) -> float:
        """The cores the other processes kept busy between `start` and `end` (time.time())."""
        if not self.available or len(self.times) < 2:
            return 0.0
        first, last = self._at(start), self._at(end)
        if last <= first:
            return 0.0
        seconds = self.times[last] - self.times[first]
        other = (self.busy[last] - self.busy[first]) - (self.ours[last] - self.ours[first])
        return max(0.0, other / seconds) if seconds > 0 else 0.0


def window_load(meter: CpuMeter | None, window: list[float] | None, ranks: int) -> dict[str, object]:
    """What a point's steady state had of the node: the cores other processes used
    ("others"), the cores its own processes used ("ours"), and per rank (the ranks are the
    meter's first processes) the cores its main thread used ("ran") and its share of a core
    while runnable ("shares")."""
    if meter is None or not window:
        return {"others": 0.0}
    schedule = meter.schedule(window[0], window[1], ranks)
    return {
        "others": meter.others(*window),
        "ours": meter.ours_cores(*window),
        "ran": [None if s is None else s[0] for s in schedule],
        "shares": [None if s is None else s[1] for s in schedule],
    }


def thread_turns() -> tuple[float, float, int]:
    """The calling thread's seconds on a core, seconds runnable but waiting for one, and
    times it got a core, from the kernel's schedstat ((0, 0, 0) where it keeps none)."""
    try:
        with open("/proc/thread-self/schedstat") as counters:
            ran, waited, slices = counters.read().split()[:3]
    except (OSError, ValueError):
        return 0.0, 0.0, 0
    return int(ran) / 1e9, int(waited) / 1e9, int(slices)
