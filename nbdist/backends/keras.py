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
    ModelError,
    step_on_scratch,
)
from nbdist.backends.keras_flat import FlatVariables, Traced, aligned_zeros, build_models
from nbdist.backends.keras_optimizers import KerasFlatOptimizer, KerasLrSchedule, keras_lr_schedules
from nbdist.specs import Spec, check_kwargs, unknown_name

__all__ = ["KerasBackend", "DTYPE_POLICIES", "call_kwargs", "check_model"]

# --precision as Keras' dtype policies: mixed ones keep the variables (here the flat
# buffers) float32 and compute in the lower precision.
DTYPE_POLICIES = {"fp32": "float32", "bf16": "mixed_bfloat16", "fp16": "mixed_float16"}

_ACCURACY = ("accuracy", "acc")
_CATEGORICAL_LOSSES = (keras.losses.categorical_crossentropy, keras.losses.categorical_focal_crossentropy)


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
