"""The frameworks nbdist trains with, known without importing them.

A `Framework` recognises its models by type, sets its threads and seeds, and builds the
`Backend` of a model (or of a GAN). It imports its framework only once the user's code
has: a PyTorch run never pays TensorFlow's start-up (seconds per rank), nor a Keras run
PyTorch's. The list is looked up once, at the edge (`framework_of`), and the rest of
nbdist talks to the Backend it returns.
"""

from __future__ import annotations

import contextlib
import os
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, ClassVar

from nbdist.backends.base import Backend, ModelError
from nbdist.backends.import_hooks import on_first_import
from nbdist.specs import SpecError, unknown_name

__all__ = [
    "Framework",
    "FRAMEWORKS",
    "TORCH",
    "KERAS",
    "framework_of",
    "configure_frameworks",
    "making_models",
    "unknown_optimizer",
]


class Framework(ABC):
    name: ClassVar[str]  # as users say it: "PyTorch", "Keras"
    module: ClassVar[str]  # the top-level module whose presence means the user's code uses it
    optimizers_module: ClassVar[str]  # where its optimisers live, for messages
    # Its optimisers' names as of the pinned version, for messages about another
    # framework's model only (importing a framework to word an error costs seconds); the
    # backends read the live list (tests/test_backend_keras.py checks the two agree).
    optimizer_hints: ClassVar[frozenset[str]]

    def imported(self) -> bool:
        return self.module in sys.modules

    @abstractmethod
    def owns(self, model: Any) -> bool:
        """Whether `model` is one of this framework's models (False when not imported)."""

    def prepare_environment(self, threads: int) -> None:  # noqa: B027
        """Before the user's code runs: what the framework reads when it starts. By
        default nothing: only a framework that reads its settings at import needs it."""

    @abstractmethod
    def configure(self, threads: int, seed: int) -> None:
        """Threads per rank and the seed of every generator the weights are drawn from."""

    def making_models(self, precision: str) -> contextlib.AbstractContextManager[None]:
        """While models are made: what they compute in, where the framework fixes that
        when a model is made (--precision)."""
        return contextlib.nullcontext()

    @abstractmethod
    def backend(self, model: Any, loss: Any, metric: Any, sample: Any, precision: str = "fp32") -> Backend: ...

    @abstractmethod
    def optimizer_names(self) -> list[str]: ...


class TorchFramework(Framework):
    name, module, optimizers_module = "PyTorch", "torch", "torch.optim"
    optimizer_hints = frozenset(
        {
            "adadelta",
            "adafactor",
            "adagrad",
            "adam",
            "adamax",
            "adamw",
            "asgd",
            "muon",
            "nadam",
            "radam",
            "rmsprop",
            "rprop",
            "sgd",
        }
    )

    def owns(self, model: Any) -> bool:
        torch = sys.modules.get("torch")
        return torch is not None and isinstance(model, torch.nn.Module)

    def configure(self, threads: int, seed: int) -> None:
        import torch

        torch.set_num_threads(threads)
        torch.manual_seed(seed)

    def backend(self, model: Any, loss: Any, metric: Any, sample: Any, precision: str = "fp32") -> Backend:
        from nbdist.backends.torch import TorchBackend

        return TorchBackend(model, loss, metric, precision)

    def optimizer_names(self) -> list[str]:
        from nbdist.backends.torch import torch_optimizers

        return list(torch_optimizers())


