"""A client's end of the master/worker exchange: a worker's leader talking to its master,
or a sub-master talking to the top master (rank 0 of `comm` either way).

A message leaves as its parts (messages.Message.parts: the header, then the body of an
UPDATE); the reply comes back as a header and the payload array, received straight into
the arrays the client passes in. Every wait is polled and bounded by the master's
silence limit, so a master that died or froze ends this rank's wait with one error that
names it (RankLost, RankSilent), which the run's other ranks hear of over the control
channel.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from nbdist.transport import messages as m
from nbdist.transport.deadlines import Silence
from nbdist.transport.faults import RankLost, RankSilent
from nbdist.transport.waiting import CommFailure, WaitTimeout, keep_pending, wait_all

__all__ = ["WorkerChannel"]


class WorkerChannel:
    """`master` names the master for errors ("the master", "the top master"), `describe`
    turns a world rank into a name, `listener` is the world rank whose wait a timeout
    names (None: the error names no listener)."""

    __slots__ = (
        "comm",
        "reply_header",
        "reply_payload",
        "silence",
        "master",
        "master_rank",
        "describe",
        "listener",
        "replies",
    )

    def __init__(
        self,
        comm,
        reply_header: np.ndarray,
        reply_payload: np.ndarray,
        silence: Silence,
        *,
        master: str,
        master_rank: int,
        describe: Callable[[int], str],
        listener: int | None = None,
    ):
        self.comm = comm
        self.reply_header, self.reply_payload = reply_header, reply_payload
        self.silence = silence
        self.master, self.master_rank, self.describe, self.listener = master, master_rank, describe, listener
        self.replies: list = []

    def __del__(self) -> None:
        # A run that ended between posting the reply's receives and the reply: the
        # master's late reply must not land in freed memory (waiting.keep_pending).
        keep_pending(getattr(self, "replies", ()))

    def expect_reply(self) -> None:
        """Post the reply's receives (before sending, so the reply never waits for them)."""
        self.replies = [
            self.comm.Irecv(self.reply_header, source=0, tag=m.TAG_REPLY_HEADER),
            self.comm.Irecv(self.reply_payload, source=0, tag=m.TAG_REPLY),
        ]

    def send(self, message: m.Message) -> None:
        """The message's parts, polled rather than blocking: a master that is gone must not
        hold this rank in a Send."""
        self._await([self.comm.Isend(part, dest=0, tag=tag) for part, tag in message.parts()])

    def send_text(self, text: str) -> None:
        """The text that follows an ERROR or LOST header (a small pickled string)."""
        self._await([self.comm.isend(text, dest=0, tag=m.TAG_ERROR_TEXT)])

    def await_reply(self) -> None:
        replies, self.replies = self.replies, []
        self._await(replies)

    def _await(self, requests: list) -> None:
        name = f"{self.master}, {self.describe(self.master_rank)}"
        try:
            wait_all(requests, timeout=self.silence.limit)
        except CommFailure:
            raise RankLost(f"{name}, died: the run cannot go on", ranks=[self.master_rank], restartable=True) from None
        except WaitTimeout as exc:
            listener = "" if self.listener is None else f" {self.describe(self.listener)}"
            raise RankSilent(
                f"{name}, did not answer{listener} for {exc.seconds:.0f} s (the peer timeout): the run cannot go on",
                ranks=[self.master_rank],
            ) from None
        self.silence.heard()
