"""Device staging: a flat array where the model lives, seen by MPI as a host buffer.

Three ways, chosen once per buffer:
- view: the array is in host memory (numpy, or a CPU torch tensor): MPI reads and writes
  a numpy view of the same memory; nothing is copied.
- direct: the array is on a GPU and Open MPI is CUDA-aware: MPI is handed the device
  array itself.
- pinned: the array is on a GPU and MPI is not CUDA-aware: each transfer copies through a
  pinned host buffer on a CUDA stream (the backend's copier), and MPI sees the host copy.

`to_host(start, stop)` before MPI reads a range, `to_device(start, stop)` after MPI wrote
it; both do nothing in view and direct ways. The copies themselves belong to the backend
(`Backend.copier`), so this module imports no framework.
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from typing import Any

import array_api_compat
import numpy as np
from mpi4py import MPI

__all__ = ["Staging", "mpi_is_cuda_aware"]

VIEW, DIRECT, PINNED = "view", "direct", "pinned"


@lru_cache(maxsize=1)
def mpi_is_cuda_aware() -> bool:
    """Whether the MPI library takes device memory: mpi4py's query where it has one,
    else Open MPI's MPIX_Query_cuda_support (mpi-ext.h) from the loaded libmpi."""
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        return bool(query())
    try:
        libmpi = ctypes.CDLL("libmpi.so.40", mode=os.RTLD_NOLOAD)  # Open MPI's, already loaded
        function = libmpi.MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return False  # another MPI, or none that says: stage through the host
    function.restype = ctypes.c_int
    return bool(function())


def _on_host(array: Any) -> bool:
    return isinstance(array, np.ndarray) or str(array_api_compat.device(array)) == "cpu"


class Staging:
    """One flat `device` array and the `host` buffer MPI is given for it."""

    __slots__ = ("device", "host", "way", "_copier", "_host_tensor")

    def __init__(self, device: Any, copier: Any = None, cuda_aware: bool | None = None):
        self.device = device
        self._copier = copier
        self._host_tensor: Any = None  # the pinned host copy's tensor (PINNED only)
        if _on_host(device):
            self.way, self.host = VIEW, np.asarray(device)  # zero-copy view of a CPU tensor
        elif mpi_is_cuda_aware() if cuda_aware is None else cuda_aware:
            self.way, self.host = DIRECT, device
        else:
            if copier is None:
                raise ValueError("a device array without a copier cannot be staged through the host")
            self.way = PINNED
            self._host_tensor, self.host = copier.pinned(int(device.shape[0]))

    @classmethod
    def of_host(cls, host: np.ndarray, like: Any, copier: Any = None) -> Staging:
        """A staging whose host side is `host` (a message buffer's payload) and whose device
        side is an array beside `like`: the same memory where `like` is on the host."""
        staging = cls.__new__(cls)
        staging.host, staging._copier = host, copier
        xp = array_api_compat.array_namespace(like)
        if _on_host(like):
            staging.way, staging.device, staging._host_tensor = VIEW, xp.asarray(host), None
        else:
            if copier is None:
                raise ValueError("a device array without a copier cannot be staged through the host")
            staging.way = PINNED
            staging.device = xp.zeros(host.shape[0], dtype=xp.float32, device=array_api_compat.device(like))
            staging._host_tensor = copier.host_tensor(host)
        return staging

    def to_host(self, start: int = 0, stop: int | None = None) -> Any:
        """The host buffer's [start:stop], holding the device array's values."""
        if self.way == PINNED:
            self._copier.copy(self._host_tensor[start:stop], self.device[start:stop])
        elif self.way == DIRECT and self._copier is not None:
            self._copier.settle()  # MPI reads the device memory: the kernels writing it must be done
        return self.host[start:stop]

    def to_device(self, start: int = 0, stop: int | None = None) -> None:
        """The device array's [start:stop] takes what MPI wrote into the host buffer."""
        if self.way == PINNED:
            self._copier.copy(self.device[start:stop], self._host_tensor[start:stop])
