"""Frameworks behind one protocol. Each backend module is imported only when used."""

from __future__ import annotations

from typing import Any

from nbdist.backends.base import Backend, BatchStats, FlatOptimizer, ModelError
from nbdist.backends.frameworks import FRAMEWORKS, Framework, configure_frameworks, framework_of, making_models

__all__ = ["Backend", "BatchStats", "FlatOptimizer", "ModelError", "Framework", "FRAMEWORKS",
           "backend_for", "configure_frameworks", "framework_of", "making_models"]


def backend_for(model: Any, loss: Any = None, metric: Any = "accuracy", *, sample: Any = None,
                precision: str = "fp32") -> Backend:
    """The backend for `model`'s framework, chosen from its type. `sample`: a few input
    rows, for frameworks that build a model's weights on its first call (Keras). (A GAN,
    a generator and a discriminator trained as one, gets its backend from nbdist.gan.)"""
    return framework_of(model).backend(model, loss, metric, sample, precision)
