"""The framework-free half of a GAN backend: alternation, optimiser halves, noise, metrics.

One batch of real samples is one GAN step:

    d_steps times:  new noise z; discriminator gradient on (real, G(z)); step D
    once:           new noise z; generator gradient through D (non-saturating loss)

The discriminator steps run inside `compute_gradients` (the generator's gradient must
see the discriminator they produced) with the discriminator's half of the worker
optimiser; the generator's gradient is left in `grads` (the discriminator's part zero)
and the worker optimiser's `step`, called by the topology as for any model, moves the
generator. The topology then synchronises the flat [generator | discriminator] buffer:
both models together, after both trained on the batch. So the update rules that work
for a GAN are those whose workers train with their own optimiser and send their weights
(EASGD, ADAG, DynSGD); gradient-pushing rules would never move the discriminator.

Metrics: `loss` is the discriminator's loss and `metric` ("mmd") the MMD^2 between the
real samples and as many generated ones (the validation set against fixed noise:
comparable from epoch to epoch, the number to watch); `train_extras()` adds d_loss,
g_loss, d_real (mean D(x)) and d_fake (mean D(G(z))) to every rank's train records.
"""

from __future__ import annotations

import json
from abc import abstractmethod
from typing import Any

import numpy as np

from nbdist.backends.base import Backend, BatchStats, FlatOptimizer, ModelError
from nbdist.gan.model import GanModel
from nbdist.gan.stats import GaussianMMD
from nbdist.specs import Spec

__all__ = ["GanTraining", "GanOptimizer", "EXTRAS", "VALIDATION_NOISE_SEED"]

EXTRAS = ("d_loss", "g_loss", "d_real", "d_fake")
VALIDATION_NOISE_SEED = 20_181_022  # the same noise at every validation of every rank
MMD_SAMPLES = 1000  # the statistic is quadratic in the number of samples


class GanOptimizer(FlatOptimizer):
    """One optimiser per model, each over its own part of the flat buffer."""

    def __init__(self, spec: Spec, generator: FlatOptimizer, discriminator: FlatOptimizer, g_part: slice):
        self.spec = spec
        self.generator, self.discriminator, self._g_part = generator, discriminator, g_part

    @property
    def learning_rate(self) -> float:
        return self.generator.learning_rate

    def set_learning_rate(self, lr: float) -> None:
        # Warm-up and schedules move both models' rates (the spec gave them one lr).
        self.generator.set_learning_rate(lr)
        self.discriminator.set_learning_rate(lr)

    def step(self, grad: np.ndarray) -> None:
        # The discriminator's steps were taken in compute_gradients.
        self.generator.step(grad[self._g_part])

    def state_arrays(self) -> dict[str, np.ndarray]:
        return {
            **{f"g.{k}": v for k, v in self.generator.state_arrays().items()},
            **{f"d.{k}": v for k, v in self.discriminator.state_arrays().items()},
        }

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        for prefix, opt in (("g.", self.generator), ("d.", self.discriminator)):
            opt.load_state_arrays({k[len(prefix) :]: v for k, v in arrays.items() if k.startswith(prefix)})


