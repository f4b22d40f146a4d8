"""Frameworks behind one protocol. Each backend module is imported only when used."""

from __future__ import annotations

from typing import Any

from nbdist.backends.base import Backend, BatchStats, FlatOptimizer, ModelError

__all__ = ["Backend", "BatchStats", "FlatOptimizer", "ModelError", "backend_for"]


def backend_for(model: Any, loss: Any = None, metric: Any = "accuracy") -> Backend:
    """The backend for `model`'s framework, chosen from its type."""
    module = type(model).__module__.split(".")[0]
    if module == "torch" or _is_torch_module(model):
        from nbdist.backends.torch import TorchBackend

        return TorchBackend(model, loss, metric)
    raise ModelError(
        f"the model is a {type(model).__module__}.{type(model).__name__}; nbdist trains "
        f"torch.nn.Module models"
    )


def _is_torch_module(model: Any) -> bool:
    try:
        import torch
    except ImportError:
        return False
    return isinstance(model, torch.nn.Module)
