"""Pipeline sends: activations forward and their gradients backward between the stage
ranks of one worker (--worker-parallel pipeline), as flat float32 buffers.

A micro-batch's activation goes to the next stage with `Isend` of its own memory; the
next stage receives it into a buffer of the agreed shape. The shape is sent once per
number of samples in a micro-batch (a batch shape: the last batch of an epoch, or a
micro-batch of a batch that does not divide evenly, has fewer), as a small int64 message before the first
activation of that shape; both sides cache it, so a step sends only float32 data. A
gradient going back has the shape of the activation it belongs to, which the receiving
stage sent itself: it needs no shape message.

Sends are not waited for one by one: two neighbouring stages may send to each other at
the same time (1F1B: one's activation forward, the other's gradient back), and two sends
that each waited for their receive would deadlock. They complete while the rank waits
for its next receive (MPI progresses every request of the process) and are all waited
for at the end of a step (`flush`). Every wait is the run's polled wait with its
deadline; a stage rank that died or froze is named (collectives.py).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from mpi4py import MPI

from nbdist.transport.collectives import Collectives
from nbdist.transport.compression import Block
from nbdist.transport.waiting import keep_pending

__all__ = ["StageLinks", "StageParts"]

TAG_SHAPE, TAG_ACTIVATION, TAG_GRADIENT = 31, 32, 33
MAX_DIMS = 8
BLOCK_WORDS = 3 + MAX_DIMS  # a parameter block gathered: start, stop, dimensions, shape


class StageLinks:
    """Stage `stage` of `count` on the worker's communicator `comm`, whose rank `s` is
    stage `s`. `wait_seconds` adds up the time spent waiting for receives (the bubble)."""

    def __init__(self, comm: Any, collectives: Collectives, stage: int, count: int):
        self.comm, self.collectives = comm, collectives
        self.stage, self.count = stage, count
        self._pending: list[tuple[Any, np.ndarray]] = []  # a send and the memory it reads
        self._sent_shapes: set[int] = set()
        self._shapes: dict[int, tuple[int, ...]] = {}  # rows -> the activation's shape from the previous stage

    def __del__(self) -> None:
        keep_pending(request for request, _ in getattr(self, "_pending", ()))  # waiting.keep_pending

    # -- forward --------------------------------------------------------------------
    def send_activation(self, activation: np.ndarray, rows: int) -> None:
        """`rows`: the micro-batch's samples, which both stages know (the activation's own
        first dimension need not be them)."""
        if rows not in self._sent_shapes:
            if activation.ndim > MAX_DIMS:
                raise ValueError(
                    f"stage {self.stage}'s output has {activation.ndim} dimensions; at most "
                    f"{MAX_DIMS} go between pipeline stages"
                )
            shape = np.zeros(MAX_DIMS + 1, np.int64)
            shape[0] = activation.ndim
            shape[1 : 1 + activation.ndim] = activation.shape
            self._send(shape, self.stage + 1, TAG_SHAPE)
            self._sent_shapes.add(rows)
        self._send(_float32(activation), self.stage + 1, TAG_ACTIVATION)

    def receive_activation(self, rows: int) -> np.ndarray:
        shape = self._shapes.get(rows)
        if shape is None:
            header = self._receive(
                np.zeros(MAX_DIMS + 1, np.int64), self.stage - 1, TAG_SHAPE, "the shape of an activation"
            )
            shape = self._shapes[rows] = tuple(int(d) for d in header[1 : 1 + int(header[0])])
        return self._receive(np.empty(shape, np.float32), self.stage - 1, TAG_ACTIVATION, "an activation")

    # -- backward -------------------------------------------------------------------
    def send_gradient(self, gradient: np.ndarray) -> None:
        self._send(_float32(gradient), self.stage - 1, TAG_GRADIENT)

    def receive_gradient(self, like: tuple[int, ...]) -> np.ndarray:
        return self._receive(np.empty(like, np.float32), self.stage + 1, TAG_GRADIENT, "an activation's gradient")

    # -- completion -----------------------------------------------------------------
    def flush(self) -> None:
        """Wait for every send of this step (their memory may then be reused)."""
        if self._pending:
            requests = [request for request, _ in self._pending]
            self._pending = []
            self.collectives.wait_all(self.comm, requests, f"pipeline stage {self.stage}'s sends")

    def _send(self, buffer: np.ndarray, dest: int, tag: int) -> None:
        self._pending.append((self.comm.Isend(buffer, dest=dest, tag=tag), buffer))

    def _receive(self, buffer: np.ndarray, source: int, tag: int, what: str) -> np.ndarray:
        request = self.comm.Irecv(buffer, source=source, tag=tag)
        self.collectives.wait(self.comm, request, f"{what} from pipeline stage {source} at stage {self.stage}")
        return buffer


def _float32(array: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(array, dtype=np.float32)


class StageParts:
    """The stages' flat buffers as one: the worker's leader (stage 0) gathers every
    stage's part of a buffer into the whole model's (its message to the master) and
    scatters the whole (the master's weights, its reply) back into the parts; and the
    parameters' shapes, for a codec of the whole message (--compression).

    `sizes[s]`: stage s's floats; `offsets[s]`: where they start in the whole buffer."""

    def __init__(self, comm: Any, collectives: Collectives, sizes: list[int], offsets: list[int]):
        self.comm, self.collectives = comm, collectives
        self.counts, self.displs = list(sizes), list(offsets)
        self.total = sum(sizes)

    def gather(self, part: np.ndarray, whole: np.ndarray | None, what: str) -> None:
        target = [whole, self.counts, self.displs, MPI.FLOAT] if whole is not None else None
        self.collectives.wait(self.comm, self.comm.Igatherv(part, target, root=0), what)

    def gather_blocks(self, blocks: list[Block], what: str) -> list[Block] | None:
        """The leader: every stage's parameter blocks (start, stop, shape) as stretches of
        the whole buffer, in the order of the buffer (a whole model's param_blocks(), which a
        codec for the whole model's message needs); None on the other stages."""
        here = self.displs[self.comm.Get_rank()]
        mine = np.zeros((len(blocks), BLOCK_WORDS), np.int64)
        for row, (start, stop, shape) in zip(mine, blocks, strict=True):
            if len(shape) > MAX_DIMS:
                raise ValueError(f"a parameter of {len(shape)} dimensions; at most {MAX_DIMS} in a pipeline stage")
            row[:3] = start + here, stop + here, len(shape)
            row[3 : 3 + len(shape)] = shape
        counts = [int(c) * BLOCK_WORDS for c in self.collectives.allgather(self.comm, len(blocks), what)]
        leader = self.comm.Get_rank() == 0
        every = np.empty(sum(counts), np.int64) if leader else None
        target = [every, counts, np.cumsum([0, *counts[:-1]]).tolist(), MPI.INT64_T] if leader else None
        self.collectives.wait(self.comm, self.comm.Igatherv(mine.ravel(), target, root=0), what)
        if every is None:  # not the leader
            return None
        rows = every.reshape(-1, BLOCK_WORDS)
        return sorted((int(r[0]), int(r[1]), tuple(int(d) for d in r[3 : 3 + r[2]])) for r in rows)

    def scatter(self, whole: np.ndarray | None, part: np.ndarray, what: str) -> None:
        source = [whole, self.counts, self.displs, MPI.FLOAT] if whole is not None else None
        self.collectives.wait(self.comm, self.comm.Iscatterv(source, part, root=0), what)
