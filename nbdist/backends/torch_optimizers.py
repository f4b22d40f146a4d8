"""PyTorch's optimisers and learning-rate schedules on a flat buffer: which of them an
option can name, the checks of their parameters, and TorchFlatOptimizer, which steps
one torch.optim optimiser over the whole flat parameter buffer (backends/torch.py)."""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from nbdist.backends.base import FlatOptimizer, LrSchedule
from nbdist.backends.frameworks import TORCH, unknown_optimizer
from nbdist.backends.torch_dynamo import defer_dynamo_import, step_without_dynamo
from nbdist.specs import Spec, SpecError, check_kwargs, check_value_kinds

__all__ = ["TorchFlatOptimizer", "TorchLrSchedule", "torch_optimizers", "torch_lr_schedules", "optimizer_class"]

# Every rank builds optimisers; none needs torch._dynamo until something compiles.
defer_dynamo_import()

# Optimisers that need a closure or sparse gradients cannot step a flat dense buffer.
_UNSUITABLE = {"lbfgs", "sparseadam"}


def torch_optimizers() -> dict[str, type[torch.optim.Optimizer]]:
    found = {}
    for value in vars(torch.optim).values():
        if isinstance(value, type) and issubclass(value, torch.optim.Optimizer):
            name = value.__name__.lower()
            if value is not torch.optim.Optimizer and name not in _UNSUITABLE:
                found[name] = value
    return found


def optimizer_class(spec: Spec) -> type[torch.optim.Optimizer]:
    """The torch.optim class `spec` names, once its argument names are checked."""
    known = torch_optimizers()
    if spec.name not in known:
        raise unknown_optimizer(TORCH, spec.name, list(known))
    check_kwargs(f"optimizer {spec.name!r}", known[spec.name].__init__, spec.kwargs, skip=2)
    check_value_kinds(f"optimizer {spec}", known[spec.name].__init__, spec.kwargs)
    return known[spec.name]


# Schedulers an option string cannot build, and why (the error says so rather than "unknown").
_UNNAMEABLE_SCHEDULES = {
    "lrscheduler": "is the base class of the schedules",
    "_lrscheduler": "is the base class of the schedules",
    "lambdalr": "takes a function, which an option string cannot give",
    "multiplicativelr": "takes a function, which an option string cannot give",
    "sequentiallr": "combines other schedulers, which an option string cannot give",
    "chainedscheduler": "combines other schedulers, which an option string cannot give",
    "reducelronplateau": "steps on a validation metric, not once per epoch (use --early-stopping to stop on one)",
}


def unnameable_schedule(name: str) -> str | None:
    """Why the torch scheduler `name` (lower case) cannot be an option's, or None."""
    return _UNNAMEABLE_SCHEDULES.get(name)


def torch_lr_schedules() -> dict[str, type]:
    """torch.optim.lr_scheduler classes by lower-case name, those an option can name."""
    base = torch.optim.lr_scheduler.LRScheduler
    return {
        value.__name__.lower(): value
        for value in vars(torch.optim.lr_scheduler).values()
        if isinstance(value, type) and issubclass(value, base) and value.__name__.lower() not in _UNNAMEABLE_SCHEDULES
    }


class TorchLrSchedule(LrSchedule):
    """A torch scheduler run on a one-number SGD of its own, stepped once per epoch; the
    lr it gives that optimiser is the lr of the epoch. (Only the lr is carried over:
    CyclicLR's and OneCycleLR's momentum cycling stays on the scratch optimiser.)"""

    def __init__(self, cls: type, spec: Spec, base_lr: float):
        self.spec = spec
        # Momentum, so that schedulers that cycle it (CyclicLR, OneCycleLR) can be built.
        self._opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base_lr, momentum=0.9)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self._scheduler = cls(self._opt, **spec.kwargs)
        except (TypeError, ValueError, KeyError, ZeroDivisionError) as exc:
            raise SpecError(f"learning-rate schedule {spec}: {type(exc).__name__}: {exc}") from None
        self._lrs = [float(self._opt.param_groups[0]["lr"])]

    def lr_at(self, epoch: int) -> float:
        while len(self._lrs) <= epoch:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "step() before optimizer.step()": nothing to step here
                self._scheduler.step()
            self._lrs.append(float(self._opt.param_groups[0]["lr"]))
        return self._lrs[epoch]


