"""Gradient buckets reduced while backward still runs: one in-place `Iallreduce` per
bucket, started as soon as the backend says that bucket of the flat gradient is final
(later layers' buckets finish first); each start also pokes MPI (`Testall`) so the earlier
reductions progress during the rest of the backward pass. The allreduce role
(roles/allreduce.py) waits for the last ones after backward.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from nbdist.specs import Spec
from nbdist.transport.reduction import compressed_reduction
from nbdist.transport.staging import Staging
from nbdist.transport.waiting import wait_all

__all__ = ["GradientReducer"]


class GradientReducer:
    """Starts one in-place Iallreduce per gradient bucket from inside backward.

    The gradient goes through the transport's staging: on the host MPI reduces the
    backend's own memory; on a GPU, the device buffer itself (CUDA-aware MPI) or a pinned
    host copy of each bucket, copied back once the reductions are done.

    `finish_wait(requests)` waits for the last ones (default: waiting.wait_all; a run
    passes its polled collectives' wait, with the run's deadline and failure naming).

    With a `compression` (--compression), the buckets go through its codec instead
    (transport/reduction.py). `bytes_sent`: the gradient bytes this rank handed to MPI."""

    __slots__ = ("comm", "staging", "buckets", "requests", "finish_wait", "compressed", "plain_bytes")

    def __init__(self, comm: MPI.Intracomm, backend, bucket_floats: int, finish_wait=None,
                 compression: Spec | None = None):
        self.comm = comm
        # The codecs are numpy: a compressed gradient goes through host memory even where
        # MPI could read the device (cuda_aware=False: pinned host copies).
        self.staging = Staging(backend.rule_grads, backend.copier, cuda_aware=False if compression else None)
        self.requests: list[MPI.Request] = []
        self.finish_wait = finish_wait or wait_all
        self.buckets = backend.bucket_hooks(bucket_floats, self._bucket_ready)
        self.compressed = None if compression is None else compressed_reduction(
            comm, compression, backend.num_params, self.buckets, backend.param_blocks())
        self.plain_bytes = 0

    @property
    def bytes_sent(self) -> int:
        return self.plain_bytes + (self.compressed.bytes_sent if self.compressed is not None else 0)

    def _bucket_ready(self, index: int) -> None:
        start, stop = self.buckets[index]
        host = self.staging.to_host(start, stop)
        if self.compressed is None:
            self.requests.append(self.comm.Iallreduce(MPI.IN_PLACE, host, op=MPI.SUM))
            self.plain_bytes += host.nbytes
        else:
            self.requests += self.compressed.start(index, host)
        MPI.Request.Testall(self.requests)  # progress the earlier buckets

    def finish(self, trailer: np.ndarray) -> None:
        self.requests.append(self.comm.Iallreduce(MPI.IN_PLACE, trailer, op=MPI.SUM))
        try:
            self.finish_wait(self.requests)
        finally:
            self.requests.clear()
        if self.compressed is not None:
            self.compressed.finish(self.staging.to_host, self.finish_wait)
        self.staging.to_device()

    def state_arrays(self) -> dict[str, np.ndarray]:
        """What a compressed reduction carries from step to step (residuals, PowerSGD's Q)."""
        return self.compressed.state_arrays() if self.compressed is not None else {}

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        if self.compressed is not None:
            self.compressed.load_state_arrays(arrays)
