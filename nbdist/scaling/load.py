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

__all__ = ["CpuMeter", "SAMPLE_EVERY"]

SAMPLE_EVERY = 0.1


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
        for pid in self.pids:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            after = stat.rsplit(")", 1)[1].split()
            ours += (int(after[11]) + int(after[12])) / self.hz  # utime, stime
        self.times.append(time.time())
        self.busy.append(busy)
        self.ours.append(ours)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY):
            self._sample()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)

    def _at(self, when: float) -> int:
        return min(max(bisect.bisect_left(self.times, when), 0), len(self.times) - 1)

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
