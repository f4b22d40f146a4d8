"""How long a peer may stay silent before it counts as frozen.

The user's `--peer-timeout` when given. Otherwise it follows the run: PEER_TIMEOUT_FACTOR
times the longest gap seen so far between two messages of that peer, and never less than
PEER_TIMEOUT_FLOOR seconds, so that a step that takes minutes on a big model is no
failure, while a frozen peer of a fast run is found within a minute.

Until a peer has been heard from once, the wait is set-up's, FIRST_MESSAGE_TIMEOUT: its
first message follows the building of its model, the loading of its data and its first
steps, which take long on a busy node and are no sign of a frozen rank.
"""

from __future__ import annotations

import time

__all__ = ["Silence", "PEER_TIMEOUT_FLOOR", "PEER_TIMEOUT_FACTOR", "FIRST_MESSAGE_TIMEOUT"]

PEER_TIMEOUT_FLOOR = 60.0
PEER_TIMEOUT_FACTOR = 10.0
FIRST_MESSAGE_TIMEOUT = 600.0


class Silence:
    """One peer's silence: when it was last heard from, and how long is too long."""

    __slots__ = ("fixed", "last", "longest", "heard_once")

    def __init__(self, fixed: float | None = None):
        self.fixed = fixed
        self.last = time.monotonic()
        self.longest = 0.0
        self.heard_once = False

    def heard(self) -> None:
        now = time.monotonic()
        if self.heard_once:
            self.longest = max(self.longest, now - self.last)
        self.heard_once = True
        self.last = now

    def restart(self) -> None:
        """Count from now (a wait that is not the peer's doing is over)."""
        self.last = time.monotonic()

    @property
    def limit(self) -> float:
        if not self.heard_once:
            return max(FIRST_MESSAGE_TIMEOUT, self.fixed or 0.0)
        if self.fixed is not None:
            return self.fixed
        return max(PEER_TIMEOUT_FLOOR, PEER_TIMEOUT_FACTOR * self.longest)

    def silent_for(self) -> float:
        return time.monotonic() - self.last

    @property
    def exceeded(self) -> bool:
        return self.silent_for() > self.limit
