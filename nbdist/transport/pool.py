"""A master's receive buffers for message bodies, reused: a fixed number, however many
clients it serves.

A body is taken when its header is in (roles/master/receive.py), and given back once its update
is applied, or, when the reply is the body itself (an asynchronous EASGD master answers
each worker its own elastic step), once that reply has left. A synchronous round streams
its workers' bodies through the pool: each is given back once the rule has folded it in.
A buffer that MPI may still read (a lost
client's reply that never left) is written off: the pool may make a new one in its place.
"""

from __future__ import annotations

import numpy as np

from nbdist.transport.messages import Body

__all__ = ["BodyPool"]


class BodyPool:
    def __init__(self, n_payload: int, n_state: int, capacity: int, n_wire: int = 0):
        """`n_wire`: room for an encoded payload besides the decoded one (--compression)."""
        self.n_payload, self.n_wire, self.size = n_payload, n_wire, n_payload + n_state + n_wire
        self.capacity = max(capacity, 1)
        self.free: list[np.ndarray] = []
        self.lent = 0

    def take(self) -> Body | None:
        """A body to receive into, or None while all `capacity` are lent."""
        if self.free:
            buffer = self.free.pop()
        elif self.lent < self.capacity:
            buffer = np.empty(self.size, np.float32)
        else:
            return None
        self.lent += 1
        return Body(buffer, self.n_payload, self.n_wire)

    def give_back(self, body: Body) -> None:
        self.lent -= 1
        self.free.append(body.buffer)

    def write_off(self, body: Body) -> None:
        self.lent -= 1
