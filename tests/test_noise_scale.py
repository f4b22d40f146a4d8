"""The gradient noise scale estimator and McCandlish et al.'s samples ratio
(nbdist/metrics/noise_scale.py), on gradients whose noise is known."""

import numpy as np
import pytest

from nbdist.metrics.noise_scale import samples_ratio, simple_noise_scale


def batch_mean_sq_norms(
    gradient: np.ndarray, per_sample_var: float, batch: int, batches: int, rng: np.random.Generator
) -> list[float]:
    """|mean gradient of a batch|^2 for `batches` batches whose per-sample gradients are
    `gradient` plus independent noise of variance `per_sample_var` in every coordinate."""
    noise = rng.normal(0.0, np.sqrt(per_sample_var / batch), size=(batches, gradient.size))
    return list(((gradient + noise) ** 2).sum(axis=1))


@pytest.mark.parametrize("true_b", [20.0, 100.0, 400.0])
def test_the_estimate_finds_the_noise_scale_of_gradients_with_known_noise(true_b):
    rng = np.random.default_rng(0)
    d = 2000
    gradient = rng.normal(size=d)
    gradient /= np.linalg.norm(gradient)  # |G|^2 = 1
    var = true_b / d  # tr(Sigma) = d * var = true_b, so B_simple = true_b
    small = batch_mean_sq_norms(gradient, var, 32, 400, rng)
    big = batch_mean_sq_norms(gradient, var, 256, 100, rng)
    scale = simple_noise_scale(small, 32, big, 256)
    assert scale.gradient_sq == pytest.approx(1.0, rel=0.05)
    assert scale.trace_sigma == pytest.approx(true_b, rel=0.05)
    assert scale.b_simple == pytest.approx(true_b, rel=0.08)


def test_one_batch_size_alone_cannot_tell_signal_from_noise():
    # E|G_B|^2 = |G|^2 + tr(Sigma) / B: one batch size gives one equation for two unknowns.
    with pytest.raises(ValueError, match="b_small < b_big"):
        simple_noise_scale([1.0], 32, [1.0], 32)
    with pytest.raises(ValueError, match="at least one"):
        simple_noise_scale([], 32, [1.0], 256)


def test_pure_noise_gives_an_infinite_scale():
    rng = np.random.default_rng(1)
    zero = np.zeros(500)
    small = batch_mean_sq_norms(zero, 0.01, 32, 200, rng)
    big = batch_mean_sq_norms(zero, 0.01, 256, 200, rng)
    scale = simple_noise_scale(small, 32, big, 256)
    assert abs(scale.gradient_sq) < 0.05 * scale.trace_sigma / 32  # the estimate of 0 is small


def test_the_samples_ratio_runs_from_one_below_the_noise_scale_to_w_above_it():
    # (1 + W b / B) / (1 + b / B), written out.
    assert samples_ratio(32.0, 8, 32) == pytest.approx((1 + 8) / (1 + 1))
    assert samples_ratio(1e9, 8, 32) == pytest.approx(1.0)  # far below the noise scale: free
    assert samples_ratio(1e-3, 8, 32) == pytest.approx(8.0, rel=1e-3)  # far above it: W times
    assert samples_ratio(0.0, 8, 32) == 8.0
    # 8 workers of 32 within 1.5x of one worker need B_noise >= 416.
    assert samples_ratio(416.0, 8, 32) == pytest.approx(1.5)
    assert samples_ratio(400.0, 8, 32) > 1.5 > samples_ratio(450.0, 8, 32)
