"""Gradient compression codecs (nbdist.transport.compression) on numpy arrays, and the
--compression option: what each codec keeps, error feedback, PowerSGD on low-rank matrices."""

from __future__ import annotations

import numpy as np
import pytest

from nbdist.options import TrainOptions
from nbdist.specs import Spec, SpecError
from nbdist.transport.compression import Bf16, Compressor, Fp16, PowerSgd, TopK, make_codec, parse_compression

RNG = np.random.default_rng(5)


def _round_trip(codec, x):
    wire = np.zeros(codec.wire_size, np.float32)
    codec.encode(x, wire)
    out = np.empty_like(x)
    codec.decode(wire, out)
    return wire, out


@pytest.mark.parametrize("codec, eps", [(Fp16, 2.0**-11), (Bf16, 2.0**-8)])
def test_fp16_and_bf16_round_trip_within_their_precision_in_half_the_words(codec, eps):
    # Magnitudes within fp16's normal range (below 6e-5 it has fewer digits).
    x = (RNG.choice([-1.0, 1.0], 1001) * 10.0 ** RNG.uniform(-3, 3, 1001)).astype(np.float32)
    wire, out = _round_trip(codec(x.size), x)
    assert wire.size == 501
    # Round to nearest: half a unit in the last place, relative.
    assert np.all(np.abs(out - x) <= eps * np.abs(x)), np.max(np.abs(out - x) / np.abs(x))
    assert np.array_equal(_round_trip(codec(x.size), out)[1], out)  # representable values pass as they are


def test_fp16_bits_are_numpys_conversion_including_subnormals_infinities_and_nan():
    values = np.concatenate(
        [
            RNG.standard_normal(20000) * 10.0 ** RNG.uniform(-12, 6, 20000),
            [0.0, -0.0, np.inf, -np.inf, 65504, 65520, 65519.99, 6e-8, 2.98e-8, 2.99e-8],
        ]
    )
    x = np.concatenate(
        [values.astype(np.float32), RNG.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32)]
    )  # every kind of bit pattern
    wire, out = _round_trip(Fp16(x.size), x)
    finite = ~np.isnan(x)
    with np.errstate(over="ignore"):
        expected = x.astype(np.float16)
    assert np.array_equal(wire.view(np.float16)[: x.size][finite].view(np.uint16), expected[finite].view(np.uint16))
    assert np.isnan(out[~finite]).all() and np.array_equal(out[finite], expected[finite].astype(np.float32))


def test_bf16_rounds_like_torch():
    import torch

    x = RNG.standard_normal(4096).astype(np.float32) * 1e3
    _, out = _round_trip(Bf16(x.size), x)
    assert np.array_equal(out, torch.from_numpy(x).to(torch.bfloat16).float().numpy())


def test_topk_keeps_exactly_the_k_largest_magnitudes():
    x = RNG.permutation(np.arange(1, 1001, dtype=np.float32) * RNG.choice([-1, 1], 1000))
    codec = TopK(x.size, 0.05)
    wire, out = _round_trip(codec, x)
    assert codec.k == 50 and wire.size == 100
    kept = np.flatnonzero(out)
    assert set(np.abs(x[kept])) == set(np.arange(951, 1001, dtype=np.float32))
    assert np.array_equal(out[kept], x[kept])
    summed = np.ones_like(x)
    codec.decode_add(wire, summed)
    assert np.array_equal(summed, out + 1)


def test_powersgd_of_a_rank_r_matrix_is_exact_and_vectors_pass_uncompressed():
    rows, cols, r = 40, 30, 3
    matrix = (RNG.standard_normal((rows, r)) @ RNG.standard_normal((r, cols))).astype(np.float32)
    bias = RNG.standard_normal(40).astype(np.float32)
    x = np.concatenate([bias, matrix.ravel()])
    codec = PowerSgd(x.size, r, [(0, 40, (40,)), (40, 40 + rows * cols, (rows, cols))])
    wire, out = _round_trip(codec, x)
    assert wire.size == 40 + r * (rows + cols)
    assert np.array_equal(out[:40], bias)
    np.testing.assert_allclose(out[40:], matrix.ravel(), atol=1e-4 * np.abs(matrix).max())
    # A rank-1 codec keeps only the best rank-1 part of it.
    _, lossy = _round_trip(PowerSgd(x.size, 1, [(0, 40, (40,)), (40, 40 + rows * cols, (rows, cols))]), x)
    assert np.abs(lossy[40:] - matrix.ravel()).max() > 1e-2


@pytest.mark.parametrize("spec", ["topk(0.1)", "powersgd(1)"])
def test_error_feedback_sends_everything_in_the_end(spec):
    blocks = [(0, 12, (12,)), (12, 12 + 20 * 15, (20, 15))]
    n = blocks[-1][1]
    compressor = Compressor(make_codec(parse_compression(spec), n, blocks))
    given, sent = np.zeros(n, np.float64), np.zeros(n, np.float64)
    out = np.empty(n, np.float32)
    for _ in range(20):
        grad = RNG.standard_normal(n).astype(np.float32)
        given += grad
        compressor.codec.decode(compressor.compress(grad), out)
        sent += out
    # The sum of what was sent and what is kept is the sum of the gradients.
    np.testing.assert_allclose(sent + compressor.residual, given, atol=1e-4)
    assert np.abs(compressor.residual).max() > 0.1  # and much was kept back
    # fp16 and bf16 lose only rounding: they keep nothing back.
    assert Compressor(Fp16(n)).residual is None and Compressor(Bf16(n)).residual is None


def test_the_compression_option_parses_or_names_the_choices():
    assert parse_compression("none") is None
    assert parse_compression("topk(0.01)") == Spec("topk", {"ratio": 0.01}) == parse_compression("topk(ratio=0.01)")
    assert parse_compression("powersgd(4)") == Spec("powersgd", {"rank": 4})
    assert TrainOptions(compression="bf16").validate().compression == "bf16"
    choices = "none, fp16, bf16, topk(RATIO), powersgd(RANK)"
    for bad, said in [
        ("zip", "unknown --compression 'zip'"),
        ("topk(1.5)", "ratio must be in (0, 1], got 1.5"),
        ("powersgd(0)", "rank must be >= 1, got 0"),
        ("fp16(2)", "cannot read --compression"),
        ("powersgd(2.5)", "rank must be a whole number"),
    ]:
        with pytest.raises(SpecError) as info:
            TrainOptions(compression=bad).validate()
        assert said in str(info.value), str(info.value)
        assert choices in str(info.value) or "must be" in str(info.value)
