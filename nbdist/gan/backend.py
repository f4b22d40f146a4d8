"""The backend of a GAN: the framework's GAN backend, chosen from the generator's type
(each is imported only when used, like the plain backends)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nbdist.backends import Backend, ModelError, framework_of
from nbdist.gan.model import GanModel

__all__ = ["gan_backend"]


def _torch(gan: GanModel, sample: Any) -> Backend:
    from nbdist.gan.torch_backend import TorchGanBackend

    return TorchGanBackend(gan)


def _keras(gan: GanModel, sample: Any) -> Backend:
    from nbdist.gan.keras_backend import KerasGanBackend

    return KerasGanBackend(gan, sample=sample)


# Framework.module -> the GAN backend of that framework.
_BACKENDS: dict[str, Callable[[GanModel, Any], Backend]] = {"torch": _torch, "keras": _keras}


def gan_backend(gan: GanModel, sample: Any = None) -> Backend:
    """`sample`: a few real samples, for frameworks that build weights on a first call (Keras)."""
    framework = framework_of(gan.generator)
    other = framework_of(gan.discriminator)
    if other is not framework:
        raise ModelError(
            f"the generator is a {framework.name} model and the discriminator a "
            f"{other.name} model: both must come from one framework"
        )
    return _BACKENDS[framework.module](gan, sample)