def _accepts(cls: Callable[..., Any], name: str) -> bool:
    return name in inspect.signature(cls).parameters


def _is_plain_sgd(opt: torch.optim.Optimizer) -> bool:
    """Whether `opt` is SGD without momentum, weight decay or maximize: a step is then
    param.add_(grad, alpha=-lr), which is what torch.optim.SGD computes (its single-tensor
    and fused kernels alike, bit for bit)."""
    if type(opt) is not torch.optim.SGD:
        return False
    group = opt.param_groups[0]
    return group["momentum"] == 0 and group["weight_decay"] == 0 and not group["maximize"]


def _host_copy(tensor: torch.Tensor) -> np.ndarray:
    """`tensor`'s values in a host array of their own, with one copy (a transfer off a
    device is one already)."""
    detached = tensor.detach()
    host = detached.cpu()
    return host.numpy() if host is not detached else host.numpy().copy()


class TorchFlatOptimizer(FlatOptimizer):
    """torch.optim over one flat tensor (or the tensor of a numpy array's memory).

    One tensor means the fused (or foreach) kernels update the whole model in a single
    pass; `fused=True` is the default where the optimiser offers it (Adam's default
    foreach path took several times as long: bench/results/2026-11-22-master_throughput.md).
    """

    def __init__(self, cls: Callable[..., torch.optim.Optimizer], spec: Spec, params: np.ndarray | torch.Tensor):
        self.spec = spec
        self._param = torch.as_tensor(params)
        self._grad_source: Any = None  # the gradient array last stepped on, and its tensor
        self._grad: torch.Tensor | None = None
        kwargs = dict(spec.kwargs)
        self._opt = self._build(cls, kwargs)
        self._plain_sgd = _is_plain_sgd(self._opt)

    def _build(self, cls: Callable[..., torch.optim.Optimizer], kwargs: dict[str, Any]) -> torch.optim.Optimizer:
        if "fused" not in kwargs and "foreach" not in kwargs and _accepts(cls, "fused"):
            try:
                return cls([self._param], **kwargs, fused=True)
            except (TypeError, ValueError, RuntimeError):
                pass  # no fused kernel here, or a bad value: the plain path says which
        try:
            return cls([self._param], **kwargs)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise SpecError(f"optimizer {self.spec}: {exc}") from None

    @property
    def learning_rate(self) -> float:
        return float(self._opt.param_groups[0]["lr"])

    def set_learning_rate(self, lr: float) -> None:
        for group in self._opt.param_groups:
            group["lr"] = lr

    def step(self, grad: np.ndarray | torch.Tensor) -> None:
        tensor = self._grad
        if grad is not self._grad_source or tensor is None:
            # A role steps on the same flat gradient every time: its tensor is made once.
            tensor = torch.as_tensor(grad)
            self._grad_source, self._grad = grad, tensor
        lr = self._opt.param_groups[0]["lr"]
        if self._plain_sgd and type(lr) in (float, int):
            # torch.optim's own SGD step, without its wrappers (hooks, profiler ranges,
            # grad mode, grouping), which cost a small model more than the update itself.
            self._param.add_(tensor, alpha=-lr)
            return
        self._param.grad = tensor
        step_without_dynamo(self._opt)
        self._param.grad = None

    def state_arrays(self) -> dict[str, np.ndarray]:
        state = self._opt.state.get(self._param, {})
        return {key: _host_copy(value) for key, value in state.items() if isinstance(value, torch.Tensor)}

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        if not arrays:
            return
        self._opt.state[self._param] = {
            k: torch.from_numpy(np.array(v)).to(self._param.device) for k, v in arrays.items()
        }
