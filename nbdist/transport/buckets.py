"""Gradient buckets reduced while backward still runs: one in-place `Iallreduce` per
bucket, started as soon as the backend says that bucket of the flat gradient is final
(later layers' buckets finish first); each start also pokes MPI (`Testall`) so the earlier
reductions progress during the rest of the backward pass. The allreduce role
(roles/allreduce.py) waits for the last ones after backward.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from nbdist.transport.staging import Staging
from nbdist.transport.waiting import wait_all

__all__ = ["GradientReducer"]


class GradientReducer:
    """Starts one in-place Iallreduce per gradient bucket from inside backward.

    The gradient goes through the transport's staging: on the host MPI reduces the
    backend's own memory; on a GPU, the device buffer itself (CUDA-aware MPI) or a pinned
    host copy of each bucket, copied back once the reductions are done.

    `finish_wait(requests)` waits for the last ones (default: waiting.wait_all; a run
    passes its polled collectives' wait, with the run's deadline and failure naming)."""

    __slots__ = ("comm", "staging", "buckets", "requests", "finish_wait")

    def __init__(self, comm: MPI.Intracomm, backend, bucket_floats: int, finish_wait=None):
        self.comm = comm
        self.staging = Staging(backend.rule_grads, backend.copier)
        self.requests: list[MPI.Request] = []
        self.finish_wait = finish_wait or wait_all
        self.buckets = backend.bucket_hooks(bucket_floats, self._bucket_ready)

    def _bucket_ready(self, index: int) -> None:
        start, stop = self.buckets[index]
        self.requests.append(self.comm.Iallreduce(MPI.IN_PLACE, self.staging.to_host(start, stop), op=MPI.SUM))
        MPI.Request.Testall(self.requests)  # progress the earlier buckets

    def finish(self, trailer: np.ndarray) -> None:
        self.requests.append(self.comm.Iallreduce(MPI.IN_PLACE, trailer, op=MPI.SUM))
        try:
            self.finish_wait(self.requests)
        finally:
            self.requests.clear()
        self.staging.to_device()
