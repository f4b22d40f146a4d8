"""Goodput: throughput times statistical efficiency, and the time to a target.

More workers give more samples per second, but a step over a larger total batch, or an
update computed from older weights, is worth fewer samples. After McCandlish, Kaplan,
Amodei et al. (2018, nbdist/metrics/noise_scale.py), a synchronous step of W workers of b
samples needs (1 + W b / B) / (1 + b / B) times the samples one worker needs to reach the
same loss, B the gradient noise scale (measured on the user's model by the calibration).
Pollux (Qiao et al., OSDI 2021) calls throughput over that ratio goodput.

Asynchronous rules: an update tau versions stale is taken to be worth what a synchronous
step of (1 + tau) b samples is (the W updates of a cycle at tau = W - 1 move the centre
about one big step's worth, bench/results/2026-11-25-convergence.md), times a staleness penalty
measured by bench/convergence.py: at 8 workers (mean staleness 6.1 to 6.4) the asynchronous
rules needed ASYNC_SAMPLES / SYNC_SAMPLES times the samples the synchronous allreduce
needed. The penalty is assumed to grow linearly with the staleness from 1 at tau = 0. That
is an assumption, measured at one point on one task; the report says so.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nbdist.metrics.noise_scale import samples_ratio
from nbdist.scaling.setups import Point

__all__ = ["ASYNC_SAMPLES", "SYNC_SAMPLES", "MEASURED_STALENESS", "samples_needed_ratio", "Goodput", "goodput"]

# bench/convergence.py at 8 workers (bench/results/2026-11-25-convergence.md, the
# 10-seed table): samples to 98% of the 1-worker best over one worker's, the mean of the
# asynchronous rules' and allreduce's; and the mean staleness their masters recorded.
ASYNC_SAMPLES = (3.91 + 4.79 + 4.99 + 4.62) / 4
SYNC_SAMPLES = 1.74
MEASURED_STALENESS = 6.25


def staleness_penalty(staleness: float) -> float:
    """The asynchronous rules' samples over a synchronous step's of the same workers."""
    per_version = (ASYNC_SAMPLES / SYNC_SAMPLES - 1.0) / MEASURED_STALENESS
    return 1.0 + per_version * max(0.0, staleness)


def samples_needed_ratio(point: Point, noise_scale: float) -> float:
    """The samples `point`'s set-up needs to reach a target over what one worker of the same
    batch needs (1 = as efficient as one worker)."""
    batch = point.batch * max(1, point.setup.sync_every)
    if point.setup.asynchronous:
        # In gradients: a worker's update meets one of every other worker's per cycle in
        # the long run, W - 1, whatever the versions a sub-master counts locally.
        staleness = max(point.staleness_mean or 0.0, point.workers - 1.0)
        return _ratio(noise_scale, 1.0 + staleness, batch) * staleness_penalty(staleness)
    return samples_ratio(noise_scale, point.workers, point.batch)


def _ratio(noise_scale: float, workers: float, batch: int) -> float:
    if noise_scale <= 0 or math.isinf(noise_scale):
        return 1.0 if math.isinf(noise_scale) else workers
    return (1.0 + workers * batch / noise_scale) / (1.0 + batch / noise_scale)


@dataclass(frozen=True, slots=True)
class Goodput:
    """A point's goodput (samples/s worth one worker's samples), the samples ratio it
    pays, and the seconds to a target that one worker reaches after `target_samples`."""

    samples_per_s: float
    ratio: float
    seconds_to_target: float
    low: float  # the same, at the ends of the noise scale's range and the model's error
    high: float


def goodput(
    point: Point,
    noise_scale: float,
    target_samples: float,
    *,
    noise_range: tuple[float, float] | None = None,
    model_error: float = 0.0,
    checkpoint_s: float = 0.0,
    samples_per_checkpoint: float = 0.0,
) -> Goodput:
    """Goodput and time to target of `point`. `noise_range`: the noise scale's low and high
    estimates; `model_error`: the model's relative error on throughput (measured points);
    a checkpoint of `checkpoint_s` every `samples_per_checkpoint` samples."""

    def seconds(scale: float, speed: float) -> float:
        ratio = samples_needed_ratio(point, scale)
        samples = target_samples * ratio
        checkpoints = samples / samples_per_checkpoint * checkpoint_s if samples_per_checkpoint else 0.0
        return samples / speed + checkpoints

    ratio = samples_needed_ratio(point, noise_scale)
    speed = point.samples_per_s
    central = seconds(noise_scale, speed)
    scales = noise_range or (noise_scale, noise_scale)
    spread = [
        seconds(scale, speed * factor)
        for scale in scales
        for factor in (1 - model_error, 1 + model_error)
        if factor > 0
    ]
    return Goodput(speed / ratio, ratio, central, min(spread + [central]), max(spread + [central]))
