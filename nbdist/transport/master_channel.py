"""A master's end of the master/worker exchange with its clients (workers' leaders, and,
at a top master, the sub-masters), in the wire format of messages.py.

It keeps ONE receive posted per client, for the small header of its next message, so
every client is served in turn and none starves (unlike `recv(ANY_SOURCE)`); a body is
received only once its header is in, into a buffer the master lends (transport/pool.py).
Replies leave without blocking: `reply` returns the sends in flight, which the master
checks later. Every wait is polled (waiting.py); a peer that died shows as CommFailure.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from mpi4py import MPI

from nbdist.transport import messages as m
from nbdist.transport.waiting import keep_pending, receive_object, test_all, wait_all, wait_some

__all__ = ["MasterChannel", "Transfer"]


class Transfer:
    """Sends or receives in flight (a body being received, a reply leaving)."""

    __slots__ = ("requests",)

    def __init__(self, requests: list):
        self.requests = requests

    def __del__(self) -> None:
        keep_pending(getattr(self, "requests", ()))  # dropped in flight: waiting.keep_pending

    def done(self) -> bool:
        """Whether all have completed, without waiting; CommFailure if a peer failed."""
        return test_all(self.requests)

    def wait(self, timeout: float) -> None:
        """Until all have completed: WaitTimeout after `timeout` s, CommFailure if a peer failed."""
        wait_all(self.requests, timeout=timeout)


class MasterChannel:
    """`links[i]` = (communicator, peer rank on it, header buffer) of client i."""

    __slots__ = ("links", "headers")

    def __init__(self, links: Sequence[tuple[MPI.Comm, int, np.ndarray]]):
        self.links = list(links)
        self.headers = [MPI.REQUEST_NULL] * len(self.links)  # the posted header receives

    def __del__(self) -> None:
        # A run that ended with header receives posted: a client's late message must not
        # land in freed memory (waiting.keep_pending).
        keep_pending(getattr(self, "headers", ()))

    def post(self, i: int) -> None:
        """Post client i's receive for the header of its next message."""
        comm, peer, inbox = self.links[i]
        self.headers[i] = comm.Irecv(inbox, source=peer, tag=m.TAG_UPDATE)

    def forget(self, i: int) -> None:
        """Client i sends nothing more (retired, or its process is gone)."""
        self.headers[i] = MPI.REQUEST_NULL

    def listening(self, i: int) -> bool:
        """Whether a receive is posted for client i's next header."""
        return self.headers[i] != MPI.REQUEST_NULL

    def wait_headers(self, timeout: float | None) -> tuple[list[int], list[int]]:
        """(clients whose header is in, clients whose receive failed) once there is one
        of either, or ([], []) after `timeout` s. A failed receive is forgotten."""
        done, failed = wait_some(self.headers, timeout=timeout)
        for i, _failure in failed:
            self.forget(i)
        return done, [i for i, _ in failed]

    def receive_body(self, i: int, buffer: np.ndarray) -> Transfer:
        """Client i's body, sent right after its header, into `buffer`."""
        comm, peer, _ = self.links[i]
        return Transfer([comm.Irecv(buffer, source=peer, tag=m.TAG_BODY)])

    def reply(self, i: int, header: np.ndarray, payload: np.ndarray) -> Transfer:
        """The reply's header, then the payload array itself (no copy): neither may change
        until the transfer is done."""
        comm, peer, _ = self.links[i]
        return Transfer(
            [comm.Isend(header, dest=peer, tag=m.TAG_REPLY_HEADER), comm.Isend(payload, dest=peer, tag=m.TAG_REPLY)]
        )

    def error_text(self, i: int, timeout: float) -> object:
        """The text that follows client i's ERROR or LOST header (WaitTimeout, CommFailure)."""
        comm, peer, _ = self.links[i]
        return receive_object(comm, peer, m.TAG_ERROR_TEXT, timeout=timeout)
