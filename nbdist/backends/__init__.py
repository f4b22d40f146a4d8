"""Frameworks behind one protocol. Each backend module is imported only when used."""

from __future__ import annotations

from typing import Any

from nbdist.backends.base import Backend, BatchStats, FlatOptimizer, ModelError
from nbdist.backends.frameworks import FRAMEWORKS, Framework, configure_frameworks, framework_of

__all__ = ["Backend", "BatchStats", "FlatOptimizer", "ModelError", "Framework", "FRAMEWORKS",
           "backend_for", "configure_frameworks", "framework_of"]


def backend_for(model: Any, loss: Any = None, metric: Any = "accuracy", *, sample: Any = None) -> Backend:
    """The backend for `model`'s framework, chosen from its type. `model` may also be a
    GanModel (a generator and a discriminator of one framework). `sample`: a few input
    rows, for frameworks that build a model's weights on its first call (Keras)."""
    from nbdist.gan.model import GanModel

    if isinstance(model, GanModel):
        framework = framework_of(model.generator)
        other = framework_of(model.discriminator)
        if other is not framework:
            raise ModelError(f"the generator is a {framework.name} model and the discriminator a "
                             f"{other.name} model: both must come from one framework")
        return framework.gan_backend(model, sample)
    return framework_of(model).backend(model, loss, metric, sample)
