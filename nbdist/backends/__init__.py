"""Frameworks behind one protocol. Each backend module is imported only when used."""

from __future__ import annotations

from typing import Any

from nbdist.backends.base import Backend, BatchStats, DeviceRequest, FlatOptimizer, ModelError
from nbdist.backends.frameworks import FRAMEWORKS, Framework, configure_frameworks, framework_of, making_models

__all__ = [
    "Backend",
    "BatchStats",
    "DeviceRequest",
    "FlatOptimizer",
    "ModelError",
    "Framework",
    "FRAMEWORKS",
    "backend_for",
    "configure_frameworks",
    "framework_of",
    "making_models",
]


def backend_for(
    model: Any,
    loss: Any = None,
    metric: Any = "accuracy",
    *,
    sample: Any = None,
    precision: str = "fp32",
    device: DeviceRequest | None = None,
) -> Backend:
    """The backend for `model`'s framework, chosen from its type. `sample`: a few input
    rows, for frameworks that build a model's weights on its first call (Keras). (A GAN,
    a generator and a discriminator trained as one, gets its backend from nbdist.gan.)
    `precision`: --precision. `device`: where the model is to live (--device; default:
    where it is, on the host path)."""
    backend = framework_of(model).backend(model, loss, metric, sample, precision)
    if device is not None:
        backend.place(device)
    return backend
