"""The wire format between workers and masters: a small header in front of a flat payload.

A worker's message is ONE float32 buffer, [header | payload | model state], sent in two
parts: the header (TAG_UPDATE), then, for an UPDATE, the body [payload | model state]
(TAG_BODY). The master keeps one small receive posted per client, for its header, and
receives a body into a pooled buffer only once its header is in: its memory does not
grow with the number of workers. The header is 10 float64 slots viewed over the first
20 floats (float64 holds versions and sample counts exactly). Replies travel as a header
message followed by the payload array itself, so the master sends its centre without
copying it. With --compression a worker's payload travels encoded (transport/compression.py):
the body is then [model state | wire], and the master decodes the wire into the payload
slot of its receive buffer before the rule sees it; replies stay float32. A sub-master
speaks the same format to the top master (roles/hierarchy.py).

A reply header carries, after the 10 slots, WINDOW: the worker's next window in local
steps, where its master sets each worker's window by its speed (dynamic local steps,
roles/master/windows.py; 0: the worker keeps its window). Then one slot per worker of
the master: 1.0 for the workers that share the data of epoch `reply[EPOCH]` (the epoch
after the one the worker's message ended; roles/membership.py), 0.0 for those dropped.
"""

from __future__ import annotations

import numpy as np

HEADER_FLOATS = 20  # 10 float64 slots

# slots. CHECKPOINT: one label acknowledged (or, in a STOP reply, the stop label).
# EPOCHS_ACKED: every epoch checkpoint up to this epoch acknowledged (synchronous workers
# and sub-masters, whose acks can complete several at once; 0 = none). MERGED_SAMPLES: the
# training samples of the updates a sub-master's push merges (its SAMPLES are its epoch's,
# at the epoch's end).
KIND, VERSION, EPOCH, SAMPLES, LOSS_SUM, METRIC_SUM, FLAGS, CHECKPOINT, EPOCHS_ACKED, MERGED_SAMPLES = range(10)

# reply header slots after those 10: the next window, then the membership (new_header).
WINDOW = HEADER_FLOATS // 2
MEMBERS = WINDOW + 1

# worker -> master kinds. LOST: the worker cannot go on (one of its processes died) but
# the run can, without it (asynchronous rules).
UPDATE, DONE, ERROR, LOST = 1.0, 2.0, 3.0, 4.0
# master -> worker kinds. SNAPSHOT: the update was not applied; save this rank's share of
# checkpoint CHECKPOINT, then send it again. DROPPED: the master went on without this
# worker (it was silent too long); it must leave.
CONTINUE, STOP, SNAPSHOT, DROPPED = 1.0, 2.0, 3.0, 4.0

# flags (bit field)
EPOCH_END = 1
STOP_REQUEST = 2

# tags
TAG_UPDATE, TAG_REPLY_HEADER, TAG_REPLY, TAG_ERROR_TEXT, TAG_BODY = 11, 12, 13, 14, 15

NO_CHECKPOINT = -1.0


def label_code(label: str) -> float:
    """Checkpoint labels travel in a header slot: `epoch-K` as K >= 1, `stopped-V` (the
    centre version when the stop began) as -(V + 2), so the two never collide."""
    kind, _, number = label.partition("-")
    return float(int(number)) if kind == "epoch" else float(-int(number) - 2)


def label_of(code: float) -> str:
    value = int(code)
    return f"epoch-{value:04d}" if value >= 0 else f"stopped-{-value - 2:010d}"


class Message:
    """A contiguous float32 buffer with a float64 header view and payload/state views.
    Message(0) is a header alone: what a master's posted receive fills. `n_wire`: the
    words of the payload's encoding, sent in its place (after the state)."""

    __slots__ = ("buffer", "header", "payload", "state", "wire")

    def __init__(self, n_payload: int = 0, n_state: int = 0, n_wire: int = 0):
        self.buffer = np.zeros(HEADER_FLOATS + n_payload + n_state + n_wire, dtype=np.float32)
        self.header = self.buffer[:HEADER_FLOATS].view(np.float64)
        self.payload = self.buffer[HEADER_FLOATS : HEADER_FLOATS + n_payload]
        self.state = self.buffer[HEADER_FLOATS + n_payload : HEADER_FLOATS + n_payload + n_state]
        self.wire = self.buffer[HEADER_FLOATS + n_payload + n_state :]

    def has(self, flag: int) -> bool:
        return bool(int(self.header[FLAGS]) & flag)

    def parts(self) -> list[tuple[np.ndarray, int]]:
        """(array, tag) to send, in order: the header, and the body of an UPDATE (DONE,
        ERROR and LOST are their header alone)."""
        head = [(self.buffer[:HEADER_FLOATS], TAG_UPDATE)]
        body = self.buffer[HEADER_FLOATS + (self.payload.size if self.wire.size else 0) :]
        return head + [(body, TAG_BODY)] if self.header[KIND] == UPDATE else head


class Body:
    """A received body [payload | model state], in a buffer lent by a master's pool; with
    `n_wire`, the buffer is [payload | model state | wire] and an encoded body is received
    into [model state | wire]."""

    __slots__ = ("buffer", "payload", "state", "wire")

    def __init__(self, buffer: np.ndarray, n_payload: int, n_wire: int = 0):
        self.buffer = buffer
        self.payload = buffer[:n_payload]
        self.state = buffer[n_payload : buffer.size - n_wire]
        self.wire = buffer[buffer.size - n_wire :]

    def incoming(self, encoded: bool) -> np.ndarray:
        """Where MPI receives the body: [state | wire] when its payload is encoded."""
        return self.buffer[self.payload.size :] if encoded else self.buffer[: self.buffer.size - self.wire.size]


def new_header(workers: int = 0) -> np.ndarray:
    """A reply header: the 10 slots, WINDOW and one slot per worker (their membership)."""
    return np.zeros(MEMBERS + workers, dtype=np.float64)


def members_in(reply: np.ndarray) -> tuple[int, ...]:
    """The workers a reply header names as sharing the data of epoch reply[EPOCH]."""
    return tuple(int(w) for w in np.flatnonzero(reply[MEMBERS:]))
