"""Dynamic local steps (DyLU; async_local_sgd(dynamic_steps=True)): a master times each
worker's windows and names the worker's next window in its reply (messages.WINDOW).

A window's time is the master's own clock, from the CONTINUE reply that began the
window to the arrival of the header of the update that ended it (Silence.last, set when
the header is seen): the worker's local steps plus one message each way, which is what
decides how often it sends. Its speed is that update's samples over that time. A window
that no CONTINUE began is not timed: a worker's first (after the initial weights, or
after a resume). An update that a SNAPSHOT sent back (a checkpoint was being taken) ended
its window when it first arrived: the window is timed to then, however long the share's
save took, so that a slow worker whose every window meets a faster one's checkpoint is
timed all the same. The next window is the rule's
(Algorithm.next_window), from the worker's speed and the fastest among the workers that
still train under this master; until a worker is timed it keeps the run's window.

Nothing here is on the hot path's buffers: one float per worker, and one header slot.
The speeds are written into the master's checkpoint share (`to_json`) and read back by
a resume on the same layout (`load_json`); each worker's current window is in its own
share (its rule state), so a resumed run starts from the windows it had.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from nbdist.algorithms import Algorithm

__all__ = ["WorkerWindows"]


@dataclass
class WorkerWindows:
    """Per client of a master (workers first): the speed of its last timed window
    (samples per second, 0.0 until timed), when its current window began (None: not
    timed), and the window last named to it."""

    rule: Algorithm
    window: int  # H: the run's window (inner_steps or --sync-every)
    clients: int
    speeds: list[float] = field(init=False)
    began: list[float | None] = field(init=False)
    named: list[int] = field(init=False)
    # When the update now sent again after a SNAPSHOT first arrived (None: none was).
    ended: list[float | None] = field(init=False)

    def __post_init__(self) -> None:
        self.speeds = [0.0] * self.clients
        self.began = [None] * self.clients
        self.named = [self.window] * self.clients
        self.ended = [None] * self.clients

    def arrived(self, i: int, samples: int, at: float) -> None:
        """Worker i's update, whose header arrived at `at`, ended its window."""
        began, self.began[i] = self.began[i], None
        ended, self.ended[i] = self.ended[i], None
        at = ended if ended is not None else at
        if began is not None and at > began and samples > 0:
            self.speeds[i] = samples / (at - began)

    def name(self, i: int, training: Iterable[int]) -> int:
        """Worker i's next window, from the speeds of the workers in `training`."""
        fastest = max((self.speeds[j] for j in training), default=0.0)
        self.named[i] = self.rule.next_window(self.window, self.speeds[i], fastest)
        return self.named[i]

    def begin(self, i: int, at: float, timed: bool) -> None:
        """A reply to worker i left at `at`: it begins a timed window when it is a CONTINUE."""
        self.began[i] = at if timed else None

    def sent_back(self, i: int, arrived: float) -> None:
        """Worker i's update, which arrived at `arrived`, was answered with a SNAPSHOT: it
        comes again, and its window ended at `arrived`."""
        if self.ended[i] is None:
            self.ended[i] = arrived

    def to_json(self) -> list[float]:
        return list(self.speeds)

    def load_json(self, speeds: Any) -> None:
        """The speeds a checkpoint holds, when it was written for as many clients."""
        if isinstance(speeds, list) and len(speeds) == self.clients:
            self.speeds = [float(v) for v in speeds]
