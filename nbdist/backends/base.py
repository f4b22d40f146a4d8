"""The Backend protocol: one model replica seen as flat float32 buffers.

Algorithms and topologies only ever see `params`, `grads` and `state` as 1-D float32
arrays aliasing the model (PyTorch: views of the model's own memory, numpy on the host
path, the tensors on a device; Keras: the numpy buffer the model is run from), so an MPI
send of `params`, through the transport's staging, is a send of the model itself. A framework
implements this class and a `Framework` (frameworks.py); nothing above them knows which
one runs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import array_api_compat
import numpy as np

from nbdist.errors import UserError
from nbdist.specs import Spec, SpecError

__all__ = [
    "Backend",
    "FlatOptimizer",
    "LrSchedule",
    "BatchStats",
    "ModelError",
    "DeviceRequest",
    "step_on_scratch",
    "DynamicLossScale",
    "OverflowSkipping",
]

# Floats of the buffer an optimiser is tried on during set-up: the checks of its
# arguments' values do not depend on the model's size.
SCRATCH_SIZE = 8


class ModelError(UserError, ValueError):
    """The user's model, loss or metric cannot be used; the message says why."""


@dataclass(frozen=True, slots=True)
class DeviceRequest:
    """--device (auto, cpu or cuda) and the rank's local rank on its node (auto and cuda
    take GPU local_rank % gpus)."""

    choice: str = "auto"
    local_rank: int = 0


@dataclass(slots=True)
class BatchStats:
    """Sums over the samples of one or more batches (sums, so ranks can add them up)."""

    loss_sum: float = 0.0
    metric_sum: float = 0.0
    n: int = 0

    def add(self, other: BatchStats) -> None:
        self.loss_sum += other.loss_sum
        self.metric_sum += other.metric_sum
        self.n += other.n

    @property
    def loss(self) -> float:
        return self.loss_sum / self.n if self.n else float("nan")

    @property
    def metric(self) -> float:
        return self.metric_sum / self.n if self.n else float("nan")


class FlatOptimizer(ABC):
    """A framework optimiser bound to one flat parameter array, stepped with a flat gradient."""

    spec: Spec

    @abstractmethod
    def step(self, grad: np.ndarray) -> None:
        """params <- update(params, grad), in place."""

    @abstractmethod
    def state_arrays(self) -> dict[str, np.ndarray]:
        """Optimiser state as named arrays of their own (copies: a checkpoint keeps them
        while training goes on)."""

    @abstractmethod
    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None: ...

    @property
    @abstractmethod
    def learning_rate(self) -> float:
        """The learning rate the next step takes (the spec's, until set_learning_rate)."""

    @abstractmethod
    def set_learning_rate(self, lr: float) -> None:
        """Step with `lr` from now on (warm-up, scaling, schedules: train/lr.py)."""


def all_finite(array: Any) -> bool:
    """No inf or NaN in `array`, numpy or a tensor on any device (one number comes back)."""
    xp = array_api_compat.array_namespace(array)
    return bool(xp.all(xp.isfinite(array)))


class DynamicLossScale:
    """fp16 loss scaling, with torch.amp.GradScaler's rule and defaults: the loss is
    multiplied by `scale` before the backward pass and the gradient divided by it after,
    so small fp16 gradients do not flush to zero; a non-finite gradient halves the scale,
    2000 finite ones in a row double it.

    GradScaler unscales at the optimiser; here the gradient leaves the backend before any
    optimiser (to a master, into a bucketed allreduce while backward runs), so the backend
    unscales it, and the scale follows the gradient the step was taken from: the update is
    made lazily, from `grads` as the next backward finds them (an allreduce rank finds the
    reduced sum there, so every rank of the run takes the same decision)."""

    __slots__ = ("scale", "good_steps", "pending", "growth_interval")

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 2000):
        self.scale, self.good_steps, self.pending, self.growth_interval = float(scale), 0, False, growth_interval

    def settle(self, grads: np.ndarray) -> None:
        """Update the scale from the last gradient, once (before a backward pass, a save)."""
        if not self.pending:
            return
        self.pending = False
        if not all_finite(grads):
            self.scale, self.good_steps = self.scale * 0.5, 0
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale, self.good_steps = self.scale * 2.0, 0

    def to_array(self) -> np.ndarray:
        return np.array([self.scale, self.good_steps], np.float64)

    def load_array(self, array: np.ndarray) -> None:
        self.scale, self.good_steps, self.pending = float(array[0]), int(array[1]), False


