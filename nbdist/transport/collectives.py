"""Collectives that never wait forever: nonblocking MPI operations, polled with a deadline.

The blocking forms (`Bcast`, `Allreduce`, `Barrier`, `allgather`) would hold a rank
inside MPI for as long as the slowest member takes, and forever when a member froze. Each
function here starts the nonblocking form and waits for it with waiting.wait_all, which
watches the run's control channel and a deadline. A failure becomes a RunFailure naming
the ranks MPI knows to have died (RankLost), or, past the deadline, the ranks that did not
answer a roll call on the control channel (RankSilent; see control.py). The roll is called
ROLL_SHARE of the deadline before it passes (between ROLL_GRACE_LEAST and ROLL_GRACE_MOST
seconds), and the wait goes on meanwhile: a frozen rank is named when the deadline the
message states has passed, not a grace period later.

MPI is handed host memory, or a device array through its Staging (staging.py): `bcast`
and `allreduce` take either, and refuse anything else, so that no device buffer reaches
MPI as if it were host memory.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from nbdist.transport.faults import RankLost, RankSilent, RunFailure, failed_ranks
from nbdist.transport.staging import Staging
from nbdist.transport.waiting import CommFailure, WaitTimeout, test_all, wait_all, wait_for

__all__ = ["Collectives", "Pending"]

# Longest text of one rank in a polled allgather (set-up errors, host names).
OBJECT_BYTES = 4096
# How long a survivor gives MPI's fault tolerance to learn of a death that another
# library (torch.distributed's sockets) saw first; Open MPI's runtime takes under a second.
LOST_GRACE = 3.0
# When a wait calls the roll: this share of its deadline before it passes, within these
# bounds. A rank that waits anywhere answers within milliseconds; one still computing its
# step answers at its next wait (and a rank that takes longer than the deadline to get
# there is named with the frozen ones: it did not reach the collective in time either).
ROLL_SHARE, ROLL_GRACE_LEAST, ROLL_GRACE_MOST = 0.25, 0.5, 30.0


class _Overdue(Exception):
    """A wait ran to its deadline (`seconds`); `roll`: the roll call made before it passed."""

    def __init__(self, seconds: float, roll: Any = None):
        super().__init__(f"no completion within {seconds:.1f} s")
        self.seconds, self.roll = seconds, roll


def roll_grace(seconds: float) -> float:
    """How long before a deadline of `seconds` the roll is called."""
    return min(ROLL_GRACE_MOST, max(ROLL_GRACE_LEAST, ROLL_SHARE * seconds), seconds / 2)


class Collectives:
    """The polled collectives of one rank: `timeout()` gives the current deadline,
    `missing(comm, what, roll)` names the ranks that did not reach a collective (those
    that did not answer `roll`, a roll call that `call_roll()` started before the
    deadline, or one of its own when there is none), `describe(ranks)` names ranks for
    messages."""

    def __init__(
        self,
        timeout: Callable[[], float],
        missing: Callable[[Any, str, Any], RunFailure] | None = None,
        describe: Callable[[list[int]], str] | None = None,
        run: Any = None,
        call_roll: Callable[[], Any] | None = None,
    ):
        self.timeout = timeout
        self.missing = missing
        self.describe = describe or (lambda ranks: ", ".join(f"rank {r}" for r in ranks))
        self.run = run  # the run's communicator: failed ranks are named by their rank in it
        self.call_roll = call_roll

    def wait(self, comm: Any, request: MPI.Request, what: str) -> None:
        self.wait_all(comm, [request], what)

    def wait_all(self, comm: Any, requests: list[MPI.Request], what: str) -> None:
        try:
            self._until_deadline(lambda seconds: wait_all(requests, timeout=seconds))
        except CommFailure:
            raise self.failed(comm, what) from None
        except _Overdue as exc:
            raise self._silent(comm, what, exc) from None

    def _until_deadline(self, wait: Callable[[float], None]) -> None:
        """`wait(seconds)` up to the run's deadline, calling the roll a while before it
        passes; _Overdue at the deadline (with that roll call)."""
        total = self.timeout()
        before = total - roll_grace(total) if self.call_roll is not None else total
        try:
            wait(before)
            return
        except WaitTimeout:
            if self.call_roll is None:
                raise _Overdue(total) from None
        roll = self.call_roll()
        try:
            wait(total - before)
        except WaitTimeout:
            raise _Overdue(total, roll) from None

    def failed(self, comm: Any, what: str) -> RunFailure:
        """The failure of a collective on `comm` that MPI reported: the ranks it knows died."""
        return self._lost(comm, what, failed_ranks(comm, self.run if self.run is not None else comm))

    def wait_for(self, comm: Any, done: Callable[[], bool], what: str) -> None:
        """`wait_all` for work outside MPI among the ranks of `comm` (a torch.distributed
        group's): `done()` says whether it finished, raising CommFailure when it failed.
        That library sees a peer's death (its sockets close) before MPI does: MPI is
        given LOST_GRACE seconds to name the dead rank, then a roll call names it."""
        try:
            self._until_deadline(lambda seconds: wait_for(done, timeout=seconds))
        except CommFailure:
            ranks = self._failed_within(comm, LOST_GRACE)
            if not ranks and self.missing is not None:
                raise self.missing(comm, what, None) from None
            raise self._lost(comm, what, ranks) from None
        except _Overdue as exc:
            raise self._silent(comm, what, exc) from None

    def _failed_within(self, comm: Any, seconds: float) -> list[int]:
        deadline = time.monotonic() + seconds
        while True:
            ranks = failed_ranks(comm, self.run if self.run is not None else comm)
            if ranks or time.monotonic() > deadline:
                return ranks
            try:
                comm.Iprobe(MPI.ANY_SOURCE, MPI.ANY_TAG)  # lets MPI take in the runtime's failure notice
            except MPI.Exception:
                pass  # it has: a wildcard probe fails while a failure is not acknowledged
            time.sleep(0.05)

    def _lost(self, comm: Any, what: str, ranks: list[int]) -> RunFailure:
        return RankLost(
            f"{self.describe(ranks)} died during {what}" if ranks else f"a rank failed during {what}",
            ranks=ranks,
            restartable=bool(ranks),
        )

    def _silent(self, comm: Any, what: str, exc: _Overdue) -> RunFailure:
        if self.missing is not None:
            return self.missing(comm, what, exc.roll)
        return RankSilent(f"a rank did not reach {what} within {exc.seconds:.0f} s")

    def bcast(
        self, comm: Any, buffer: np.ndarray | Staging, what: str = "the initial broadcast", root: int = 0
    ) -> None:
        self.wait(comm, comm.Ibcast(_host_side(buffer), root=root), what)
        _device_side(buffer)

    def allreduce(self, comm: Any, buffer: np.ndarray | Staging, what: str, op: Any = MPI.SUM) -> None:
        self.wait(comm, comm.Iallreduce(MPI.IN_PLACE, _host_side(buffer), op=op), what)
        _device_side(buffer)

    def barrier(self, comm: Any, what: str) -> None:
        self.wait(comm, comm.Ibarrier(), what)

    def start_barrier(self, comm: Any, what: str) -> Pending:
        """A barrier the rank goes on past: `done()` says whether every rank reached it."""
        return Pending(self, comm, [comm.Ibarrier()], what)

    def allgather(self, comm: Any, value: Any, what: str) -> list[Any]:
        """Small JSON-able values from every rank (set-up verdicts, host names)."""
        data = json.dumps(value).encode()
        if len(data) > OBJECT_BYTES - 4:
            data = json.dumps(str(value)[: OBJECT_BYTES // 2]).encode()
        mine = np.zeros(OBJECT_BYTES, np.uint8)
        mine[:4] = np.frombuffer(np.uint32(len(data)).tobytes(), np.uint8)
        mine[4 : 4 + len(data)] = np.frombuffer(data, np.uint8)
        every = np.zeros((comm.Get_size(), OBJECT_BYTES), np.uint8)
        self.wait(comm, comm.Iallgather(mine, every), what)
        out = []
        for row in every:
            size = int(np.frombuffer(row[:4].tobytes(), np.uint32)[0])
            out.append(json.loads(row[4 : 4 + size].tobytes().decode()))
        return out


class Pending:
    """A collective started and left running: looked at with `done()` (False while a
    member has not reached it; the RunFailure that names a dead member once MPI reports
    one), or waited for with the run's deadline."""

    __slots__ = ("collectives", "comm", "requests", "what")

    def __init__(self, collectives: Collectives, comm: Any, requests: list, what: str):
        self.collectives, self.comm, self.requests, self.what = collectives, comm, requests, what

    def done(self) -> bool:
        try:
            return test_all(self.requests)
        except CommFailure:
            raise self.collectives.failed(self.comm, self.what) from None

    def wait(self) -> None:
        self.collectives.wait_all(self.comm, self.requests, self.what)


def _host_side(buffer: np.ndarray | Staging) -> Any:
    """What MPI is given for `buffer`: the array itself, or its staging's host side
    holding the device array's values."""
    if isinstance(buffer, Staging):
        return buffer.to_host()
    if not isinstance(buffer, np.ndarray):
        raise TypeError(f"MPI is given host memory: a {type(buffer).__name__} goes through transport.staging.Staging")
    return buffer


def _device_side(buffer: np.ndarray | Staging) -> None:
    if isinstance(buffer, Staging):
        buffer.to_device()  # the device array takes what MPI wrote
