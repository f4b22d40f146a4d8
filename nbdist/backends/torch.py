"""PyTorch backend: a plain nn.Module whose parameters live in one flat float32 buffer.

Every parameter's `.data` and `.grad` become views into two contiguous tensors, laid
out in reverse registration order (roughly the order autograd finishes them), so:
- on the host path `params`/`grads`/`state` are numpy views of those tensors: an MPI send
  of them is zero-copy;
- `place` (--device cpu or cuda, or auto on a GPU node) moves the model and rebuilds the
  buffers on its device; `params`/`grads`/`state` are then the tensors themselves, which
  the rules use as they are and MPI reads only through the transport's staging
  (torch_device.py);
- a bucket of gradients that backward has finished is one contiguous slice, which the
  allreduce topology can reduce while backward goes on with earlier layers.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from nbdist.backends.base import (
    SCRATCH_SIZE,
    Backend,
    BatchStats,
    DeviceRequest,
    DynamicLossScale,
    FlatOptimizer,
    LrSchedule,
    ModelError,
    step_on_scratch,
)
from nbdist.backends.frameworks import TORCH, unknown_optimizer
from nbdist.specs import Spec, SpecError, check_kwargs, check_value_kinds, unknown_name

__all__ = ["TorchBackend", "TorchFlatOptimizer", "TorchLrSchedule", "torch_optimizers", "torch_lr_schedules"]

# --precision: the dtype autocast runs the forward pass in (None: no autocast). The
# parameters and the flat gradient stay float32 either way (autocast casts copies).
_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
_NO_AUTOCAST = contextlib.nullcontext()  # fp32's: reusable, and re-entrant

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


def _optimizer_class(spec: Spec) -> type[torch.optim.Optimizer]:
    """The torch.optim class `spec` names, once its argument names are checked."""
    known = torch_optimizers()
    if spec.name not in known:
        raise unknown_optimizer(TORCH, spec.name, list(known))
    check_kwargs(f"optimizer {spec.name!r}", known[spec.name].__init__, spec.kwargs, skip=2)
    check_value_kinds(f"optimizer {spec}", known[spec.name].__init__, spec.kwargs)
    return known[spec.name]


# Schedulers an option string cannot build: they take functions (LambdaLR,
# MultiplicativeLR) or other schedulers (SequentialLR, ChainedScheduler), or step on a
# validation metric rather than by epoch (ReduceLROnPlateau).
_UNNAMEABLE_SCHEDULES = {
    "lrscheduler",
    "_lrscheduler",
    "lambdalr",
    "multiplicativelr",
    "sequentiallr",
    "chainedscheduler",
    "reducelronplateau",
}


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
        self._opt.step()
        self._param.grad = None

    def state_arrays(self) -> dict[str, np.ndarray]:
        state = self._opt.state.get(self._param, {})
        return {
            key: value.detach().cpu().numpy().copy() for key, value in state.items() if isinstance(value, torch.Tensor)
        }

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        if not arrays:
            return
        self._opt.state[self._param] = {
            k: torch.from_numpy(np.array(v)).to(self._param.device) for k, v in arrays.items()
        }


def _indexes_classes(loss: Any) -> bool:
    """Whether `loss` reads each label as the index of a class score (output[:, label])."""
    functional = (nn.functional.cross_entropy, nn.functional.nll_loss)
    return isinstance(loss, (nn.CrossEntropyLoss, nn.NLLLoss)) or any(loss is f for f in functional)


def _accuracy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Number of correct predictions (a sum, so ranks can add them up)."""
    if output.ndim >= 2 and output.shape[1] > 1:
        predicted = output.argmax(dim=1)
    else:
        predicted = (output.reshape(-1) > 0).to(target.dtype)
        target = target.reshape(-1)
    return (predicted == target).sum()