class OverflowSkipping(FlatOptimizer):
    """An optimiser that skips a step whose gradient is not finite (an fp16 overflow that
    the loss scale then backs off from), as GradScaler.step does; `skipped` counts them.
    Ranks that step on the same reduced gradient skip the same steps."""

    def __init__(self, inner: FlatOptimizer):
        self.inner, self.spec, self.skipped = inner, inner.spec, 0

    def step(self, grad: np.ndarray) -> None:
        if all_finite(grad):
            self.inner.step(grad)
        else:
            self.skipped += 1

    def state_arrays(self) -> dict[str, np.ndarray]:
        return self.inner.state_arrays()

    def load_state_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        self.inner.load_state_arrays(arrays)

    @property
    def learning_rate(self) -> float:
        return self.inner.learning_rate

    def set_learning_rate(self, lr: float) -> None:
        self.inner.set_learning_rate(lr)


class LrSchedule(ABC):
    """A framework's learning-rate schedule (a torch.optim.lr_scheduler class, a Keras
    schedule) seen as a function of the epoch: the lr of epoch `epoch` (0-based) for an
    optimiser whose own lr is the `base_lr` it was made with. A function, not a stepped
    object: its state is the epoch, which every checkpoint holds, so a resumed run gets
    the same lr as an uninterrupted one."""

    spec: Spec

    @abstractmethod
    def lr_at(self, epoch: int) -> float: ...