class GanTraining(Backend):
    """Mixed in before a framework's Backend, which lays the generator's trainable weights
    out first in `params` (`g_part`) and the discriminator's after them (`d_part`), and
    provides the hooks below. Its super() calls reach that framework's Backend, which
    comes after it in the class's MRO (mypy sees only the abstract Backend: safe-super)."""

    g_part: slice
    d_part: slice

    def _init_gan(self, gan: GanModel, sample: Any) -> None:
        if int(gan.latent_dim) < 1 or int(gan.d_steps) < 1:
            raise ModelError(f"a GAN needs latent_dim >= 1 and d_steps >= 1, got {gan.latent_dim} and {gan.d_steps}")
        self.latent_dim, self.d_steps = int(gan.latent_dim), int(gan.d_steps)
        self.metric_name = "mmd"
        self._noise_rng = np.random.default_rng(0)
        self._d_opt: FlatOptimizer | None = None
        self._sums = np.zeros(1 + len(EXTRAS))  # samples, then the EXTRAS' sums
        # One fixed kernel for the run: every rank gets the same training data, so the same
        # width, and batch and validation values measure the same thing.
        self._mmd = GaussianMMD.for_data(sample[:256]) if sample is not None else GaussianMMD(1.0)

    # -- hooks ----------------------------------------------------------------------
    @abstractmethod
    def _discriminator_gradient(self, real: np.ndarray, z: np.ndarray) -> tuple[float, float, float]:
        """grads[d_part] <- d(discriminator loss)/dD on real and G(z) (grads[g_part] not
        read); returns (loss, mean D(real), mean D(G(z)))."""

    @abstractmethod
    def _generator_gradient(self, z: np.ndarray) -> tuple[float, np.ndarray]:
        """grads[g_part] <- d(generator loss)/dG through D, grads[d_part] <- 0; returns
        (loss, the generated samples)."""

    @abstractmethod
    def _judge(self, real: np.ndarray, z: np.ndarray) -> tuple[float, float, float, np.ndarray]:
        """Inference mode: (discriminator loss, mean D(real), mean D(G(z)), G(z))."""

    @abstractmethod
    def generate(self, z: np.ndarray) -> np.ndarray:
        """Samples of the generator (inference mode) for latent vectors z."""

    # -- Backend ----------------------------------------------------------------------
    def noise(self, n: int, rng: np.random.Generator | None = None) -> np.ndarray:
        return (rng or self._noise_rng).standard_normal((n, self.latent_dim), dtype=np.float32)

    def compute_gradients(self, x: Any, y: Any, *, scale: float = 1.0) -> BatchStats:
        if self._d_opt is None:
            raise RuntimeError("a GAN trains with its worker optimizer: call make_optimizer() first")
        n = len(x)
        for _ in range(self.d_steps):
            d_loss, d_real, d_fake = self._discriminator_gradient(x, self.noise(n))
            self._d_opt.step(self.grads[self.d_part])
        g_loss, fake = self._generator_gradient(self.noise(n))
        self._sums += (n, d_loss * n, g_loss * n, d_real * n, d_fake * n)
        return BatchStats(d_loss * n, self._mmd(x, fake) * n, n)

    def evaluate(self, x: Any, y: Any, *, batch_size: int = 1024) -> BatchStats:
        rng = np.random.default_rng(VALIDATION_NOISE_SEED)
        stats, fakes = BatchStats(), []
        for start in range(0, len(x), batch_size):
            real = x[start : start + batch_size]
            d_loss, _, _, fake = self._judge(real, self.noise(len(real), rng))
            stats.add(BatchStats(d_loss * len(real), 0.0, len(real)))
            fakes.append(fake)
        keep = min(len(x), MMD_SAMPLES)
        stats.metric_sum = self._mmd(x[:keep], np.concatenate(fakes)[:keep]) * stats.n
        return stats

    def train_extras(self) -> dict[str, float]:
        n = self._sums[0]
        if not n:
            return {}
        means = dict(zip(EXTRAS, (self._sums[1:] / n).tolist(), strict=True))
        self._sums[:] = 0.0
        return means

    def make_optimizer(self, spec: Spec, params: np.ndarray | None = None) -> FlatOptimizer:
        if params is not None and params is not self.params:
            raise ModelError("a GAN trains with worker optimizers only (easgd, adag, dynsgd); its master takes none")
        generator = super().make_optimizer(spec, self.params[self.g_part])  # type: ignore[safe-super]
        self._d_opt = super().make_optimizer(spec, self.params[self.d_part])  # type: ignore[safe-super]
        return GanOptimizer(spec, generator, self._d_opt, self.g_part)

    def rng_state(self) -> dict[str, np.ndarray]:
        state = json.dumps(self._noise_rng.bit_generator.state).encode()
        return {**super().rng_state(), "gan_noise": np.frombuffer(state, np.uint8).copy()}  # type: ignore[safe-super]

    def set_rng_state(self, arrays: dict[str, np.ndarray]) -> None:
        super().set_rng_state(arrays)  # type: ignore[safe-super]
        if "gan_noise" in arrays:
            self._noise_rng.bit_generator.state = json.loads(np.asarray(arrays["gan_noise"], np.uint8).tobytes())

    def reseed(self, seed: int) -> None:
        super().reseed(seed)  # type: ignore[safe-super]
        self._noise_rng = np.random.default_rng(seed)
