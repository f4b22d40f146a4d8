"""Gradient compression for the wire: fp16, bf16, top-k and PowerSGD codecs, error feedback.

A codec turns a float32 vector of a fixed length into a fixed number of float32 words
(the wire), and back. Fixed sizes keep every message a plain MPI buffer: an allgather
of equal parts, a master's pooled receive. Pure numpy, no MPI: transport/reduction.py
puts the codecs on an allreduce, roles/worker.py and roles/master.py on a worker's
message to its master.

- fp16 / bf16: each value rounded to 16 bits (two to a word); the sum is taken in fp32.
- topk(ratio): the `ratio` fraction of the entries largest in magnitude, as values and
  int32 indices (Aji & Heafield 2017; Lin et al. 2018).
- powersgd(rank): each matrix-shaped parameter M (a conv kernel as out x rest) sent as
  rank-r factors P (orthonormal) and Q with M ~ P Q^T, Q warm-started from the previous
  step; vectors (biases) go uncompressed, as in PyTorch's powerSGD_hook (Vogels et al.
  2019).

Top-k and PowerSGD drop most of a gradient, so they keep what they dropped and add it
to the next one (error feedback, `Compressor`): over the steps, everything is sent.

Every codec registers on `CODECS` (nbdist.registry): --compression's choices, help and
checks are made from the codecs' classes (their name, constructor parameters with
defaults, `parameter_help` and `parameter_ranges`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from nbdist.registry import Registry
from nbdist.specs import Spec, SpecError, ValueRange, did_you_mean, parse_spec

__all__ = [
    "CODECS",
    "Codec",
    "Uncompressed",
    "Fp16",
    "Bf16",
    "TopK",
    "PowerSgd",
    "Compressor",
    "Block",
    "parse_compression",
    "make_codec",
]

# A stretch of the flat buffer holding one parameter: (start, stop, shape).
Block = tuple[int, int, tuple[int, ...]]


class Codec(ABC):
    """Encodes float32 vectors of length `n` into `wire_size` float32 words, and back.

    What `--compression` names: `fp16`, `bf16`, `topk(RATIO)`, `powersgd(RANK)`. The wire
    has a fixed size, so that every message stays a plain MPI buffer. A codec whose
    `feedback` is set drops part of each vector; `Compressor` keeps what it dropped and
    adds it to the next one (error feedback). Codecs with a state (PowerSGD's warm start)
    checkpoint it through `state_arrays` / `load_state_arrays`.

    Args:
        n: The length of the vectors it encodes (a model's flat gradient, or a bucket).

    Example:
        Top-k keeps the k entries largest in magnitude, as k values and k indices:

        >>> import numpy as np
        >>> from nbdist.transport.compression import TopK
        >>> codec = TopK(8, ratio=0.25)
        >>> x = np.array([0.1, -3.0, 0.2, 0.0, 2.0, 0.1, 0.0, 0.3], np.float32)
        >>> wire = np.empty(codec.wire_size, np.float32)
        >>> codec.encode(x, wire)
        >>> out = np.empty(8, np.float32)
        >>> codec.decode(wire, out)
        >>> codec.wire_size, out
        (4, array([ 0., -3.,  0.,  0.,  2.,  0.,  0.,  0.], dtype=float32))
    """

    name: ClassVar[str]
    parameter_help: ClassVar[dict[str, str]] = {}
    # Where each parameter may lie (a whole number where its default is an int).
    parameter_ranges: ClassVar[dict[str, ValueRange]] = {}
    # Whether what the codec drops is worth carrying to the next step (error feedback).
    feedback: ClassVar[bool] = False
    # Whether it needs the parameters' shapes (`blocks`, the stretches of the flat buffer).
    uses_blocks: ClassVar[bool] = False

    def __init__(self, n: int):
        self.n = n

    @property
    @abstractmethod
    def wire_size(self) -> int:
        """The number of float32 words an encoded vector takes."""

    @abstractmethod
    def encode(self, x: np.ndarray, wire: np.ndarray) -> None:
        """wire[:] = `x` (float32, length `n`) encoded; `wire` has `wire_size` words."""

    @abstractmethod
    def decode(self, wire: np.ndarray, out: np.ndarray) -> None:
        """out[:] = the vector `wire` stands for."""

    def decode_add(self, wire: np.ndarray, out: np.ndarray) -> None:
        """out += the vector `wire` stands for (summing ranks' parts in fp32)."""
        decoded = np.empty(self.n, np.float32)
        self.decode(wire, decoded)
        out += decoded

    def state_arrays(self) -> dict[str, np.ndarray]:
        """What the codec carries from step to step (PowerSGD's warm start), for checkpoints."""
        return {}

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:  # noqa: B027
        """Take back what state_arrays gave (a resume); by default there is nothing."""


CODECS: Registry[Codec] = Registry("codec", skip=1, supplied=("blocks",))


@CODECS.register
class Uncompressed(Codec):
    """float32 as it is: nothing saved, nothing lost."""

    name = "none"

    @property
    def wire_size(self) -> int:
        return self.n

    def encode(self, x: np.ndarray, wire: np.ndarray) -> None:
        wire[:] = x

    def decode(self, wire: np.ndarray, out: np.ndarray) -> None:
        out[:] = wire


@CODECS.register
class Fp16(Codec):
    """IEEE half precision (two values a word), rounded to nearest even; sums in fp32.

    The rounding is done by integer operations on the bits: numpy's own float16
    conversion is far slower, the more so for values below fp16's normal range (small
    gradients are common); bench/compression.py measures the codecs."""

    name = "fp16"

    @property
    def wire_size(self) -> int:
        return (self.n + 1) // 2

    def encode(self, x: np.ndarray, wire: np.ndarray) -> None:
        halves = wire.view(np.uint16)
        halves[: self.n] = _float_to_half(np.ascontiguousarray(x, np.float32))
        halves[self.n :] = 0

    def decode(self, wire: np.ndarray, out: np.ndarray) -> None:
        out.view(np.uint32)[:] = _half_to_float(wire.view(np.uint16)[: self.n])


def _float_to_half(x: np.ndarray) -> np.ndarray:
    """float32 -> float16 bits, round to nearest even (F. Giesen's float_to_half_fast3_rtne)."""
    u = x.view(np.uint32)
    sign = (u >> np.uint32(16)) & np.uint32(0x8000)
    a = u & np.uint32(0x7FFFFFFF)
    # Normal halves: rebias the exponent, round the 13 dropped mantissa bits to nearest even.
    rebias = np.uint32((((15 - 127) << 23) + 0xFFF) & 0xFFFFFFFF)  # adds modulo 2^32
    normal = (a + rebias + ((a >> np.uint32(13)) & np.uint32(1))) >> np.uint32(13)
    # Below 2^-14: adding 0.5 lets the float unit shift and round the mantissa into place.
    magic = np.uint32(((127 - 15) + (23 - 10) + 1) << 23)
    with np.errstate(all="ignore"):  # NaN and infinity lanes are replaced below
        small = (a.view(np.float32) + magic.view(np.float32)).view(np.uint32) - magic
    half = np.where(a < np.uint32(113 << 23), small, normal)
    # Too large for a half: infinity; NaN stays a (quiet) NaN.
    half = np.where(a >= np.uint32((127 + 16) << 23), np.where(a > np.uint32(255 << 23), 0x7E00, 0x7C00), half)
    return (half | sign).astype(np.uint16)


def _half_to_float(h: np.ndarray) -> np.ndarray:
    """float16 bits -> float32 bits (exact; F. Giesen's half_to_float). In place on one
    array, and the rare lanes (subnormal, infinite, NaN) by index."""
    bits = h.astype(np.uint32)
    sign = (bits & np.uint32(0x8000)) << np.uint32(16)
    bits &= np.uint32(0x7FFF)
    bits <<= np.uint32(13)
    exponent = bits & np.uint32(0x7C00 << 13)
    bits += np.uint32((127 - 15) << 23)
    special = np.flatnonzero(exponent == np.uint32(0x7C00 << 13))  # infinity and NaN
    bits[special] += np.uint32((128 - 16) << 23)
    subnormal = np.flatnonzero(exponent == 0)  # renormalised through the float unit
    magic = np.uint32(113 << 23).view(np.float32)
    bits[subnormal] = ((bits[subnormal] + np.uint32(1 << 23)).view(np.float32) - magic).view(np.uint32)
    bits |= sign
    return bits


@CODECS.register
class Bf16(Codec):
    """bfloat16 (two values a word): a float32's upper 16 bits, rounded to nearest even.

    numpy has no bfloat16 type; torch's own conversion rounds the same way."""

    name = "bf16"

    @property
    def wire_size(self) -> int:
        return (self.n + 1) // 2

    def encode(self, x: np.ndarray, wire: np.ndarray) -> None:
        bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
        rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
        halves = wire.view(np.uint16)
        halves[: self.n] = rounded
        halves[self.n :] = 0

    def decode(self, wire: np.ndarray, out: np.ndarray) -> None:
        out.view(np.uint32)[:] = wire.view(np.uint16)[: self.n].astype(np.uint32) << np.uint32(16)


@CODECS.register
class TopK(Codec):
    """The RATIO fraction of the entries largest in magnitude, as values and int32 indices;
    what it leaves out is sent later (error feedback; Aji & Heafield 2017)."""

    name = "topk"
    parameter_help = {"ratio": "the fraction of the entries sent, in (0, 1]"}
    parameter_ranges = {"ratio": ValueRange(0, 1, low_open=True)}
    feedback = True

    def __init__(self, n: int, ratio: float = 0.01):
        super().__init__(n)
        self.k = max(1, min(n, math.ceil(float(ratio) * n)))

    @property
    def wire_size(self) -> int:
        return 2 * self.k

    def encode(self, x: np.ndarray, wire: np.ndarray) -> None:
        k = self.k
        chosen = np.argpartition(np.abs(x), self.n - k)[self.n - k :].astype(np.int32)
        wire[:k] = x[chosen]
        wire[k:].view(np.int32)[:] = chosen

    def decode(self, wire: np.ndarray, out: np.ndarray) -> None:
        out[:] = 0.0
        self.decode_add(wire, out)

    def decode_add(self, wire: np.ndarray, out: np.ndarray) -> None:
        # The indices of one encoding are distinct: fancy += adds each value once.
        out[wire[self.k :].view(np.int32)] += wire[: self.k]


@CODECS.register
class PowerSgd(Codec):
    """Rank-RANK factors of each weight matrix, warm-started from the last step; biases as
    they are; what it leaves out is sent later (error feedback; Vogels et al. 2019).

    The wire is [vectors | P_1 | P_2 ... | Q_1 | Q_2 ...]. An allreduce reduces the first
    part (`p_size` words: the vectors and P = M Q), orthonormalises each P, then reduces
    the Q = M^T P that follow (reduction.py); a message to a master carries both parts.
    `blocks` (the parameters' stretches and shapes) say which are matrices (default: one
    vector)."""

    name = "powersgd"
    parameter_help = {"rank": "the rank of the factors (a whole number, at least 1)"}
    parameter_ranges = {"rank": ValueRange(1, None)}
    feedback = True
    uses_blocks = True

    def __init__(self, n: int, rank: int = 1, blocks: Sequence[Block] | None = None):
        super().__init__(n)
        rank = int(rank)
        blocks = [(0, n, (n,))] if blocks is None else blocks
        self.vectors: list[tuple[int, int]] = []
        self.matrices: list[tuple[int, int, int, int, int]] = []  # start, stop, rows, cols, r
        for start, stop, shape in blocks:
            rows, cols = (shape[0], (stop - start) // shape[0]) if len(shape) >= 2 else (1, stop - start)
            r = min(rank, rows, cols)
            if len(shape) < 2 or r * (rows + cols) >= rows * cols:
                self.vectors.append((start, stop))  # too small to gain from factors
            else:
                self.matrices.append((start, stop, rows, cols, r))
        self.n_vectors = sum(stop - start for start, stop in self.vectors)
        self.p_size = self.n_vectors + sum(rows * r for _, _, rows, _, r in self.matrices)
        self.q_size = sum(cols * r for _, _, _, cols, r in self.matrices)
        # The warm start: the same random Q on every rank, then each step's reduced Q.
        self.warm = np.random.default_rng(0).standard_normal(self.q_size).astype(np.float32)

    @property
    def wire_size(self) -> int:
        return self.p_size + self.q_size

    def _views(self, p: np.ndarray, q: np.ndarray):
        """Per matrix: (its stretch, P view, Q view) in the P and Q buffers."""
        p_at, q_at = self.n_vectors, 0
        for start, stop, rows, cols, r in self.matrices:
            yield (
                slice(start, stop),
                rows,
                cols,
                p[p_at : p_at + rows * r].reshape(rows, r),
                q[q_at : q_at + cols * r].reshape(cols, r),
            )
            p_at += rows * r
            q_at += cols * r

    def project(self, x: np.ndarray, p: np.ndarray) -> None:
        """p = [the vectors | M Q_warm for each matrix]."""
        at = 0
        for start, stop in self.vectors:
            p[at : at + stop - start] = x[start:stop]
            at += stop - start
        for where, rows, cols, p_m, q_m in self._views(p, self.warm):
            p_m[...] = x[where].reshape(rows, cols) @ q_m

    def back_project(self, x: np.ndarray, p: np.ndarray, q: np.ndarray) -> None:
        """Orthonormalise each (reduced) P in place; q = M^T P for each matrix."""
        for where, rows, cols, p_m, q_m in self._views(p, q):
            p_m[...] = np.linalg.qr(p_m)[0]
            q_m[...] = x[where].reshape(rows, cols).T @ p_m

    def reconstruct(self, p: np.ndarray, q: np.ndarray, out: np.ndarray) -> None:
        """out = [the vectors | P Q^T for each matrix]."""
        at = 0
        for start, stop in self.vectors:
            out[start:stop] = p[at : at + stop - start]
            at += stop - start
        for where, _, _, p_m, q_m in self._views(p, q):
            out[where] = (p_m @ q_m.T).reshape(-1)

    def encode(self, x: np.ndarray, wire: np.ndarray) -> None:
        p, q = wire[: self.p_size], wire[self.p_size :]
        self.project(x, p)
        self.back_project(x, p, q)
        self.warm[:] = q

    def decode(self, wire: np.ndarray, out: np.ndarray) -> None:
        self.reconstruct(wire[: self.p_size], wire[self.p_size :], out)

    def state_arrays(self) -> dict[str, np.ndarray]:
        return {"powersgd_q": self.warm}

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        if "powersgd_q" in arrays:
            self.warm[:] = arrays["powersgd_q"]


class Compressor:
    """A codec with its residual memory, for the codecs that drop most of a vector
    (Seide et al. 2014; Karimireddy et al. 2019): each vector is sent with the residual
    of the last added, and what the wire leaves out of that becomes the new residual, so
    the sum of the vectors sent plus the residual is the sum of the vectors given."""

    __slots__ = ("codec", "residual", "wire")

    def __init__(self, codec: Codec):
        self.codec = codec
        self.residual = np.zeros(codec.n, np.float32) if codec.feedback else None
        self.wire = np.zeros(codec.wire_size, np.float32)

    def corrected(self, x: np.ndarray) -> np.ndarray:
        """x plus the residual (x itself without error feedback)."""
        return x if self.residual is None else x + self.residual

    def keep_rest(self, corrected: np.ndarray, sent: np.ndarray) -> None:
        """The residual becomes what `sent` (the decoded wire) left out of `corrected`."""
        if self.residual is not None:
            np.subtract(corrected, sent, out=self.residual)

    def compress(self, x: np.ndarray, wire: np.ndarray | None = None) -> np.ndarray:
        """Encode x (with the residual) into `wire` (default: this compressor's own)."""
        wire = self.wire if wire is None else wire
        corrected = self.corrected(x)
        self.codec.encode(corrected, wire)
        if self.residual is not None:
            sent = np.empty_like(self.residual)
            self.codec.decode(wire, sent)
            self.keep_rest(corrected, sent)
        return wire

    def state_arrays(self) -> dict[str, np.ndarray]:
        residual = {} if self.residual is None else {"residual": self.residual}
        return {**residual, **self.codec.state_arrays()}

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        if self.residual is not None and "residual" in arrays:
            self.residual[:] = arrays["residual"]
        self.codec.load_state_arrays(arrays)


def _choices() -> str:
    """`none, fp16, bf16, topk(RATIO), powersgd(RANK)`: every codec with its parameters."""
    return ", ".join(
        name + (f"({', '.join(p.name.upper() for p in params)})" if (params := CODECS.parameters(name)) else "")
        for name in CODECS
    )


def parse_compression(text: str | Spec) -> Spec | None:
    """`topk(0.01)` or `topk(ratio=0.01)` -> Spec('topk', {'ratio': 0.01}); None for none.
    A codec of one parameter takes it by position too. One error naming the valid choices
    for anything else."""
    what = "--compression"
    single = {name: params[0].name for name in CODECS if len(params := CODECS.parameters(name)) == 1}
    try:
        spec = parse_spec(text, what=what, positional=single)
    except SpecError as exc:
        raise SpecError(f"{exc}; {what} takes one of: {_choices()}") from None
    if spec.name not in CODECS:
        raise SpecError(
            f"unknown {what} {spec.name!r}{did_you_mean(spec.name, CODECS.names())}; choose one of: {_choices()}"
        )
    params = CODECS.parameters(spec.name)
    if not params:
        if spec.kwargs:
            raise SpecError(f"{what} {spec.name} takes no parameter; choose one of: {_choices()}")
        return None if spec.name == Uncompressed.name else spec
    names = [p.name for p in params]
    unknown = [k for k in spec.kwargs if k not in names]
    if unknown:
        takes = f"one parameter, {names[0]}" if len(names) == 1 else f"the parameters {', '.join(names)}"
        example = ", ".join(f"{p.name}={p.default!r}" for p in params)
        raise SpecError(f"{what} {spec.name} takes {takes}, not {', '.join(unknown)}; e.g. {spec.name}({example})")
    spec = spec.with_defaults(**{p.name: p.default for p in params})
    ranges = CODECS.get(spec.name).parameter_ranges
    for p in params:
        value = spec.kwargs[p.name]
        if p.name in ranges:
            ranges[p.name].check(f"{what} {spec.name}", p.name, value)
        whole = isinstance(p.default, int) and not isinstance(p.default, bool)
        if whole and (isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value)):
            raise SpecError(f"{what} {spec.name}: {p.name} must be a whole number, got {value!r}")
    return spec


def make_codec(spec: Spec, n: int, blocks: Sequence[Block] | None = None) -> Codec:
    """The codec of a parsed --compression for vectors of length n; `blocks` (the
    parameters' stretches and shapes) tell PowerSGD the matrices (default: one vector)."""
    cls = CODECS.get(spec.name)
    supplied = {"blocks": list(blocks) if blocks is not None else None} if cls.uses_blocks else {}
    return cls(n, **supplied, **spec.kwargs)
