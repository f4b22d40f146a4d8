"""The arrays an update rule works on, through the array API (array-api-compat).

A rule is written once against the namespace of the arrays it is given: numpy on a CPU
master, torch tensors where a worker's model lives (a GPU, or the CPU when --device cpu
runs the device path there). Only in-place operators, `[...] =` and namespace functions
are used, so the same code needs neither numpy's `out=` nor a framework import.
Scalars are Python floats holding float32 values (see `f32`): numpy (NEP 50) and torch
then both compute in float32, as the numpy rules always did.
"""

from __future__ import annotations

from typing import Any

import array_api_compat
import numpy as np

__all__ = ["Array", "f32", "zeros_like_buffer", "to_numpy", "host_copy", "copy_into", "namespace", "is_array"]

Array = Any  # a numpy array or a torch tensor: anything array_api_compat knows
namespace = array_api_compat.array_namespace
is_array = array_api_compat.is_array_api_obj


def f32(value: float) -> float:
    """`value` rounded to float32, as a Python float both numpy and torch take as it is."""
    return float(np.float32(value))


def zeros_like_buffer(n: int, like: Array | None = None) -> Array:
    """n float32 zeros in the namespace and on the device of `like` (numpy without one)."""
    if like is None:
        return np.zeros(n, np.float32)
    xp = namespace(like)
    return xp.zeros(n, dtype=xp.float32, device=array_api_compat.device(like))


def to_numpy(array: Array) -> np.ndarray:
    """A host numpy copy-or-view of `array` (checkpoints are numpy)."""
    if isinstance(array, np.ndarray) or not is_array(array):
        return np.asarray(array)
    return np.asarray(array_api_compat.to_device(array, "cpu"))


def host_copy(array: Array) -> np.ndarray:
    """A host numpy array of its own holding `array`'s values, made with one copy: a
    device's transfer to the host is that copy already; an array in host memory is copied."""
    if isinstance(array, np.ndarray) or not is_array(array):
        return np.array(array, copy=True)
    host = array_api_compat.to_device(array, "cpu")
    if host is not array:  # moved off a device: a fresh array nothing else holds
        return np.asarray(host)
    return np.asarray(host).copy()


def copy_into(target: Array, value: Any) -> None:
    """target[...] = value, `value` (numpy, say, from a checkpoint) moved to target's
    namespace and device first."""
    xp = namespace(target)
    target[...] = xp.asarray(np.asarray(value, dtype=np.float32), device=array_api_compat.device(target))
