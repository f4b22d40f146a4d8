"""A study's messages between its coordinator (rank 0 of the world) and the groups that
train its trials (roles/study.py), and the training states that PBT copies from one
group to another.

The coordinator sends a group's leader its next segment of a trial (TAG_TRIAL); a fold
leader reports each epoch as it ends (TAG_EPOCH), and the coordinator answers it, or
stops a trial unasked, with a verdict (TAG_VERDICT) to the fold leaders; a group's leader
reports the segment's end (TAG_DONE). These are small pickled tuples. Sends never block (a
group that is busy training takes its message later); receives are probed, so neither side
is ever held inside MPI.

A training state goes from each rank of one group to the rank in the same place of
another (`send_state`, `receive_state`): a small pickled header naming its arrays, then
each array as one buffer (mpi4py's upper-case methods: no pickling, no copy of a
contiguous array, no file), and the receiver's acknowledgement once it has kept it.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
from mpi4py import MPI

from nbdist.transport.faults import failed_ranks
from nbdist.transport.waiting import keep_pending, receive_object, wait, wait_all

__all__ = [
    "CoordinatorChannel",
    "GroupChannel",
    "RanksFailed",
    "send_state",
    "receive_state",
    "acknowledge",
    "await_acknowledgement",
    "TAG_TRIAL",
    "TAG_EPOCH",
    "TAG_VERDICT",
    "TAG_DONE",
    "TAG_STATE",
    "TAG_STATE_DATA",
    "TAG_STATE_ACK",
]

TAG_TRIAL, TAG_EPOCH, TAG_VERDICT, TAG_DONE = 301, 302, 303, 304
TAG_STATE, TAG_STATE_DATA, TAG_STATE_ACK = 305, 306, 307


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

    def __del__(self) -> None:
        keep_pending(getattr(self, "sends", ()))  # dropped in flight: waiting.keep_pending

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

    def __del__(self) -> None:
        keep_pending(getattr(self, "sends", ()))  # dropped in flight: waiting.keep_pending

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


def _bytes_of(array: np.ndarray) -> np.ndarray:
    """The array's bytes as a flat uint8 view (a copy only if it is not contiguous)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


def send_state(world: Any, dest: int, arrays: dict[str, dict[str, np.ndarray]], info: dict[str, Any]) -> list[Any]:
    """Start sending a rank's training state (groups of named arrays) to rank `dest`; the
    caller waits for the returned requests (and, with `receive_object(..., TAG_STATE_ACK)`,
    for the receiver's word that it kept it)."""
    names = [
        (group, name, np.asarray(a).dtype.str, np.asarray(a).shape)
        for group, named in arrays.items()
        for name, a in named.items()
    ]
    requests = [world.isend({"info": info, "arrays": names}, dest=dest, tag=TAG_STATE)]
    for group, name, _, _ in names:
        array = np.asarray(arrays[group][name])
        if array.size:
            requests.append(world.Isend(_bytes_of(array), dest=dest, tag=TAG_STATE_DATA))
    return requests


def receive_state(world: Any, source: int, timeout: float) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, Any]]:
    """The training state rank `source` sends with `send_state`: (arrays, info)."""
    header = cast(dict[str, Any], receive_object(world, source, TAG_STATE, timeout=timeout))
    arrays: dict[str, dict[str, np.ndarray]] = {}
    requests = []
    for group, name, dtype, shape in header["arrays"]:
        array = np.empty(tuple(shape), dtype=np.dtype(dtype))
        arrays.setdefault(group, {})[name] = array
        if array.size:
            requests.append(world.Irecv(array.reshape(-1).view(np.uint8), source=source, tag=TAG_STATE_DATA))
    wait_all(requests, timeout=timeout)
    return arrays, header["info"]


def acknowledge(world: Any, dest: int, info: Any, timeout: float) -> None:
    """Tell rank `dest` that the state it sent is kept."""
    wait(world.isend(info, dest=dest, tag=TAG_STATE_ACK), timeout=timeout)


def await_acknowledgement(world: Any, source: int, timeout: float) -> Any:
    return receive_object(world, source, TAG_STATE_ACK, timeout=timeout)