class TorchBackend(Backend):
    def __init__(
        self,
        model: nn.Module,
        loss: Callable[[Any, Any], Any] | None = None,
        metric: str | Callable[[Any, Any], Any] | None = "accuracy",
        precision: str = "fp32",
    ):
        if not isinstance(model, nn.Module):
            raise ModelError(f"the model must be a torch.nn.Module, got {type(model).__name__}")
        self.model = model.to(torch.float32)
        self.loss_fn = loss if loss is not None else nn.CrossEntropyLoss()
        if not callable(self.loss_fn):
            raise ModelError(f"the loss must be callable(output, target), got {self.loss_fn!r}")
        self._set_metric(metric)
        self._autocast = _AUTOCAST[precision]
        self.loss_scale = DynamicLossScale() if precision == "fp16" else None

        trainable = [p for p in self.model.parameters() if p.requires_grad]
        if not trainable:
            raise ModelError("the model has no trainable parameters")
        self._order = list(reversed(trainable))
        self._tensors = False  # the host path until place() says otherwise
        self._flatten(torch.device("cpu"))

        self._bucket_of: list[int] = []
        self._pending: list[int] = []
        self._bucket_sizes: list[int] = []
        self._on_ready: Callable[[int], None] | None = None

    def _flatten(self, device: torch.device) -> None:
        """Parameters, their gradients and the float buffers (BatchNorm statistics) become
        views into three flat tensors on `device`, holding their current values."""
        self._flat_params = torch.zeros(sum(p.numel() for p in self._order), dtype=torch.float32, device=device)
        self._flat_grads = torch.zeros_like(self._flat_params)
        self._slices: list[tuple[int, int]] = []
        offset = 0
        with torch.no_grad():
            for p in self._order:
                size = p.numel()
                self._flat_params[offset : offset + size].copy_(p.reshape(-1))
                p.data = self._flat_params[offset : offset + size].view_as(p)
                p.grad = self._flat_grads[offset : offset + size].view_as(p)
                self._slices.append((offset, offset + size))
                offset += size

            float_buffers = [b for b in self.model.buffers() if b.is_floating_point()]
            self._flat_state = torch.zeros(sum(b.numel() for b in float_buffers), dtype=torch.float32, device=device)
            offset = 0
            for b in float_buffers:
                size = b.numel()
                self._flat_state[offset : offset + size].copy_(b.reshape(-1))
                b.data = self._flat_state[offset : offset + size].view_as(b)
                offset += size
        self._expose()

    def _expose(self) -> None:
        """The flat buffers as the rest of nbdist sees them: numpy views on the host path,
        the tensors themselves on the device path (so that nothing can read them as host
        memory without going through the staging, even where the device is the CPU)."""
        flat = (self._flat_params, self._flat_grads, self._flat_state)
        self.params, self.grads, self.state = flat if self._tensors else (t.numpy() for t in flat)

    def place(self, request: DeviceRequest) -> None:
        from nbdist.backends.torch_device import CudaCopier, place

        placement = place(request)
        self._tensors = placement.tensors
        if placement.device != self._flat_params.device:
            self.model.to(placement.device)
            self._flatten(placement.device)
            self.copier = CudaCopier(placement.device) if placement.device.type == "cuda" else None
        self._expose()

    @property
    def device(self) -> torch.device:
        return self._flat_params.device

    @property
    def num_params(self) -> int:
        return int(self._flat_params.numel())

    def _set_metric(self, metric: str | Callable | None) -> None:
        self._metric: Callable[[torch.Tensor, torch.Tensor], Any] | None
        if metric is None:
            self.metric_name, self._metric = None, None
        elif metric in ("accuracy", "acc"):
            self.metric_name, self._metric = "acc", _accuracy
        elif callable(metric):
            # A user metric returns a batch mean; it is turned into a sum like accuracy.
            self.metric_name = getattr(metric, "__name__", "metric")
            self._metric = lambda out, y: metric(out, y) * len(y)
        else:
            raise ModelError(f"metric must be 'accuracy', a callable or None, got {metric!r}")

    # -- training ---------------------------------------------------------------------
    def _tensor(self, value: Any) -> torch.Tensor:
        tensor = torch.from_numpy(value) if isinstance(value, np.ndarray) else value
        if not isinstance(tensor, torch.Tensor) or tensor.device == self._flat_params.device:
            return tensor  # a batch already where the model is (the host path): no copy, no dispatch
        return tensor.to(self._flat_params.device, non_blocking=True)

    def _autocasting(self) -> torch.autocast | contextlib.nullcontext:
        if self._autocast is None:
            return _NO_AUTOCAST  # fp32: entering a disabled autocast costs a dozen calls a step
        return torch.autocast(self._flat_params.device.type, dtype=self._autocast)

    def compute_gradients(self, x: Any, y: Any, *, scale: float = 1.0) -> BatchStats:
        xb, yb = self._tensor(x), self._tensor(y)
        scaler = self.loss_scale
        if scaler is not None:
            scaler.settle(self.grads)
            scale *= scaler.scale
        # Backward accumulates into the .grad views in place, so they start from zero.
        self._flat_grads.zero_()
        self._pending = list(self._bucket_sizes)
        with self._autocasting():
            output = self.model(xb)
            loss = self.loss_fn(output, yb)
        (loss * scale if scale != 1.0 else loss).backward()
        if self._on_ready is not None:
            self._finish_buckets()
        elif scaler is not None:
            self._flat_grads.mul_(1.0 / scaler.scale)
        if scaler is not None:
            scaler.pending = True
        n = len(yb)
        with torch.no_grad():
            metric = float(self._metric(output, yb)) if self._metric else 0.0
        return BatchStats(float(loss.detach()) * n, metric, n)

    def _finish_buckets(self) -> None:
        """Parameters the forward pass did not use get no hook call: their buckets are ready too."""
        for bucket, left in enumerate(self._pending):
            if left > 0:
                self._pending[bucket] = 0
                self._bucket_ready(bucket)

    def _bucket_ready(self, bucket: int) -> None:
        # Out of the backend the gradient is unscaled: a bucket is reduced as it is.
        if self.loss_scale is not None:
            start, stop = self._bucket_ranges[bucket]
            self._flat_grads[start:stop].mul_(1.0 / self.loss_scale.scale)
        if self._on_ready is not None:
            self._on_ready(bucket)

    def evaluate(self, x: Any, y: Any, *, batch_size: int = 1024) -> BatchStats:
        stats = BatchStats()
        xb, yb = self._tensor(x), self._tensor(y)
        self.model.eval()
        try:
            with torch.no_grad(), self._autocasting():
                for start in range(0, len(yb), batch_size):
                    xs, ys = xb[start : start + batch_size], yb[start : start + batch_size]
                    output = self.model(xs)
                    n = len(ys)
                    metric = float(self._metric(output, ys)) if self._metric else 0.0
                    stats.add(BatchStats(float(self.loss_fn(output, ys)) * n, metric, n))
        finally:
            self.model.train()
        return stats

    def class_count(self, x: Any) -> int | None:
        if not _indexes_classes(self.loss_fn):
            return None
        self.model.eval()
        try:
            with torch.no_grad(), self._autocasting():
                output = self.model(self._tensor(x))
        except Exception:  # noqa: BLE001 - a model that cannot take the data: set-up's probe says so
            return None
        finally:
            self.model.train()
        return int(output.shape[1]) if isinstance(output, torch.Tensor) and output.ndim >= 2 else None

    def bucket_hooks(self, cap: int, on_ready: Callable[[int], None]) -> list[tuple[int, int]]:
        if self._on_ready is not None:
            raise RuntimeError("bucket hooks are already installed on this model")
        buckets: list[tuple[int, int]] = []
        start = 0
        for _, hi in self._slices:
            if hi - start >= cap:
                buckets.append((start, hi))
                start = hi
        if start < self.num_params:
            buckets.append((start, self.num_params))
        self._bucket_of = [next(i for i, (b0, b1) in enumerate(buckets) if b0 <= lo < b1) for lo, _ in self._slices]
        self._bucket_sizes = [self._bucket_of.count(i) for i in range(len(buckets))]
        self._bucket_ranges = buckets
        self._on_ready = on_ready
        for p, bucket in zip(self._order, self._bucket_of, strict=True):
            p.register_post_accumulate_grad_hook(self._make_hook(bucket))
        return buckets

    def _make_hook(self, bucket: int) -> Callable[[torch.Tensor], None]:
        def hook(_param: torch.Tensor) -> None:
            self._pending[bucket] -= 1
            if self._pending[bucket] == 0 and self._on_ready is not None:
                self._bucket_ready(bucket)

        return hook

    # -- optimisers -------------------------------------------------------------------
    def check_optimizer(self, spec: Spec) -> float:
        cls = _optimizer_class(spec)
        return step_on_scratch(
            spec, lambda scratch: TorchFlatOptimizer(cls, spec, scratch), np.zeros(SCRATCH_SIZE, np.float32)
        )

    def make_optimizer(self, spec: Spec, params: np.ndarray | None = None) -> FlatOptimizer:
        target = self.rule_params if params is None else params
        return self._overflow_guard(TorchFlatOptimizer(_optimizer_class(spec), spec, target))

    def make_lr_schedule(self, spec: Spec, base_lr: float) -> TorchLrSchedule:
        known = torch_lr_schedules()
        if spec.name not in known:
            raise unknown_name("torch learning-rate schedule (torch.optim.lr_scheduler)", spec.name, list(known))
        init = known[spec.name]  # its signature: (optimizer, ...)
        check_kwargs(f"learning-rate schedule {spec.name!r}", init, spec.kwargs, skip=1)
        check_value_kinds(f"learning-rate schedule {spec}", init, spec.kwargs)
        return TorchLrSchedule(known[spec.name], spec, base_lr)

    # -- synchronised BatchNorm (torch_batchnorm.py) --------------------------------------
    def convert_batchnorm(self) -> int:
        from nbdist.backends.torch_batchnorm import convert_batchnorm

        # The layers keep their parameters and statistics (views into the flat buffers).
        self.model, self._sync_layers = convert_batchnorm(self.model)
        return len(self._sync_layers)

    def reduce_batchnorm_over(self, reduce: Callable[[Any], None]) -> None:
        for layer in getattr(self, "_sync_layers", []):
            layer.reduce = reduce

    # -- state ------------------------------------------------------------------------
    def param_blocks(self) -> list[tuple[int, int, tuple[int, ...]]]:
        return [(lo, hi, tuple(p.shape)) for p, (lo, hi) in zip(self._order, self._slices, strict=True)]

    def named_arrays(self) -> dict[str, np.ndarray]:
        return {k: v.detach().cpu().numpy().copy() for k, v in self.model.state_dict().items()}

    def rng_state(self) -> dict[str, np.ndarray]:
        return {"torch_cpu": torch.get_rng_state().numpy().copy(), **self._loss_scale_state()}

    def set_rng_state(self, arrays: dict[str, np.ndarray]) -> None:
        self._load_loss_scale_state(arrays)
        if "torch_cpu" in arrays:
            torch.set_rng_state(torch.from_numpy(np.array(arrays["torch_cpu"], dtype=np.uint8)))

    def reseed(self, seed: int) -> None:
        torch.manual_seed(seed)