class Backend(ABC):
    """A framework's model on flat float32 buffers: gradients in, weights out.

    The only code that touches torch or TensorFlow. A backend wraps the user's model (it
    does not replace it): `params`, `grads` and `state` are one flat float32 buffer each,
    aliasing the model's own weights, gradients and statistics, so that MPI sends them
    without a copy and an update rule works on them as arrays. `TorchBackend`
    (`nbdist.backends.torch`) and `KerasBackend` (`nbdist.backends.keras`, imported only
    for a Keras model) implement it; the framework is chosen from the model's type.

    Example:
        One batch's gradient into the flat buffer, then an SGD step on it:

        >>> import numpy as np, torch
        >>> from nbdist.backends.torch import TorchBackend
        >>> from nbdist.specs import parse_spec
        >>> backend = TorchBackend(torch.nn.Linear(4, 2))   # 4 x 2 weights + 2 biases
        >>> backend.params.shape, backend.params.dtype
        ((10,), dtype('float32'))
        >>> x, y = np.ones((3, 4), np.float32), np.array([0, 1, 0])
        >>> stats = backend.compute_gradients(x, y)          # grads = d(mean loss)/d(params)
        >>> stats.n
        3
        >>> before = backend.params.copy()
        >>> backend.make_optimizer(parse_spec("sgd(lr=0.1)")).step(backend.grads)
        >>> bool(np.allclose(backend.params, before - 0.1 * backend.grads))
        True
    """

    # The flat float32 buffers, aliasing the model, where the model lives: numpy arrays on
    # the host path, torch tensors on the device path (--device; the CPU or a GPU). Code
    # outside the backend reads them as host memory only through the transport's staging
    # (MPI) or algorithms.arrays' to_numpy/copy_into (checkpoints), never as numpy.
    params: Any  # trainable weights
    grads: Any  # their gradients, filled by compute_gradients
    state: Any  # non-trainable float state (BatchNorm statistics), maybe empty
    metric_name: str | None  # e.g. "acc"; None when the model has no metric
    loss_scale: DynamicLossScale | None = None  # fp16 only

    # -- fp16 loss scaling, the same for every framework ---------------------------------
    def _overflow_guard(self, optimizer: FlatOptimizer) -> FlatOptimizer:
        return OverflowSkipping(optimizer) if self.loss_scale is not None else optimizer

    def _loss_scale_state(self) -> dict[str, np.ndarray]:
        # Saved with the RNG state, which every rank writes for itself: a checkpoint taken
        # right after an overflow holds the halved scale, as the next step would see it.
        if self.loss_scale is None:
            return {}
        self.loss_scale.settle(self.grads)
        return {"loss_scale": self.loss_scale.to_array()}

    def _load_loss_scale_state(self, arrays: dict[str, np.ndarray]) -> None:
        if self.loss_scale is not None and "loss_scale" in arrays:
            self.loss_scale.load_array(arrays["loss_scale"])

    @property
    def num_params(self) -> int:
        return int(self.params.size)

    # `copier`: what copies between the flat buffers and pinned host memory (None: MPI
    # reads them as they are). `rule_params`/`rule_grads`: the same buffers, by the name
    # the update rules' callers use.
    copier: Any = None

    @property
    def rule_params(self) -> Any:
        return self.params

    @property
    def rule_grads(self) -> Any:
        return self.grads

    def place(self, request: DeviceRequest) -> None:
        """Move the model to the device `request` asks for. This framework's buffers stay
        on the host: only --device cuda cannot be honoured."""
        if request.choice == "cuda":
            raise ModelError(
                f"--device cuda places PyTorch models; this {type(self).__name__} runs where its "
                f"framework puts it: use --device auto"
            )

    def convert_batchnorm(self) -> int:
        """--sync-batchnorm: replace the model's BatchNorm layers by synchronised ones
        (plain BatchNorm until `reduce_batchnorm_over`); returns how many there were."""
        raise ModelError(
            f"--sync-batchnorm synchronises the BatchNorm layers of PyTorch models "
            f"(torch.nn.BatchNorm1d/2d/3d); a {type(self).__name__} has none: drop --sync-batchnorm"
        )

    def reduce_batchnorm_over(self, reduce: Callable[[Any], None]) -> None:
        """From now on the converted layers sum their batch statistics, and in the backward
        pass their gradient terms, with `reduce` (in place, on a flat float32 array where the
        model lives) over the ranks that share a batch."""
        raise ModelError(f"a {type(self).__name__} has no synchronised BatchNorm")

    @abstractmethod
    def compute_gradients(self, x: Any, y: Any, *, scale: float = 1.0) -> BatchStats:
        """Forward and backward on one batch; `grads` holds scale * d(mean loss)/d(params).

        Gradients are overwritten, not accumulated.
        """

    @abstractmethod
    def evaluate(self, x: Any, y: Any, *, batch_size: int = 1024) -> BatchStats:
        """The loss and metric sums of the model on `x`, `y`, `batch_size` samples at a
        time, in evaluation mode (BatchNorm's running statistics, no dropout)."""

    def class_count(self, x: Any) -> int | None:
        """How many classes the model scores on input `x` when its loss takes each label as
        the index of one (cross-entropy on class indices); None for any other loss, or where
        the framework cannot tell. Set-up compares it with the labels."""
        return None

    @abstractmethod
    def make_optimizer(self, spec: Spec, params: np.ndarray | None = None) -> FlatOptimizer:
        """A named optimiser over `params` (default: this model's own weights)."""

    @abstractmethod
    def check_optimizer(self, spec: Spec) -> float:
        """Raise SpecError when `spec` names no optimiser of this framework, or arguments it
        does not take, or values it cannot step with (built once on a scratch buffer).
        Returns the learning rate it starts with (the spec's, or the framework's default)."""

    @abstractmethod
    def make_lr_schedule(self, spec: Spec, base_lr: float) -> LrSchedule:
        """The learning-rate schedule `spec` names (SpecError for an unknown name or argument)."""

    def checked_lr_schedule(self, spec: Spec, base_lr: float) -> LrSchedule:
        """The schedule of `spec` for an optimiser whose lr is `base_lr`, run for its first
        epochs (set-up, on every rank): SpecError for one this framework cannot run."""
        schedule = self.make_lr_schedule(spec, base_lr)
        try:
            lrs = [schedule.lr_at(epoch) for epoch in range(3)]
        except UserError:
            raise
        except Exception as exc:  # the framework's own words name the argument
            raise SpecError(f"learning-rate schedule {spec}: {type(exc).__name__}: {exc}") from None
        if not all(np.isfinite(lr) and lr >= 0 for lr in lrs):
            raise SpecError(
                f"learning-rate schedule {spec}: gives the learning rates {lrs} in its first epochs: "
                f"check the values of its arguments"
            )
        return schedule

    @abstractmethod
    def bucket_hooks(self, cap: int, on_ready: Callable[[int], None]) -> list[tuple[int, int]]:
        """Split `grads` into contiguous buckets of about `cap` floats in backward order;
        call `on_ready(i)` from inside the backward pass as soon as bucket i is final.
        Returns the buckets' (start, stop) ranges. Every bucket fires once per backward."""

    def param_blocks(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """Each trainable parameter's (start, stop) in the flat buffer and its shape
        (--compression powersgd factors the matrices); by default one vector."""
        return [(0, self.num_params, (self.num_params,))]

    @abstractmethod
    def named_arrays(self) -> dict[str, np.ndarray]:
        """The model's weights and state by their framework names (for exporting)."""

    @abstractmethod
    def rng_state(self) -> dict[str, np.ndarray]: ...

    @abstractmethod
    def set_rng_state(self, arrays: dict[str, np.ndarray]) -> None: ...

    @abstractmethod
    def reseed(self, seed: int) -> None:
        """Seed this replica's randomness from now on (dropout, a GAN's noise), e.g. with a
        per-rank seed once every replica holds the same initial weights."""

    def train_extras(self) -> dict[str, float]:
        """Means of extra training metrics over the batches since the last call (a GAN's
        losses and discriminator outputs); the topologies add them to their train records."""
        return {}


def step_on_scratch(spec: Spec, make: Callable[[np.ndarray], FlatOptimizer], scratch: np.ndarray) -> float:
    """Build the optimiser of `spec` over `scratch` and step it once with a unit gradient;
    returns the learning rate it was built with.

    Run during set-up, on every rank: a value the framework rejects (a negative learning
    rate, betas outside [0, 1), a string for a number) fails here, as one error, instead
    of in the one role that builds the optimiser while the others wait for it."""
    given = next((spec.kwargs[k] for k in ("lr", "learning_rate") if k in spec.kwargs), None)
    if isinstance(given, int | float) and not isinstance(given, bool) and given < 0:
        raise SpecError(
            f"optimizer {spec}: a learning rate below 0 climbs the loss instead of descending it: give lr "
            f"above 0, e.g. {spec.name}(lr=0.01)"
        )
    scratch[:] = 0.0
    optimizer = make(scratch)
    lr = optimizer.learning_rate
    if lr == 0:
        raise SpecError(
            f"optimizer {spec}: a learning rate of 0 never changes the weights: give lr above 0, "
            f"e.g. {spec.name}(lr=0.01)"
        )
    try:
        optimizer.step(np.ones_like(scratch))
    except UserError:
        raise
    except Exception as exc:  # the framework's own words name the argument
        raise SpecError(f"optimizer {spec}: {type(exc).__name__}: {exc}") from None
    if not np.all(np.isfinite(scratch)):
        raise SpecError(
            f"optimizer {spec}: one step from zero weights with a unit gradient gives "
            f"{scratch[~np.isfinite(scratch)][0]}: check the values of its arguments"
        )
    return lr
