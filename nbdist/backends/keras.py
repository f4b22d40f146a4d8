"""Keras 3 backend (TensorFlow): a model run from one flat float32 buffer.

Keras variables own their memory (TensorFlow resources), so numpy cannot alias them the
way the PyTorch backend aliases parameters. Here the flat numpy arrays ARE the weights:
each batch runs the model *statelessly* (`stateless_call`) on tensors cut from `params`,
inside one compiled tf.function that also computes the compiled loss, the gradient with
respect to the flat buffer (GradientTape) and the new values of the non-trainable state
(BatchNorm statistics into `state`, dropout seed generators). Per batch that is one call
and two copies of the weights' size (numpy -> tensor, gradient tensor -> `grads`).
Assigning the model's variables from the buffer instead costs one op per weight tensor:
about twice the time of the whole step on the digits MLP. The model's own variables keep
the values it was built with; `named_arrays()` gives the trained ones by variable path.

Keras has no per-variable backward hooks: the allreduce topology's bucket callbacks all
fire once the tape's gradient is out (the reduction does not overlap the backward pass,
as it does with PyTorch).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from nbdist.backends.base import (
    SCRATCH_SIZE,
    Backend,
    BatchStats,
    DynamicLossScale,
    FlatOptimizer,
    LrSchedule,
    ModelError,
    step_on_scratch,
)
from nbdist.backends.frameworks import KERAS, unknown_optimizer
from nbdist.specs import Spec, SpecError, ValueRange, check_kwargs, unknown_name

__all__ = [
    "KerasBackend",
    "DTYPE_POLICIES",
    "KerasFlatOptimizer",
    "KerasLrSchedule",
    "keras_optimizers",
    "keras_lr_schedules",
    "FlatVariables",
    "Traced",
    "aligned_zeros",
]

# --precision as Keras' dtype policies: mixed ones keep the variables (here the flat
# buffers) float32 and compute in the lower precision.
DTYPE_POLICIES = {"fp32": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}

# Wrappers around another optimiser, not optimisers of their own.
_UNSUITABLE = {"optimizer", "lossscaleoptimizer", "multioptimizer"}
_ACCURACY = ("accuracy", "acc")
_CATEGORICAL_LOSSES = (keras.losses.categorical_crossentropy, keras.losses.categorical_focal_crossentropy)


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


def check_model(model: Any, what: str = "model") -> None:
    if not isinstance(model, keras.Model):
        raise ModelError(
            f"the {what} is a Keras {type(model).__name__} layer, not a model: wrap it, e.g. keras.Sequential([layer])"
        )


def check_policy(model: keras.Model, precision: str) -> None:
    """The model's layers compute in the dtype --precision asks for: Keras fixes a layer's
    policy when it is made, from the global policy nbdist sets before build_model() runs."""
    policy = getattr(model.dtype_policy, "name", str(model.dtype_policy))
    if policy != DTYPE_POLICIES[precision]:
        matching = [name for name, known in DTYPE_POLICIES.items() if known == policy]
        hint = (
            f"give --precision {matching[0]} for this model"
            if matching
            else "make it with one of " + ", ".join(DTYPE_POLICIES.values())
        )
        raise ModelError(
            f"--precision {precision}: the Keras model was made with the dtype policy {policy!r}, "
            f"not {DTYPE_POLICIES[precision]!r}: make it inside build_model(), after nbdist has set "
            f"the policy (keras.mixed_precision.set_global_policy), or {hint}"
        )


def call_kwargs(model: keras.Model, training: bool) -> dict[str, Any]:
    # Models whose call() takes no `training` argument (some subclassed ones) get none.
    return {"training": training} if "training" in inspect.signature(model.call).parameters else {}


class KerasBackend(Backend):
    def __init__(
        self,
        model: keras.Model,
        loss: Any = None,
        metric: Any = "accuracy",
        *,
        sample: Any = None,
        precision: str = "fp32",
    ):
        check_model(model)
        check_policy(model, precision)
        build_models([model], [sample])
        self.loss_scale = DynamicLossScale() if precision == "fp16" else None
        self.model = model
        self._flat = FlatVariables([model])
        if not self._flat.params.size:
            raise ModelError("the model has no trainable parameters")
        self.params, self.state = self._flat.params, self._flat.state
        self.grads = aligned_zeros(self.params.size)
        self._loss, self._categorical, self._indexes_classes = _resolve_loss(model, loss)
        self.metric_name, self._metric = _resolve_metric(model, metric)
        self._train_kwargs, self._eval_kwargs = call_kwargs(model, True), call_kwargs(model, False)
        self._train = Traced(self._train_step, batch=(3, 4))
        self._eval = Traced(self._eval_step, batch=(3, 4))
        self._buckets: list[tuple[int, int]] = []
        self._on_ready: Callable[[int], None] | None = None
        self._models, self._prefixes = [model], [""]  # named_arrays(): each model's keys start with its prefix

    def convert_batchnorm(self) -> int:
        raise ModelError(
            "--sync-batchnorm is for PyTorch models: a Keras model trains as one traced TensorFlow function on "
            "flat buffers, and a synchronised BatchNormalization would need an MPI reduction inside that function, "
            "forward and backward; drop --sync-batchnorm (each process then normalises over its own batch, and "
            "allreduce ranks average their statistics before each validation) or use a PyTorch model"
        )

    # -- graph side -------------------------------------------------------------------
    def _target(self, y: tf.Tensor, y_pred: tf.Tensor) -> tf.Tensor:
        # Integer labels meet a categorical loss (the usual Keras spelling, one-hot labels):
        # one-hot them to the model's output width here rather than in every data loader.
        if self._categorical and y.dtype.is_integer and y.shape.rank == 1 and y_pred.shape.rank == 2:
            return tf.one_hot(y, tf.shape(y_pred)[-1], dtype=y_pred.dtype)
        return y

    def _forward(self, params, state, others, x, y, kwargs):
        (trainable,), (non_trainable,) = self._flat.unpack(params, state, others)
        y_pred, non_trainable, extra = self.model.stateless_call(
            trainable, non_trainable, x, return_losses=True, **kwargs
        )
        # Under a mixed policy the output is bf16/fp16: the loss and metric are taken in
        # float32, as Keras' own compiled loss takes them.
        y_pred = tf.cast(y_pred, tf.float32)
        target = self._target(y, y_pred)
        loss = self._loss(target, y_pred)
        if extra:  # add_loss() and weight regularisers, as model.compute_loss adds them
            loss = loss + tf.add_n([tf.reduce_sum(tf.cast(e, loss.dtype)) for e in extra])
        metric = self._metric(target, y_pred) if self._metric else tf.zeros(())
        return loss, metric, non_trainable

    def _train_step(self, params, state, others, x, y, scale, unscale):
        with tf.GradientTape() as tape:
            tape.watch(params)
            loss, metric, non_trainable = self._forward(params, state, others, x, y, self._train_kwargs)
            scaled = loss * scale
        grad = tape.gradient(scaled, params, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        if self.loss_scale is not None:  # decided when traced: fp32 and bf16 pay nothing
            grad = grad * unscale
        new_state, new_others = self._flat.pack([non_trainable])
        return grad, new_state, new_others, loss, metric

    def _eval_step(self, params, state, others, x, y):
        loss, metric, _ = self._forward(params, state, others, x, y, self._eval_kwargs)
        return loss, metric

    # -- training ---------------------------------------------------------------------
    def compute_gradients(self, x: Any, y: Any, *, scale: float = 1.0) -> BatchStats:
        loss_scale = 1.0
        if self.loss_scale is not None:
            self.loss_scale.settle(self.grads)
            loss_scale = self.loss_scale.scale
        grad, state, others, loss, metric = self._train(
            self.params,
            self.state,
            self._flat.others,
            x,
            y,
            np.array(scale * loss_scale, np.float32),
            np.array(1.0 / loss_scale, np.float32),
        )
        np.copyto(self.grads, grad.numpy())
        if self.loss_scale is not None:
            self.loss_scale.pending = True
        self._flat.store(self.state, state, others)
        if self._on_ready is not None:
            for i in range(len(self._buckets)):
                self._on_ready(i)
        n = len(y)
        return BatchStats(float(loss) * n, float(metric), n)

    def class_count(self, x: Any) -> int | None:
        if not self._indexes_classes:
            return None
        try:  # shapes only: nothing is computed
            shape = self.model.compute_output_spec(keras.KerasTensor(x.shape, dtype=str(x.dtype))).shape
        except Exception:  # noqa: BLE001 - a model Keras cannot trace symbolically: not checked here
            return None
        return int(shape[-1]) if len(shape) == 2 and shape[-1] is not None else None

    def evaluate(self, x: Any, y: Any, *, batch_size: int = 1024) -> BatchStats:
        stats = BatchStats()
        for start in range(0, len(y), batch_size):
            ys = y[start : start + batch_size]
            loss, metric = self._eval(self.params, self.state, self._flat.others, x[start : start + batch_size], ys)
            stats.add(BatchStats(float(loss) * len(ys), float(metric), len(ys)))
        return stats

    def bucket_hooks(self, cap: int, on_ready: Callable[[int], None]) -> list[tuple[int, int]]:
        if self._on_ready is not None:
            raise RuntimeError("bucket hooks are already installed on this model")
        # Variable boundaries in reverse (the order backward finishes them), as PyTorch's.
        ends = np.cumsum([int(np.prod(v.shape)) for vs in self._flat.trainable for v in vs])[::-1]
        buckets, stop = [], self.num_params
        for start in [*ends[1:], 0]:
            if stop - start >= cap or start == 0:
                buckets.append((int(start), int(stop)))
                stop = start
        self._buckets, self._on_ready = buckets, on_ready
        return buckets

    # -- optimisers -------------------------------------------------------------------
    def make_lr_schedule(self, spec: Spec, base_lr: float) -> KerasLrSchedule:
        known = keras_lr_schedules()
        if spec.name not in known:
            raise unknown_name("Keras learning-rate schedule (keras.optimizers.schedules)", spec.name, list(known))
        check_kwargs(f"learning-rate schedule {spec.name!r}", known[spec.name], spec.kwargs)
        return KerasLrSchedule(known[spec.name], spec, base_lr)

    def check_optimizer(self, spec: Spec) -> float:
        return step_on_scratch(spec, lambda scratch: KerasFlatOptimizer(spec, scratch), aligned_zeros(SCRATCH_SIZE))

    def make_optimizer(self, spec: Spec, params: np.ndarray | None = None) -> FlatOptimizer:
        return self._overflow_guard(KerasFlatOptimizer(spec, self.params if params is None else params))

    # -- state ------------------------------------------------------------------------
    def param_blocks(self) -> list[tuple[int, int, tuple[int, ...]]]:
        return self._flat.param_blocks()

    def named_arrays(self) -> dict[str, np.ndarray]:
        return named_arrays(self._flat, self._models, self.params, self.state, self._prefixes)

    def rng_state(self) -> dict[str, np.ndarray]:
        return {**{f"keras_{i}": np.array(a) for i, a in enumerate(self._flat.others)}, **self._loss_scale_state()}

    def set_rng_state(self, arrays: dict[str, np.ndarray]) -> None:
        self._load_loss_scale_state(arrays)
        for i, array in enumerate(self._flat.others):
            if f"keras_{i}" in arrays:
                array[...] = arrays[f"keras_{i}"]

    def reseed(self, seed: int) -> None:
        self._flat.reseed(seed)


def named_arrays(
    flat: FlatVariables, models: list[keras.Model], params: np.ndarray, state: np.ndarray, prefixes: list[str]
) -> dict[str, np.ndarray]:
    """Each model's weights in `model.weights` order, as `<prefix><index>/<variable path>`:
    paths carry global layer counters (dense_7), so they differ between processes, but
    the zero-padded index sorts the keys in the order `model.set_weights` takes:

        model.set_weights([arrays[k] for k in sorted(arrays) if k.startswith(prefix)])
    """
    values: dict[int, np.ndarray] = {}
    offsets = {"params": 0, "state": 0, "others": 0}
    for _, kind, v in flat.paths(prefixes):
        start = offsets[kind]
        if kind == "others":  # one array per variable
            values[id(v)], offsets[kind] = flat.others[start], start + 1
            continue
        size = int(np.prod(v.shape))
        source = params if kind == "params" else state
        values[id(v)], offsets[kind] = source[start : start + size].reshape(v.shape), start + size
    return {
        f"{prefix}{i:04d}/{v.path}": np.array(values[id(v)])
        for prefix, model in zip(prefixes, models, strict=True)
        for i, v in enumerate(model.weights)
    }


# -- the compiled loss and metric ---------------------------------------------------------
def _compiled(model: keras.Model, key: str) -> Any:
    # compile() keeps its arguments as given (objects, not serialised configs) here.
    config = getattr(getattr(model, "_compile_config", None), "config", None) or {}
    return config.get(key)


def _resolve_loss(model: keras.Model, loss: Any) -> tuple[Callable, bool, bool]:
    """The model's compiled loss (else `loss` from the model file or cell) as a function
    of (target, prediction) returning the batch mean, whether it is categorical, and
    whether it reads integer labels as class indices (sparse, or categorical one-hot here)."""
    identifier = model.loss if getattr(model, "compiled", False) and model.loss is not None else loss
    if identifier is None:
        raise ModelError(
            "the Keras model has no loss: compile it, e.g. model.compile(loss="
            "'sparse_categorical_crossentropy', metrics=['accuracy']), or define `loss`"
        )
    if isinstance(identifier, (list, tuple, dict)):
        raise ModelError("nbdist trains Keras models with one output and one loss; got several losses")
    if isinstance(identifier, str) and identifier.lower() in ("crossentropy", "ce"):
        identifier = "sparse_categorical_crossentropy"  # integer labels, several classes
    try:
        obj = keras.losses.get(identifier)
    except (ValueError, TypeError) as exc:
        raise ModelError(f"loss {identifier!r}: {exc}") from None
    if not callable(obj):
        raise ModelError(f"the loss must be a Keras loss or callable(y_true, y_pred), got {identifier!r}")
    categorical = getattr(obj, "fn", obj) in _CATEGORICAL_LOSSES
    indexes = categorical or getattr(obj, "fn", obj) is keras.losses.sparse_categorical_crossentropy
    if isinstance(obj, keras.losses.Loss):
        return obj, categorical, indexes  # reduces to the batch mean itself
    return (lambda y, p: tf.reduce_mean(obj(y, p))), categorical, indexes


def _accuracy_sum(y: tf.Tensor, y_pred: tf.Tensor) -> tf.Tensor:
    """Correct predictions, with the rule Keras applies to metrics=['accuracy']."""
    if y_pred.shape[-1] == 1:
        values = keras.metrics.binary_accuracy(y, y_pred)
    elif y.shape.rank < y_pred.shape.rank or y.shape[-1] == 1:
        values = keras.metrics.sparse_categorical_accuracy(y, y_pred)
    else:
        values = keras.metrics.categorical_accuracy(y, y_pred)
    return tf.reduce_sum(tf.cast(values, tf.float32))


def _resolve_metric(model: keras.Model, metric: Any) -> tuple[str | None, Callable | None]:
    """The model's first compiled metric (else `metric`) as a function returning the
    batch's sum (a batch mean times the batch size), so ranks can add them up."""
    compiled = _compiled(model, "metrics")
    if isinstance(compiled, dict):
        raise ModelError("nbdist trains Keras models with one output; got metrics per output")
    identifier = compiled[0] if compiled else metric
    if identifier is None:
        return None, None
    if isinstance(identifier, str) and identifier.lower() in _ACCURACY:
        return "acc", _accuracy_sum
    try:
        obj = keras.metrics.get(identifier)
    except (ValueError, TypeError) as exc:
        raise ModelError(f"metric {identifier!r}: {exc}") from None
    if isinstance(obj, keras.metrics.Metric):
        name = obj.name

        def metric_sum(y, y_pred):
            variables = obj.stateless_update_state(obj.stateless_reset_state(), y, y_pred)
            return tf.cast(obj.stateless_result(variables), tf.float32) * tf.cast(tf.shape(y_pred)[0], tf.float32)
    elif callable(obj):
        name = getattr(obj, "__name__", "metric")

        def metric_sum(y, y_pred):
            values = tf.cast(obj(y, y_pred), tf.float32)
            if values.shape.rank == 0:  # a batch mean
                return values * tf.cast(tf.shape(y_pred)[0], tf.float32)
            return tf.reduce_sum(values)
    else:
        raise ModelError(f"metric must be 'accuracy', a Keras metric or a callable, got {identifier!r}")
    return ("acc" if name.endswith("accuracy") else name), metric_sum
