"""A study's messages between its coordinator (rank 0 of the world) and the groups that
train its trials (roles/study.py): small pickled tuples, never weights.

The coordinator sends a group's leader its next trial (TAG_TRIAL) and, to prune, every
fold leader of the group the trial's number (TAG_PRUNE); a fold leader reports each epoch
(TAG_EPOCH), a group's leader the trial's end (TAG_DONE). Sends never block (a group that
is busy training takes its message later); receives are probed, so neither side is ever
held inside MPI.
"""

from __future__ import annotations

from typing import Any

from mpi4py import MPI

from nbdist.transport.faults import failed_ranks
from nbdist.transport.waiting import receive_object, wait

__all__ = ["CoordinatorChannel", "GroupChannel", "RanksFailed", "TAG_TRIAL", "TAG_EPOCH", "TAG_PRUNE", "TAG_DONE"]

TAG_TRIAL, TAG_EPOCH, TAG_PRUNE, TAG_DONE = 301, 302, 303, 304


class RanksFailed(Exception):
    """MPI's fault tolerance reports these world ranks dead (acknowledged: the next probe
    goes on without them)."""

    def __init__(self, ranks: list[int]):
        super().__init__(f"ranks {ranks} died")
        self.ranks = ranks


class CoordinatorChannel:
    """The coordinator's end: sends to the groups' leaders, messages from any rank."""

    __slots__ = ("world", "sends", "status")

    def __init__(self, world: Any):
        self.world = world
        self.sends: list = []
        self.status = MPI.Status()

    def send(self, message: Any, dest: int, tag: int) -> None:
        self.sends = [r for r in self.sends if not r.Test()]
        self.sends.append(self.world.isend(message, dest=dest, tag=tag))

    def send_if_alive(self, message: Any, dest: int, tag: int) -> None:
        """As send, for a rank that may be gone (nothing is sent then)."""
        try:
            self.send(message, dest, tag)
        except MPI.Exception:
            pass

    def next_message(self) -> tuple[int, Any] | None:
        """(tag, message) of a message that is in from any rank, or None; RanksFailed when
        a rank died (ULFM fails wildcard probes until the failure is acknowledged)."""
        try:
            found = self.world.iprobe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=self.status)
        except MPI.Exception:
            dead = failed_ranks(self.world, self.world)
            try:
                self.world.Ack_failed()
            except (MPI.Exception, AttributeError):
                pass
            raise RanksFailed(dead) from None
        if not found:
            return None
        tag, source = self.status.Get_tag(), self.status.Get_source()
        return tag, self.world.recv(source=source, tag=tag)

    def flush(self, timeout: float) -> None:
        """Wait for the sends in flight, each up to `timeout` s; one that a group never
        takes is no reason to hang."""
        for request in self.sends:
            try:
                wait(request, timeout=timeout)
            except Exception:
                pass


class GroupChannel:
    """A group's end (its fold leaders and its leader): the coordinator is rank 0."""

    __slots__ = ("world", "sends")

    def __init__(self, world: Any):
        self.world = world
        self.sends: list = []

    def receive(self, tag: int, timeout: float) -> Any:
        """The coordinator's next message with `tag` (WaitTimeout, CommFailure)."""
        return receive_object(self.world, 0, tag, timeout=timeout)

    def report(self, message: Any, tag: int) -> None:
        """Send without waiting (flush waits for them all)."""
        self.sends.append(self.world.isend(message, dest=0, tag=tag))
        self.sends = [r for r in self.sends if not r.Test()]

    def pending(self, tag: int) -> list[Any]:
        """The coordinator's messages with `tag` that are in, without waiting."""
        messages = []
        while self.world.iprobe(source=0, tag=tag):
            messages.append(self.world.recv(source=0, tag=tag))
        return messages

    def flush(self, timeout: float) -> None:
        for request in self.sends:
            wait(request, timeout=timeout)
        self.sends = []

    def send(self, message: Any, tag: int, timeout: float) -> None:
        """One message, waited for (up to `timeout` s)."""
        wait(self.world.isend(message, dest=0, tag=tag), timeout=timeout)
