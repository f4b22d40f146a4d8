"""One rank's view of the other ranks of its run: who they are, how long to wait for
them, and how to tell them that the run cannot go on.

Made first thing in set-up (before anything can fail), so that every later wait, set-up's
own included, has a deadline and a way to name whoever it waited for in vain.
"""

from __future__ import annotations

from typing import Any

from nbdist.transport.collectives import Collectives, roll_grace
from nbdist.transport.control import ControlChannel, RollCall
from nbdist.transport.deadlines import FIRST_MESSAGE_TIMEOUT, Silence
from nbdist.transport.faults import RankDirectory, RankSilent, RunFailure, kill_frozen

__all__ = ["Peers", "SETUP_TIMEOUT"]

# How long the ranks wait for each other to finish setting up (building the model,
# loading or caching the data) before the ones missing count as frozen.
SETUP_TIMEOUT = FIRST_MESSAGE_TIMEOUT


class Peers:
    def __init__(self, comm: Any, peer_timeout: float | None):
        self.control = ControlChannel(comm)
        # This rank's own rhythm (the gaps between its steps): a wait for the others may
        # take PEER_TIMEOUT_FACTOR times the longest one (deadlines.py); until its first
        # step, set-up's time.
        self.pace = Silence(peer_timeout)
        self.directory = RankDirectory([])
        self.collectives = Collectives(
            self.timeout, self.missing, self.describe_all, run=comm, call_roll=self.control.start_roll_call
        )

    def meet(self, comm: Any, role: str) -> None:
        """Collective: learn every rank's host, process and role."""
        self.directory = RankDirectory.gather(comm, role, lambda row: self.collectives.allgather(comm, row, "set-up"))
        self.pace.restart()

    def timeout(self) -> float:
        return self.pace.limit

    def describe_all(self, ranks: list[int]) -> str:
        return self.directory.describe_all(ranks)

    def missing(self, comm: Any, what: str, roll: RollCall | None = None) -> RunFailure:
        """A collective ran past its deadline: name (and, when frozen on this host, remove)
        the ranks that did not answer `roll`, the roll call made before the deadline
        passed; without one (the collective failed another way), call the roll now."""
        seconds = self.timeout()
        if roll is not None:
            ranks = roll.silent()
        else:
            # A rank busy computing answers at its next wait (a frozen one never answers).
            ranks = self.control.roll_call(grace=roll_grace(seconds))
        if not ranks:
            return RankSilent(f"{what} did not complete within {seconds:.0f} s, although every rank answers")
        infos = self.directory.infos
        killed = [r for r in ranks if r in infos and kill_frozen(infos[r])]
        return RankSilent(
            f"{self.describe_all(ranks)} did not reach {what} within {seconds:.0f} s (frozen, or far "
            f"slower than the others; see --peer-timeout)",
            ranks=ranks,
            restartable=len(killed) == len(ranks),
        )

    def close(self) -> None:
        self.control.close()
