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
    ModelError,
    step_on_scratch,
)
from nbdist.backends.torch_optimizers import (
    TorchFlatOptimizer,
    TorchLrSchedule,
    optimizer_class,
    torch_lr_schedules,
    torch_optimizers,
    unnameable_schedule,
)
from nbdist.specs import Spec, SpecError, check_kwargs, check_value_kinds, unknown_name

__all__ = ["TorchBackend", "TorchFlatOptimizer", "TorchLrSchedule", "torch_optimizers", "torch_lr_schedules"]

# --precision: the dtype autocast runs the forward pass in (None: no autocast). The
# parameters and the flat gradient stay float32 either way (autocast casts copies).
_AUTOCAST = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
_NO_AUTOCAST = contextlib.nullcontext()  # fp32's: reusable, and re-entrant


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
        cls = optimizer_class(spec)
        return step_on_scratch(
            spec, lambda scratch: TorchFlatOptimizer(cls, spec, scratch), np.zeros(SCRATCH_SIZE, np.float32)
        )

    def make_optimizer(self, spec: Spec, params: np.ndarray | None = None) -> FlatOptimizer:
        target = self.rule_params if params is None else params
        return self._overflow_guard(TorchFlatOptimizer(optimizer_class(spec), spec, target))

    def make_lr_schedule(self, spec: Spec, base_lr: float) -> TorchLrSchedule:
        known = torch_lr_schedules()
        why = unnameable_schedule(spec.name)
        if why is not None:
            raise SpecError(
                f"torch learning-rate schedule {spec.name!r} {why}; choose one of: {', '.join(sorted(known))}"
            )
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
