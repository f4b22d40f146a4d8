"""A gradient's allreduce through a codec (--compression): what goes on the wire per rank.

fp16, bf16 and top-k encodings do not add up on the wire (two top-k sets have different
indices; MPI has no 16-bit float sum), so each bucket's encoding is allgathered as it
becomes final in backward, and every rank decodes and sums the parts in fp32, in rank
order: every rank holds the same sum, bit for bit. PowerSGD's factors do add up: after
backward, P = M Q of every matrix (with the vectors, uncompressed) is allreduced, each P
orthonormalised, then Q = M^T P is allreduced, and M's sum is P Q^T (Vogels et al. 2019).

Each rank keeps what its encoding left out (error feedback; compression.Compressor), and
PowerSGD its last Q (the next step's warm start): `state_arrays` go into the rank's own
share of every checkpoint, so a resumed run goes on exactly.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import numpy as np
from mpi4py import MPI

from nbdist.specs import Spec
from nbdist.transport.compression import Block, Compressor, PowerSgd, make_codec

__all__ = ["CompressedReduction", "compressed_reduction"]

Wait = Callable[[list], None]  # waits for MPI requests (with the run's deadline)


class CompressedReduction(ABC):
    """Sums a flat gradient over `comm` through a codec, bucket by bucket.

    `start(i, host)` as bucket i (a host view) is final; once the requests it returned
    are done, `finish(whole, wait)` leaves the sum in every bucket (`whole()`: the host
    view of the whole gradient)."""

    def __init__(self, comm: MPI.Intracomm):
        self.comm = comm
        self.bytes_sent = 0  # what this rank handed to MPI, over the run

    @abstractmethod
    def start(self, index: int, host: np.ndarray) -> list[MPI.Request]: ...

    @abstractmethod
    def finish(self, whole: Callable[[], np.ndarray], wait: Wait) -> None: ...

    @abstractmethod
    def state_arrays(self) -> dict[str, np.ndarray]: ...

    @abstractmethod
    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None: ...


class GatheredBuckets(CompressedReduction):
    """fp16, bf16, top-k: each bucket's encoding allgathered, then decoded and summed."""

    def __init__(self, comm: MPI.Intracomm, spec: Spec, buckets: Sequence[tuple[int, int]]):
        super().__init__(comm)
        self.compressors = [Compressor(make_codec(spec, stop - start)) for start, stop in buckets]
        self.gathered = [np.empty((comm.Get_size(), c.codec.wire_size), np.float32) for c in self.compressors]
        self.hosts: list[np.ndarray | None] = [None] * len(buckets)

    def start(self, index: int, host: np.ndarray) -> list[MPI.Request]:
        wire = self.compressors[index].compress(host)
        self.hosts[index] = host
        self.bytes_sent += wire.nbytes
        return [self.comm.Iallgather(wire, self.gathered[index])]

    def finish(self, whole: Callable[[], np.ndarray], wait: Wait) -> None:
        for compressor, host, parts in zip(self.compressors, self.hosts, self.gathered, strict=True):
            if host is None:
                raise RuntimeError("finish() before every bucket was started")
            host[:] = 0.0
            for part in parts:  # fp32 accumulation, in rank order on every rank
                compressor.codec.decode_add(part, host)

    def _residuals(self) -> list[np.ndarray]:
        """The buckets' residuals, in order ([] for a codec without error feedback)."""
        return [c.residual for c in self.compressors if c.residual is not None]

    def state_arrays(self) -> dict[str, np.ndarray]:
        residuals = self._residuals()
        return {"residual": np.concatenate(residuals)} if residuals else {}

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        if "residual" not in arrays:
            return
        at = 0
        for residual in self._residuals():
            residual[:] = arrays["residual"][at : at + residual.size]
            at += residual.size


class PowerSgdReduction(CompressedReduction):
    """PowerSGD over the whole gradient after backward: two allreduces per step."""

    def __init__(self, comm: MPI.Intracomm, spec: Spec, n: int, blocks: Sequence[Block]):
        super().__init__(comm)
        self.compressor = Compressor(make_codec(spec, n, blocks))
        codec = self.compressor.codec
        if not isinstance(codec, PowerSgd):
            raise TypeError(f"PowerSgdReduction takes a powersgd codec, not {spec}")
        self.codec = codec
        self.p = np.empty(self.codec.p_size, np.float32)
        self.q = np.empty(self.codec.q_size, np.float32)

    def start(self, index: int, host: np.ndarray) -> list[MPI.Request]:
        return []  # the factors need every matrix's whole gradient

    def finish(self, whole: Callable[[], np.ndarray], wait: Wait) -> None:
        grad, codec = whole(), self.codec
        corrected = self.compressor.corrected(grad)
        codec.project(corrected, self.p)
        wait([self.comm.Iallreduce(MPI.IN_PLACE, self.p, op=MPI.SUM)])
        codec.back_project(corrected, self.p, self.q)
        # What this rank's own factors leave out: the vectors went uncompressed.
        sent = np.empty_like(corrected)
        codec.reconstruct(self.p, self.q, sent)
        for start, stop in codec.vectors:
            sent[start:stop] = corrected[start:stop]
        self.compressor.keep_rest(corrected, sent)
        wait([self.comm.Iallreduce(MPI.IN_PLACE, self.q, op=MPI.SUM)])
        codec.warm[:] = self.q
        codec.reconstruct(self.p, self.q, grad)
        self.bytes_sent += self.p.nbytes + self.q.nbytes

    def state_arrays(self) -> dict[str, np.ndarray]:
        return self.compressor.state_arrays()

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        self.compressor.load_state_arrays(arrays)


def compressed_reduction(
    comm: MPI.Intracomm, spec: Spec, n: int, buckets: Sequence[tuple[int, int]], blocks: Sequence[Block]
) -> CompressedReduction:
    """The reduction of `spec` for a gradient of n floats split into `buckets`, its
    parameters' stretches and shapes `blocks`."""
    if isinstance(make_codec(spec, n, blocks), PowerSgd):
        return PowerSgdReduction(comm, spec, n, blocks)
    return GatheredBuckets(comm, spec, buckets)
