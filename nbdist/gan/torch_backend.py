"""PyTorch GAN backend: generator and discriminator in one flat buffer (gan/training.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from nbdist.backends.base import ModelError
from nbdist.backends.torch import TorchBackend
from nbdist.gan.model import GanModel
from nbdist.gan.training import GanTraining

__all__ = ["TorchGanBackend"]


def _ends_with_sigmoid(model: nn.Module) -> bool:
    return isinstance(model, nn.Sequential) and len(model) > 0 and isinstance(model[-1], nn.Sigmoid)


class TorchGanBackend(GanTraining, TorchBackend):
    def __init__(self, gan: GanModel, sample: Any = None):
        for what, part in (("generator", gan.generator), ("discriminator", gan.discriminator)):
            if not isinstance(part, nn.Module):
                raise ModelError(f"the {what} must be a torch.nn.Module, got {type(part).__name__}")
        self.generator, self.discriminator = gan.generator, gan.discriminator
        # The flat layout is reverse registration order: registering the discriminator
        # first puts the generator's weights first, [generator | discriminator].
        super().__init__(
            nn.ModuleDict({"discriminator": gan.discriminator, "generator": gan.generator}), loss=None, metric=None
        )
        n_g = sum(p.numel() for p in gan.generator.parameters() if p.requires_grad)
        if not n_g or n_g == self.num_params:
            raise ModelError("the generator and the discriminator both need trainable parameters")
        self.g_part, self.d_part = slice(0, n_g), slice(n_g, self.num_params)
        self._g_grads, self._d_grads = self._flat_grads[self.g_part], self._flat_grads[self.d_part]
        self._probabilities = _ends_with_sigmoid(gan.discriminator)
        self._init_gan(gan, sample)

    def _bce(self, output: torch.Tensor, label: float) -> torch.Tensor:
        target = torch.full_like(output, label)
        if self._probabilities:
            return F.binary_cross_entropy(output, target)
        return F.binary_cross_entropy_with_logits(output, target)

    def _mean_probability(self, output: torch.Tensor) -> float:
        return float((output if self._probabilities else torch.sigmoid(output)).mean())

    def _discriminator_gradient(self, real: np.ndarray, z: np.ndarray) -> tuple[float, float, float]:
        self._d_grads.zero_()
        with torch.no_grad():
            fake = self.generator(torch.from_numpy(z))
        out_real = self.discriminator(self._tensor(real))
        out_fake = self.discriminator(fake)
        loss = self._bce(out_real, 1.0) + self._bce(out_fake, 0.0)
        loss.backward()  # the fake batch is detached: only the discriminator gets gradients
        return (
            float(loss.detach()),
            self._mean_probability(out_real.detach()),
            self._mean_probability(out_fake.detach()),
        )

    def _generator_gradient(self, z: np.ndarray) -> tuple[float, np.ndarray]:
        self._flat_grads.zero_()
        fake = self.generator(torch.from_numpy(z))
        loss = self._bce(self.discriminator(fake), 1.0)  # non-saturating: maximise log D(G(z))
        loss.backward()
        self._d_grads.zero_()  # what reached the discriminator is not its update
        return float(loss.detach()), fake.detach().numpy()

    def _judge(self, real: np.ndarray, z: np.ndarray) -> tuple[float, float, float, np.ndarray]:
        self.model.eval()
        try:
            with torch.no_grad():
                fake = self.generator(torch.from_numpy(z))
                out_real, out_fake = self.discriminator(self._tensor(real)), self.discriminator(fake)
                loss = self._bce(out_real, 1.0) + self._bce(out_fake, 0.0)
        finally:
            self.model.train()
        return float(loss), self._mean_probability(out_real), self._mean_probability(out_fake), fake.numpy()

    def generate(self, z: np.ndarray) -> np.ndarray:
        self.generator.eval()
        try:
            with torch.no_grad():
                return self.generator(torch.from_numpy(np.asarray(z, np.float32))).numpy()
        finally:
            self.generator.train()
