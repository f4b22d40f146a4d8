"""A run's control channel: how a rank that cannot go on tells every other rank at once.

It is a duplicate of the run's communicator used for nothing else, so its messages never
mix with training traffic. A message is a small pickled tuple, a handful per run and
never on the hot path: (text, failed ranks, restartable, sender), ranks in the run's
communicator.

It also finds frozen ranks: a rank whose collective is about to run past its deadline
calls the roll (`start_roll_call`, a while before the deadline, so that the frozen ones
are named at the deadline itself, not a grace period after it); every rank that is
waiting anywhere answers from inside its wait, and the ranks that have not answered when
the deadline passes are the frozen ones (or ones far slower than the peer timeout
allows), which the caller then names. Answers to a roll call whose collective completed
after all are taken in by the next one (they count the same: that rank is alive).

Every wait of the process looks at the channel now and then (waiting.watch_with), so a
rank waiting anywhere (for its master, in an allreduce, for a checkpoint) learns within
milliseconds that the run is over and raises RunAborted with the sender's message; a rank
busy computing learns at its next wait. No rank is left waiting for one that gave up.
"""

from __future__ import annotations

import time
from typing import Any

from mpi4py import MPI

from nbdist.transport.faults import RunAborted, RunFailure
from nbdist.transport.waiting import keep_pending

__all__ = ["ControlChannel", "RollCall"]

TAG_FAILURE, TAG_ROLL_CALL, TAG_PRESENT, TAG_END = 901, 902, 903, 904
# How long a rank that told the others waits for its messages to leave (a dead or
# frozen receiver never takes them).
LINGER_SECONDS = 2.0


class ControlChannel:
    __slots__ = ("comm", "sends", "told")

    def __init__(self, comm: Any):
        self.comm = comm.Dup()  # its ranks are the run's
        self.sends: list[MPI.Request] = []
        self.told = False

    def tell_all(self, failure: RunFailure) -> None:
        """Say to every other live rank of the run that it cannot go on, and why (once)."""
        if self.told:
            return
        self.told = True
        me = self.comm.Get_rank()
        message = (str(failure), list(failure.ranks), bool(failure.restartable), me)
        for peer in range(self.comm.Get_size()):
            if peer == me or peer in failure.ranks:
                continue
            try:
                self.sends.append(self.comm.isend(message, dest=peer, tag=TAG_FAILURE))
            except MPI.Exception:
                pass  # that peer failed too: nobody to tell

    def check(self) -> None:
        """Raise RunAborted if another rank said the run cannot go on; answer roll calls."""
        status = MPI.Status()
        try:
            while self.comm.iprobe(source=MPI.ANY_SOURCE, tag=TAG_ROLL_CALL, status=status):
                caller = status.Get_source()
                self.comm.recv(source=caller, tag=TAG_ROLL_CALL)
                self.sends.append(self.comm.isend(None, dest=caller, tag=TAG_PRESENT))
            if not self.comm.iprobe(source=MPI.ANY_SOURCE, tag=TAG_FAILURE, status=status):
                return
            text, ranks, restartable, sender = self.comm.recv(source=status.Get_source(), tag=TAG_FAILURE)
        except MPI.Exception:
            # A peer of this channel died and nobody acknowledged it yet (ULFM fails any
            # wildcard probe until then). The role that talks to it finds out on its own
            # requests; this channel only carries explicit messages: acknowledge, go on.
            self._acknowledge_failures()
            return
        failure = RunAborted(text, ranks=ranks, restartable=restartable)
        failure.sender = sender
        raise failure

    def start_roll_call(self) -> RollCall:
        """Ask every other rank of the run to answer; `RollCall.silent()` later says who did not."""
        me = self.comm.Get_rank()
        peers = [p for p in range(self.comm.Get_size()) if p != me]
        for peer in peers:
            try:
                self.sends.append(self.comm.isend(None, dest=peer, tag=TAG_ROLL_CALL))
            except MPI.Exception:
                pass
        return RollCall(self, peers)

    def roll_call(self, grace: float) -> list[int]:
        """The ranks of the run that do not answer within `grace` seconds."""
        call = self.start_roll_call()
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and not call.complete:
            call.collect()
            self.check()  # answer the others' calls meanwhile (and hear of a failure)
            time.sleep(0.01)
        return call.silent()

    def say_ended(self) -> None:
        """Tell the run's leader (rank 0) that this rank has written its last record."""
        if self.comm.Get_rank() != 0:
            try:
                self.sends.append(self.comm.isend(None, dest=0, tag=TAG_END))
            except MPI.Exception:
                pass

    def await_ends(self, timeout: float) -> None:
        """Leader: wait (at most `timeout` seconds) until every other rank that is still
        alive said it ended. Point-to-point: a rank that died does not hold it up, and no
        collective is left half-done on a communicator with a dead member."""
        from nbdist.transport.faults import failed_ranks

        pending = set(range(1, self.comm.Get_size()))
        deadline = time.monotonic() + timeout
        status = MPI.Status()
        next_failure_check = 0.0
        while pending and time.monotonic() < deadline:
            try:
                while self.comm.iprobe(source=MPI.ANY_SOURCE, tag=TAG_END, status=status):
                    self.comm.recv(source=status.Get_source(), tag=TAG_END)
                    pending.discard(status.Get_source())
            except MPI.Exception:
                self._acknowledge_failures()
            if time.monotonic() >= next_failure_check:
                pending -= set(failed_ranks(self.comm, self.comm))
                next_failure_check = time.monotonic() + 0.5
            time.sleep(0.005)

    def _take_answers(self, answered: set[int]) -> None:
        status = MPI.Status()
        try:
            while self.comm.iprobe(source=MPI.ANY_SOURCE, tag=TAG_PRESENT, status=status):
                answered.add(status.Get_source())
                self.comm.recv(source=status.Get_source(), tag=TAG_PRESENT)
        except MPI.Exception:
            self._acknowledge_failures()

    def _acknowledge_failures(self) -> None:
        try:
            self.comm.Ack_failed()
        except (MPI.Exception, AttributeError, NotImplementedError):
            pass

    def close(self) -> None:
        """Let the messages this rank sent leave (briefly); the channel stays (see below)."""
        deadline = time.monotonic() + LINGER_SECONDS
        pending = list(self.sends)
        while pending and time.monotonic() < deadline:
            try:
                pending = [r for r in pending if not r.Test()]
            except MPI.Exception:
                break
            time.sleep(0.01)
        for request in pending:
            try:
                request.Cancel()
            except MPI.Exception:
                pass
        keep_pending(pending)  # a cancel that did not take: the message still leaves
        self.sends = []
        # The channel is not freed: a message from a rank that gave up may still arrive
        # for it, and Open MPI with fault tolerance on then never completes MPI_Finalize
        # (its finalizing barrier waits forever) when the channel was freed before. One
        # communicator handle per run is what this costs.


class RollCall:
    """A roll call in progress: the ranks asked, and those that answered so far."""

    __slots__ = ("channel", "peers", "answered")

    def __init__(self, channel: ControlChannel, peers: list[int]):
        self.channel, self.peers = channel, peers
        self.answered: set[int] = set()

    @property
    def complete(self) -> bool:
        return self.answered.issuperset(self.peers)

    def collect(self) -> None:
        """Take in the answers that have arrived."""
        self.channel._take_answers(self.answered)

    def silent(self) -> list[int]:
        """The ranks asked that have not answered (the answers in by now counted)."""
        self.collect()
        return [p for p in self.peers if p not in self.answered]