class KerasFramework(Framework):
    """Keras 3 on TensorFlow (tf.keras is the same package from TensorFlow 2.16 on)."""

    name, module, optimizers_module = "Keras", "keras", "keras.optimizers"
    optimizer_hints = frozenset(
        {
            "adadelta",
            "adafactor",
            "adagrad",
            "adam",
            "adamax",
            "adamw",
            "ftrl",
            "lamb",
            "lion",
            "muon",
            "nadam",
            "rmsprop",
            "schedulefreeadamw",
            "sgd",
        }
    )

    def owns(self, model: Any) -> bool:
        keras = sys.modules.get("keras")
        return keras is not None and isinstance(model, keras.layers.Layer)

    def prepare_environment(self, threads: int) -> None:
        if "tensorflow" in sys.modules:
            return
        # TensorFlow sizes its thread pools once, when it starts, from these variables;
        # a model built at the top of a cell starts it before configure() could run.
        os.environ["TF_NUM_INTRAOP_THREADS"] = str(threads)
        os.environ["TF_NUM_INTEROP_THREADS"] = "1"
        # TensorFlow's info and warning lines, one set per rank, say nothing; =0 brings them
        # back. (2.21 still writes two lines per rank before its logging starts, absl's
        # "before absl::InitializeLog()" and oneDNN's note, which no variable silences.)
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

    def configure(self, threads: int, seed: int) -> None:
        import keras
        import tensorflow as tf

        try:
            tf.config.threading.set_intra_op_parallelism_threads(threads)
            tf.config.threading.set_inter_op_parallelism_threads(1)
        except RuntimeError:
            pass  # TensorFlow has started: prepare_environment() sized its pools
        # Python's and numpy's generators too: Keras draws initialiser seeds from them.
        keras.utils.set_random_seed(seed)

    @contextlib.contextmanager
    def making_models(self, precision: str) -> Iterator[None]:
        # A layer takes the global dtype policy when it is made: set for build_model(), then
        # put back, so that the user's own models (or a PyTorch run's) are left as they were.
        import keras

        from nbdist.backends.keras import DTYPE_POLICIES

        previous = keras.mixed_precision.global_policy()
        keras.mixed_precision.set_global_policy(DTYPE_POLICIES[precision])
        try:
            yield
        finally:
            keras.mixed_precision.set_global_policy(previous)

    def backend(self, model: Any, loss: Any, metric: Any, sample: Any, precision: str = "fp32") -> Backend:
        from nbdist.backends.keras import KerasBackend

        return KerasBackend(model, loss, metric, sample=sample, precision=precision)

    def optimizer_names(self) -> list[str]:
        from nbdist.backends.keras_optimizers import keras_optimizers

        return list(keras_optimizers())


TORCH, KERAS = TorchFramework(), KerasFramework()
FRAMEWORKS: tuple[Framework, ...] = (TORCH, KERAS)


def framework_of(model: Any) -> Framework:
    for framework in FRAMEWORKS:
        if framework.owns(model):
            return framework
    kind = f"{type(model).__module__}.{type(model).__qualname__}"
    if type(model).__module__.split(".")[0] == "tf_keras":
        raise ModelError(
            f"the model is a Keras 2 model ({kind}); nbdist trains Keras 3 models: import keras (Keras 3), not tf_keras"
        )
    raise ModelError(f"the model is a {kind}; nbdist trains torch.nn.Module and keras.Model models")


def _configure_on_import(framework: Framework, threads: int, seed: int) -> Callable[[ModuleType], None]:
    return lambda _module: framework.configure(threads, seed)


def configure_frameworks(threads: int, seed: int) -> None:
    """Threads and seed for every framework the user's code has imported so far; for those
    it imports later, their environment now and threads and seed the moment it imports them
    (backends/import_hooks.py). Called before and after the user's code runs."""
    for framework in FRAMEWORKS:
        framework.prepare_environment(threads)
        if framework.imported():
            framework.configure(threads, seed)
        else:  # a model built right after the user's code imports it is drawn then
            on_first_import(framework.module, _configure_on_import(framework, threads, seed))


@contextlib.contextmanager
def making_models(precision: str) -> Iterator[None]:
    """Around the user's build_model(): --precision for every framework imported by then."""
    with contextlib.ExitStack() as stack:
        for framework in FRAMEWORKS:
            if framework.imported():
                stack.enter_context(framework.making_models(precision))
        yield


def unknown_optimizer(framework: Framework, name: str, known: list[str]) -> SpecError:
    """The error for an optimiser `framework` does not have, saying so when another
    framework does (a torch name given for a Keras model, or the reverse)."""
    for other in FRAMEWORKS:
        if other is not framework and name in other.optimizer_hints:
            return SpecError(
                f"{name!r} is a {other.name} optimizer ({other.optimizers_module}), but the model is "
                f"a {framework.name} model: choose one of {framework.optimizers_module}: "
                f"{', '.join(sorted(known))}"
            )
    return unknown_name(f"{framework.name} optimizer", name, known)
