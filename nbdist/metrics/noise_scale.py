"""The gradient noise scale: how many samples a step can use before more cost samples.

McCandlish, Kaplan, Amodei et al. ("An Empirical Model of Large-Batch Training", 2018)
model training to a given loss with batches of B samples as needing

    steps    S(B) = S_min (1 + B_noise / B)
    samples  E(B) = E_min (1 + B / B_noise)

so a run whose steps take W x b samples (W workers of batch b, synchronous) needs
(1 + W b / B_noise) / (1 + b / B_noise) times the samples of one worker: close to 1 while
W b is well below B_noise, close to W far above it. B_noise is estimated by the "simple"
noise scale B_simple = tr(Sigma) / |G|^2 (Sigma: the per-sample gradients' covariance, G
their mean), which follows from the squared norms of mean gradients over batches of two
sizes, since E|G_B|^2 = |G|^2 + tr(Sigma) / B (their appendix A.1):

    |G|^2    ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr Sigma ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

Each is averaged over many batches before the ratio is taken (the ratio of two noisy
estimates is biased). bench/noise_scale.py measures it along a one-worker run and says
what it allows W workers. Framework-free: it takes the squared norms.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from statistics import fmean

__all__ = ["NoiseScale", "simple_noise_scale", "samples_ratio"]


@dataclass(frozen=True, slots=True)
class NoiseScale:
    gradient_sq: float  # |G|^2, the squared norm of the true gradient
    trace_sigma: float  # tr(Sigma), the per-sample gradient variance summed over parameters

    @property
    def b_simple(self) -> float:
        """tr(Sigma) / |G|^2; infinite where the gradient is lost in the noise."""
        return self.trace_sigma / self.gradient_sq if self.gradient_sq > 0 else float("inf")


def simple_noise_scale(small_sq: Sequence[float], b_small: int, big_sq: Sequence[float], b_big: int) -> NoiseScale:
    """The noise scale from the squared norms of mean gradients over batches of `b_small`
    samples (`small_sq`, one per batch) and of `b_big` samples (`big_sq`)."""
    if not 0 < b_small < b_big:
        raise ValueError(f"need 0 < b_small < b_big, got {b_small} and {b_big}")
    if not small_sq or not big_sq:
        raise ValueError("need at least one squared norm of each batch size")
    small, big = fmean(small_sq), fmean(big_sq)
    gradient_sq = (b_big * big - b_small * small) / (b_big - b_small)
    trace_sigma = (small - big) / (1.0 / b_small - 1.0 / b_big)
    return NoiseScale(gradient_sq, trace_sigma)


def samples_ratio(noise_scale: float, workers: int, batch: int) -> float:
    """The samples `workers` synchronous workers of `batch` samples need to reach a loss,
    over what one worker needs, in McCandlish et al.'s model: (1 + W b / B) / (1 + b / B)."""
    if noise_scale <= 0:
        return float(workers)  # no noise to average away: every sample is a step's worth
    return (1.0 + workers * batch / noise_scale) / (1.0 + batch / noise_scale)
