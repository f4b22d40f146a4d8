"""A two-sample statistic for generated samples: the maximum mean discrepancy (MMD).

MMD^2 = E k(x, x') + E k(y, y') - 2 E k(x, y) with a fixed Gaussian kernel is zero when
the two distributions are equal and grows as they part. The unbiased estimate below has
no 1/n offset, so a batch's value and the validation set's agree on average (a batch's
is only noisier); it can fall slightly below zero.
"""

from __future__ import annotations

import numpy as np

__all__ = ["GaussianMMD", "median_distance"]

SCALES = (0.5, 1.0, 2.0)  # kernel widths, in units of the median distance


def _squared_distances(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    d = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * a @ b.T
    return np.maximum(d, 0.0)


def median_distance(x: np.ndarray) -> float:
    """The median distance between the samples of `x` (the kernel's natural width)."""
    flat = np.asarray(x, np.float64).reshape(len(x), -1)
    d = _squared_distances(flat, flat)[np.triu_indices(len(flat), k=1)]
    return float(np.sqrt(np.median(d))) if d.size else 1.0


class GaussianMMD:
    """MMD^2 with a sum of Gaussian kernels of fixed widths (fixed once, from real data)."""

    __slots__ = ("widths",)

    def __init__(self, width: float):
        width = width if width > 0 else 1.0
        self.widths = tuple(width * s for s in SCALES)

    @classmethod
    def for_data(cls, x: np.ndarray) -> GaussianMMD:
        return cls(median_distance(x))

    def _kernel(self, d2: np.ndarray) -> np.ndarray:
        total = np.zeros_like(d2)
        for w in self.widths:
            total += np.exp(-d2 / (2.0 * w * w))
        return total / len(self.widths)

    def __call__(self, x: np.ndarray, y: np.ndarray) -> float:
        x = np.asarray(x, np.float64).reshape(len(x), -1)
        y = np.asarray(y, np.float64).reshape(len(y), -1)
        n, m = len(x), len(y)
        if n < 2 or m < 2:
            return float("nan")
        kxx = self._kernel(_squared_distances(x, x))
        kyy = self._kernel(_squared_distances(y, y))
        kxy = self._kernel(_squared_distances(x, y))
        return float(
            (kxx.sum() - np.trace(kxx)) / (n * (n - 1)) + (kyy.sum() - np.trace(kyy)) / (m * (m - 1)) - 2.0 * kxy.mean()
        )
