"""A Keras model's variables as nbdist's flat buffers, and the compiled functions that
run the model on them (statelessly: the flat arrays are the weights; see keras.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from nbdist.backends.base import (
    ModelError,
)

__all__ = ["ALIGNMENT", "FlatVariables", "Traced", "aligned_zeros", "build_models"]

# TensorFlow's kernels assume buffers aligned as Eigen aligns its own (and abort
# otherwise): numpy memory is passed without a copy only when it is.
ALIGNMENT = 64


def aligned_zeros(n: int, dtype: Any = np.float32) -> np.ndarray:
    """A zeroed 1-D array whose data starts on an ALIGNMENT boundary."""
    itemsize = np.dtype(dtype).itemsize
    raw = np.zeros(n * itemsize + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start : start + n * itemsize].view(dtype)


def _tensor(value: Any) -> tf.Tensor:
    """An argument of a compiled function as a tensor. An aligned numpy array becomes a
    tensor on the same memory (DLPack), without the copy that passing it to a tf.function
    makes (for a large model, longer than its step); the compiled functions only read
    their inputs. Anything else is converted here rather than by the tf.function, whose
    own conversion of numpy arguments cost more than the small MLP's whole step
    (bench/results/2026-11-25-keras_overhead.md)."""
    if isinstance(value, tf.Tensor):
        return value
    if isinstance(value, np.ndarray) and value.size and value.flags.c_contiguous and value.ctypes.data % ALIGNMENT == 0:
        try:
            return tf.experimental.dlpack.from_dlpack(value.__dlpack__())
        except (BufferError, TypeError, ValueError, tf.errors.OpError):
            pass  # read-only, or a dtype DLPack does not carry: TensorFlow copies it
    return tf.convert_to_tensor(value)


class Traced:
    """A tf.function traced once, on its first call, with the first dimension of the
    arguments in `batch` left open. Each new input shape would cost a trace (a fraction of
    a second): the probe, a full batch, an epoch's last batch and the validation set differ.

    Calls go to the traced ConcreteFunction with tensors: the tf.function's dispatch
    (matching the arguments against its signature, converting numpy ones) took longer per
    call than a digits MLP's forward and backward pass, the concrete function's a fraction
    of it (bench/results/2026-11-25-keras_overhead.md)."""

    __slots__ = ("_fn", "_batch", "_concrete", "_dtypes")

    def __init__(self, fn: Callable, batch: tuple[int, ...] = ()):
        self._fn, self._batch = fn, batch
        self._concrete: Any = None  # the traced function, once called
        self._dtypes: tuple[Any, ...] = ()

    def __call__(self, *args: Any) -> Any:
        if self._concrete is None:
            specs = [self._spec(a, i in self._batch) for i, a in enumerate(args)]
            # No autograph: the Python branches in these functions are decided at trace time.
            function = tf.function(self._fn, input_signature=specs, autograph=False)
            self._concrete = function.get_concrete_function()
            self._dtypes = tuple(None if isinstance(s, list) else s.dtype for s in specs)
        tensors = [
            [_tensor(v) for v in a] if isinstance(a, list) else self._typed(_tensor(a), dtype)
            for a, dtype in zip(args, self._dtypes, strict=True)
        ]
        return self._concrete(*tensors)

    @staticmethod
    def _typed(tensor: tf.Tensor, dtype: Any) -> tf.Tensor:
        # The traced function takes the dtypes of its first call (a float64 array from
        # numpy arithmetic, int32 labels where they were int64): cast rather than fail.
        return tensor if tensor.dtype == dtype else tf.cast(tensor, dtype)

    @classmethod
    def _spec(cls, value: Any, batch: bool) -> Any:
        if isinstance(value, (list, tuple)):
            return [cls._spec(v, False) for v in value]
        if isinstance(value, tf.Tensor):
            shape = [None, *value.shape[1:]] if batch else list(value.shape)
            return tf.TensorSpec(shape, value.dtype)
        array = np.asarray(value)
        shape = [None, *array.shape[1:]] if batch else list(array.shape)
        return tf.TensorSpec(shape, tf.as_dtype(array.dtype))


def _aligned_flat(variables: list) -> np.ndarray:
    flat = aligned_zeros(sum(int(np.prod(v.shape)) for v in variables))
    offset = 0
    for v in variables:
        value = np.asarray(v.numpy(), np.float32).reshape(-1)
        flat[offset : offset + value.size] = value
        offset += value.size
    return flat


def _is_float(dtype: Any) -> bool:
    return str(dtype).startswith(("float", "bfloat"))


class FlatVariables:
    """The variables of one or more Keras models in flat buffers, and the graph-side code
    that cuts the buffers back into each model's variable values.

    Trainable weights -> `params` (float32, model by model, in each model's
    trainable_variables order); float non-trainable variables (BatchNorm statistics) ->
    `state`; the others (seed generator states, counters) stay separate arrays, `others`.
    """

    def __init__(self, models: list[keras.Model]):
        self.trainable = [list(m.trainable_variables) for m in models]
        self.non_trainable = [list(m.non_trainable_variables) for m in models]
        flat_trainable = [v for vs in self.trainable for v in vs]
        self.model_sizes = [sum(int(np.prod(v.shape)) for v in vs) for vs in self.trainable]
        self.params = _aligned_flat(flat_trainable)
        self.state = _aligned_flat([v for vs in self.non_trainable for v in vs if _is_float(v.dtype)])
        self.others = [np.array(v.numpy()) for vs in self.non_trainable for v in vs if not _is_float(v.dtype)]

    def param_blocks(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """Each trainable variable's (start, stop) in `params` and its shape."""
        blocks, start = [], 0
        for v in (v for vs in self.trainable for v in vs):
            size = int(np.prod(v.shape))
            blocks.append((start, start + size, tuple(int(d) for d in v.shape)))
            start += size
        return blocks

    def paths(self, prefixes: list[str]) -> list[tuple[str, str, Any]]:
        """(name, where, variable) for every variable in buffer order, `where` being
        "params", "state" or "others"; names are variable paths after each model's prefix."""
        groups = {
            "params": self.trainable,
            "state": [[v for v in vs if _is_float(v.dtype)] for vs in self.non_trainable],
            "others": [[v for v in vs if not _is_float(v.dtype)] for vs in self.non_trainable],
        }
        return [
            (prefix + v.path, where, v)
            for where, group in groups.items()
            for prefix, variables in zip(prefixes, group, strict=True)
            for v in variables
        ]

    # -- graph side -----------------------------------------------------------------
    @staticmethod
    def _cut(flat: tf.Tensor, variables: list) -> list[tf.Tensor]:
        sizes = [int(np.prod(v.shape)) for v in variables]
        pieces = tf.split(flat, sizes) if variables else []
        return [tf.cast(tf.reshape(p, v.shape), v.dtype) for p, v in zip(pieces, variables, strict=True)]

    def unpack(self, params: tf.Tensor | list, state: tf.Tensor, others: list) -> tuple[list, list]:
        """Per model: its trainable values and its non-trainable values, in its own order.
        `params`: the flat buffer, or its parts model by model."""
        parts = params if isinstance(params, (list, tuple)) else tf.split(params, self.model_sizes)
        trainable = [self._cut(part, vs) for part, vs in zip(parts, self.trainable, strict=True)]
        floats = self._cut(state, [v for vs in self.non_trainable for v in vs if _is_float(v.dtype)])
        floats_it, others_it = iter(floats), iter(others)
        non_trainable = [
            [next(floats_it) if _is_float(v.dtype) else next(others_it) for v in vs] for vs in self.non_trainable
        ]
        return trainable, non_trainable

    def pack(self, non_trainable: list[list[tf.Tensor]]) -> tuple[tf.Tensor, list[tf.Tensor]]:
        """The inverse of unpack for the non-trainable values a stateless call returned."""
        floats, others = [], []
        for variables, values in zip(self.non_trainable, non_trainable, strict=True):
            for v, value in zip(variables, values, strict=True):
                if _is_float(v.dtype):
                    floats.append(tf.reshape(tf.cast(value, tf.float32), [-1]))
                else:
                    others.append(value)
        state = tf.concat(floats, 0) if floats else tf.zeros([0], tf.float32)
        return state, others

    def store(self, state: np.ndarray, new_state: tf.Tensor, new_others: list) -> None:
        if state.size:
            np.copyto(state, new_state.numpy())
        for array, value in zip(self.others, new_others, strict=True):
            np.copyto(array, value.numpy())

    def reseed(self, seed: int) -> None:
        # A keras SeedGenerator's state is [seed, counter]: a new seed per generator.
        i = 0
        for v in (v for vs in self.non_trainable for v in vs if not _is_float(v.dtype)):
            if v.path.endswith("seed_generator_state"):
                self.others[i][...] = (seed * 7919 + i) % 2**31, 0
            i += 1


def build_models(models: list[Any], samples: list[Any]) -> None:
    """Create the weights of models that have none yet by calling them on a sample."""
    for model, sample in zip(models, samples, strict=True):
        if model.built and model.weights:
            continue
        if sample is None:
            raise ModelError(
                "the Keras model has no weights yet: give it an input "
                "(keras.Input(shape=...)) or build it (model.build((None, ...)))"
            )
        try:
            model(sample[:2])
        except Exception as exc:
            raise ModelError(
                f"the Keras model could not be built on inputs of shape "
                f"{tuple(np.shape(sample)[1:])}: {type(exc).__name__}: {exc}"
            ) from None
