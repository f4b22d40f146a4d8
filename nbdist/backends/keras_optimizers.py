"""Keras optimisers and learning-rate schedules stepping nbdist's flat buffers: what
`--worker-optimizer`/`--master-optimizer` and `--lr-schedule` name for a Keras model."""

from __future__ import annotations

import inspect

import keras
import numpy as np
import tensorflow as tf

from nbdist.backends.base import (
    FlatOptimizer,
    LrSchedule,
)
from nbdist.backends.frameworks import KERAS, unknown_optimizer
from nbdist.backends.keras_flat import Traced
from nbdist.specs import Spec, SpecError, ValueRange

__all__ = ["KerasFlatOptimizer", "KerasLrSchedule", "keras_lr_schedules", "keras_optimizers"]

# Wrappers around another optimiser, not optimisers of their own.
_UNSUITABLE = {"optimizer", "lossscaleoptimizer", "multioptimizer"}


def keras_optimizers() -> dict[str, type]:
    found = {}
    for value in vars(keras.optimizers).values():
        if isinstance(value, type) and issubclass(value, keras.optimizers.Optimizer):
            name = value.__name__.lower()
            if name not in _UNSUITABLE:
                found[name] = value
    return found


# Keras checks few of its optimisers' values (SGD's momentum, the types): these are the
# ranges PyTorch enforces for the same arguments, so that sgd(lr=-1) or adam(beta_1=1.5)
# is an error with either framework instead of a run that diverges.
_UNIT = ValueRange(0.0, 1.0, high_open=True)
_AT_LEAST_ZERO = ValueRange(0.0)
_VALUE_RANGES = {
    "learning_rate": _AT_LEAST_ZERO,
    "beta_1": _UNIT,
    "beta_2": _UNIT,
    "rho": ValueRange(0.0, 1.0),
    "epsilon": _AT_LEAST_ZERO,
    "weight_decay": _AT_LEAST_ZERO,
    "initial_accumulator_value": _AT_LEAST_ZERO,
}


def _make_keras_optimizer(spec: Spec) -> keras.optimizers.Optimizer:
    known = keras_optimizers()
    if spec.name not in known:
        raise unknown_optimizer(KERAS, spec.name, list(known))
    # nbdist's specs say lr (PyTorch's name, and the default worker optimiser's); Keras
    # calls it learning_rate, and takes only a float there (lr=1 is one too).
    kwargs = {}
    for given, value in spec.kwargs.items():
        name = "learning_rate" if given == "lr" else given
        if name in _VALUE_RANGES:
            _VALUE_RANGES[name].check(f"optimizer {spec}", given, value)
            value = float(value)
        kwargs[name] = value
    try:
        return known[spec.name](**kwargs)
    except (TypeError, ValueError) as exc:
        raise SpecError(f"optimizer {spec}: {exc}") from None


class KerasFlatOptimizer(FlatOptimizer):
    """A keras.optimizers optimiser over one flat variable that mirrors a numpy array.

    Keras optimisers update variables, so a step copies the array into the variable,
    applies the gradient and copies the result back, in one compiled call: two copies of
    the weights' size (the inputs come in without one, see `_tensor`), where stepping the
    model's own variables would cost ops per tensor.
    """

    def __init__(self, spec: Spec, params: np.ndarray):
        self.spec = spec
        self._params = params
        self._opt = _make_keras_optimizer(spec)
        self._var = keras.Variable(params, dtype="float32", name="nbdist_flat")
        self._opt.build([self._var])
        self._step = Traced(self._apply)

    def _apply(self, params: tf.Tensor, grad: tf.Tensor) -> tf.Tensor:
        self._var.assign(params)
        self._opt.apply([grad], [self._var])
        return self._var.value.read_value()

    @property
    def learning_rate(self) -> float:
        return float(np.asarray(self._opt.learning_rate))

    def set_learning_rate(self, lr: float) -> None:
        # A variable the compiled step reads: assigning it needs no retrace.
        self._opt.learning_rate.assign(float(lr))

    def step(self, grad: np.ndarray) -> None:
        np.copyto(self._params, self._step(self._params, grad).numpy())

    def state_arrays(self) -> dict[str, np.ndarray]:
        return {f"{i:02d}.{v.name}": np.array(v.numpy()) for i, v in enumerate(self._opt.variables)}

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        for i, v in enumerate(self._opt.variables):
            key = f"{i:02d}.{v.name}"
            if key in arrays:
                v.assign(np.asarray(arrays[key]).reshape(v.shape))


def keras_lr_schedules() -> dict[str, type]:
    """keras.optimizers.schedules classes by lower-case name."""
    base = keras.optimizers.schedules.LearningRateSchedule
    return {
        value.__name__.lower(): value
        for value in vars(keras.optimizers.schedules).values()
        if isinstance(value, type) and issubclass(value, base) and value is not base
    }


class KerasLrSchedule(LrSchedule):
    """A Keras schedule called with the epoch (its steps are epochs here: decay_steps=10
    decays over 10 epochs); initial_learning_rate defaults to the optimiser's lr."""

    def __init__(self, cls: type, spec: Spec, base_lr: float):
        self.spec = spec
        kwargs = dict(spec.kwargs)
        if "initial_learning_rate" in inspect.signature(cls).parameters:
            kwargs.setdefault("initial_learning_rate", float(base_lr))
        try:
            self._schedule = cls(**kwargs)
        except (TypeError, ValueError) as exc:
            raise SpecError(f"learning-rate schedule {spec}: {type(exc).__name__}: {exc}") from None

    def lr_at(self, epoch: int) -> float:
        return float(np.asarray(self._schedule(epoch)))
