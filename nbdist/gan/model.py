"""What a GAN is to nbdist: a generator and a discriminator trained as one model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["GanModel"]


@dataclass(slots=True)
class GanModel:
    """A generator (latent vector -> sample) and a discriminator (sample -> one logit, or
    one probability when it ends with a sigmoid), of one framework.

    The backend lays both out in ONE flat buffer, generator first, so the topologies and
    the update rules move and synchronise the pair as they would one model: the two are
    synchronised together, after both have trained on a batch.
    """

    generator: Any
    discriminator: Any
    latent_dim: int
    d_steps: int = 1  # discriminator steps per generator step, each on the batch with new noise
