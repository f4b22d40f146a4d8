"""The Keras backend without MPI: the flat buffers against Keras's own training, the
compiled loss and metrics, BatchNorm statistics and dropout seeds, buckets, optimisers by
name (and a torch name given for a Keras model), errors, the GAN backend, and that a
PyTorch run never imports TensorFlow."""

from __future__ import annotations

import os
import subprocess
import sys
from itertools import pairwise

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
keras = pytest.importorskip("keras")

from nbdist.backends import backend_for  # noqa: E402
from nbdist.backends.base import ModelError  # noqa: E402
from nbdist.backends.frameworks import KERAS, TORCH  # noqa: E402
from nbdist.backends.keras import KerasBackend  # noqa: E402
from nbdist.gan import GanModel, gan_backend  # noqa: E402
from nbdist.gan.keras_backend import KerasGanBackend  # noqa: E402
from nbdist.specs import SpecError, parse_spec  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def data(n: int = 64, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    y = (x[:, :3].argmax(1)).astype(np.int64)
    return x, y


def mlp(
    seed: int = 1,
    loss: str = "sparse_categorical_crossentropy",
    batchnorm: bool = False,
    dropout: float = 0.0,
    compile: bool = True,
    inputs: bool = True,
) -> keras.Model:
    keras.utils.set_random_seed(seed)
    layers = [keras.Input(shape=(8,))] if inputs else []
    layers += [keras.layers.Dense(16, activation="relu", kernel_regularizer=keras.regularizers.l2(1e-3))]
    layers += [keras.layers.BatchNormalization()] if batchnorm else []
    layers += [keras.layers.Dropout(dropout)] if dropout else []
    layers += [keras.layers.Dense(3, activation="softmax")]
    model = keras.Sequential(layers)
    if compile:
        model.compile(loss=loss, metrics=["accuracy"])
    return model


# ----------------------------------------------------------------------- training
@pytest.mark.parametrize("loss", ["sparse_categorical_crossentropy", "categorical_crossentropy"])
def test_steps_equal_keras_own_training(loss):
    """Flat buffers, stateless calls and the flat optimiser == model.train_on_batch, with a
    regulariser and BatchNorm; integer labels meet a categorical loss as one-hot."""
    x, y = data()
    backend = backend_for(mlp(loss=loss, batchnorm=True), sample=x)
    assert isinstance(backend, KerasBackend) and backend.metric_name == "acc"
    assert backend.state.size == 32  # BatchNorm's moving mean and variance
    opt = backend.make_optimizer(parse_spec("sgd(lr=0.1, momentum=0.9)"))
    reference = mlp(loss=loss, batchnorm=True)
    reference.compile(loss=loss, optimizer=keras.optimizers.SGD(0.1, momentum=0.9), metrics=["accuracy"])
    target = keras.utils.to_categorical(y, 3) if loss.startswith("categorical") else y
    for step in range(8):
        batch = slice(step * 8, step * 8 + 8)
        stats = backend.compute_gradients(x[batch], y[batch])
        opt.step(backend.grads)
        logs = reference.train_on_batch(x[batch], target[batch], return_dict=True)
    assert stats.loss == pytest.approx(logs["loss"], rel=1e-5)
    assert stats.metric == pytest.approx(logs["accuracy"], abs=1e-6)
    ours = backend.named_arrays()
    theirs = [np.asarray(v.numpy()) for v in reference.weights]
    assert len(ours) == len(theirs)
    for key, expected in zip(sorted(ours), theirs, strict=True):
        np.testing.assert_allclose(ours[key], expected, atol=1e-5, err_msg=key)
    # The moving statistics travelled through `state`.
    assert np.abs(backend.state[:16]).max() > 1e-3


def test_gradient_is_scaled_and_the_model_variables_are_left_alone():
    x, y = data()
    model = mlp()
    before = [np.asarray(v.numpy()) for v in model.weights]
    backend = backend_for(model, sample=x)
    backend.compute_gradients(x[:16], y[:16])
    full = backend.grads.copy()
    backend.compute_gradients(x[:16], y[:16], scale=0.25)
    np.testing.assert_allclose(backend.grads, 0.25 * full, rtol=1e-5, atol=1e-8)
    # A second backend on the same model object (a master's validation replica) is independent.
    other = backend_for(model, sample=x)
    other.params[:] = 0.0
    assert np.abs(backend.params).max() > 0
    assert all(np.array_equal(a, np.asarray(v.numpy())) for a, v in zip(before, model.weights, strict=True))


@pytest.mark.parametrize(
    "metric, name",
    [
        ("sparse_categorical_crossentropy", "sparse_categorical_crossentropy"),  # a function
        (lambda: keras.metrics.SparseTopKCategoricalAccuracy(k=2, name="top2"), "top2"),  # a Metric object
    ],
)
def test_evaluate_uses_the_compiled_loss_and_metric(metric, name):
    x, y = data(200)
    model = mlp()
    model.compile(loss="sparse_categorical_crossentropy", metrics=[metric() if callable(metric) else metric])
    backend = backend_for(model, sample=x)
    assert backend.metric_name == name
    stats = backend.evaluate(x, y, batch_size=64)  # several batches, summed
    logs = model.evaluate(x, y, batch_size=200, verbose=0, return_dict=True)
    assert stats.n == 200
    assert stats.loss == pytest.approx(logs["loss"], rel=1e-5)
    assert stats.metric == pytest.approx(logs[name], rel=1e-5)


def test_dropout_seeds_are_rng_state_and_reseed_changes_them():
    x, y = data()
    backend = backend_for(mlp(dropout=0.5), sample=x)
    saved = backend.rng_state()
    assert saved and all(a.dtype.kind in "iu" for a in saved.values())
    backend.compute_gradients(x[:16], y[:16])
    first = backend.grads.copy()
    backend.compute_gradients(x[:16], y[:16])
    assert not np.allclose(backend.grads, first)  # a new dropout mask each step
    backend.set_rng_state(saved)
    backend.compute_gradients(x[:16], y[:16])
    np.testing.assert_array_equal(backend.grads, first)  # the same mask again
    backend.reseed(5)
    backend.compute_gradients(x[:16], y[:16])
    assert not np.allclose(backend.grads, first)


def test_bucket_hooks_fire_once_each_with_the_final_gradient():
    x, y = data()
    backend = backend_for(mlp(), sample=x)
    seen: list[tuple[int, np.ndarray]] = []

    def on_ready(i: int) -> None:
        start, stop = buckets[i]
        seen.append((i, backend.grads[start:stop].copy()))

    buckets = backend.bucket_hooks(20, on_ready)
    assert len(buckets) >= 2
    covered = sorted(buckets)
    assert covered[0][0] == 0 and covered[-1][1] == backend.num_params
    assert all(a[1] == b[0] for a, b in pairwise(covered))
    backend.compute_gradients(x[:16], y[:16])
    assert [i for i, _ in seen] == list(range(len(buckets)))
    for i, grads in seen:
        np.testing.assert_array_equal(grads, backend.grads[buckets[i][0] : buckets[i][1]])
    with pytest.raises(RuntimeError, match="already installed"):
        backend.bucket_hooks(20, on_ready)


# ----------------------------------------------------------------------- optimisers
def test_optimizers_by_name_with_torch_spelling_of_lr():
    x, y = data()
    backend = backend_for(mlp(), sample=x)
    for spec in ("sgd(lr=0.1, momentum=0.9)", "rmsprop", "adam(learning_rate=1e-3, beta_1=0.8)", "lion"):
        backend.check_optimizer(parse_spec(spec))
    with pytest.raises(SpecError, match=r"unknown Keras optimizer 'adamm' \(did you mean 'adam'\?\)"):
        backend.check_optimizer(parse_spec("adamm"))
    with pytest.raises(SpecError, match=r"optimizer sgd\(momentun=0.9\): .*momentun"):
        backend.check_optimizer(parse_spec("sgd(momentun=0.9)"))


def test_keras_optimizer_values_are_checked_as_torch_checks_them():
    x, _ = data()
    backend = backend_for(mlp(), sample=x)
    before = backend.params.copy()
    for spec, message in [
        ("sgd(lr=-1.0)", "optimizer sgd(lr=-1.0): a learning rate below 0 climbs the loss instead of descending it"),
        ("adam(learning_rate=-0.5)", "optimizer adam(learning_rate=-0.5): a learning rate below 0 climbs the loss"),
        ("sgd(lr='fast')", "optimizer sgd(lr='fast'): lr must be a number >= 0, got 'fast'"),
        ("adam(beta_1=1.5)", "optimizer adam(beta_1=1.5): beta_1 must be in [0, 1), got 1.5"),
        ("rmsprop(rho=2)", "optimizer rmsprop(rho=2): rho must be in [0, 1], got 2"),
        ("sgd(momentum=1.5)", "optimizer sgd(momentum=1.5): `momentum` must be a float between [0, 1]"),
    ]:
        with pytest.raises(SpecError) as err:
            backend.check_optimizer(parse_spec(spec))
        assert str(err.value).startswith(message)
    backend.check_optimizer(parse_spec("sgd(lr=1)"))  # an int learning rate is a float to Keras too
    np.testing.assert_array_equal(backend.params, before)


def test_a_torch_optimizer_for_a_keras_model_is_one_clear_message():
    backend = backend_for(mlp(), sample=data()[0])
    with pytest.raises(SpecError) as info:
        backend.make_optimizer(parse_spec("rprop(lr=0.01)"))
    assert str(info.value).startswith(
        "'rprop' is a PyTorch optimizer (torch.optim), but the model is a "
        "Keras model: choose one of keras.optimizers: adadelta, "
    )


def test_the_optimizer_hints_match_the_frameworks():
    assert KERAS.optimizer_hints == set(KERAS.optimizer_names())
    assert TORCH.optimizer_hints == set(TORCH.optimizer_names())


def test_optimizer_state_round_trip_resumes_exactly():
    x, y = data()
    params = np.random.default_rng(0).normal(size=50).astype(np.float32)
    backend = backend_for(mlp(), sample=x)
    first = backend.make_optimizer(parse_spec("adam(lr=0.01)"), params=params)
    for k in range(3):
        first.step(np.full(50, 0.1 * (k + 1), np.float32))
    state, saved = first.state_arrays(), params.copy()
    first.step(np.ones(50, np.float32))
    restored = saved.copy()
    second = backend.make_optimizer(parse_spec("adam(lr=0.01)"), params=restored)
    second.load_state_arrays(state)
    second.step(np.ones(50, np.float32))
    np.testing.assert_array_equal(restored, params)


# ------------------------------------------------------------------------- models
def test_a_model_without_an_input_is_built_from_the_sample():
    x, y = data()
    backend = backend_for(mlp(inputs=False), sample=x)
    assert backend.evaluate(x, y).n == len(y)
    with pytest.raises(ModelError, match="has no weights yet"):
        backend_for(mlp(inputs=False))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: keras.layers.Dense(3), "a Keras Dense layer, not a model"),
        (lambda: mlp(compile=False), "the Keras model has no loss: compile it"),
    ],
)
def test_models_that_cannot_be_trained(make, message):
    with pytest.raises(ModelError, match=message):
        backend_for(make(), sample=data()[0])


def test_a_gan_of_two_frameworks_cannot_be_trained():
    with pytest.raises(ModelError, match="the generator is a Keras model and the discriminator a PyTorch model"):
        gan_backend(GanModel(mlp(), __import__("torch").nn.Linear(3, 1), latent_dim=8), sample=data()[0])


def test_an_uncompiled_model_takes_the_loss_of_the_model_file():
    x, y = data()
    backend = backend_for(mlp(compile=False), loss="sparse_categorical_crossentropy", sample=x)
    assert backend.metric_name == "acc" and np.isfinite(backend.compute_gradients(x, y).loss)


def test_final_weights_load_with_set_weights():
    x, y = data()
    backend = backend_for(mlp(batchnorm=True), sample=x)
    opt = backend.make_optimizer(parse_spec("sgd(lr=0.1)"))
    backend.compute_gradients(x, y)
    opt.step(backend.grads)
    weights = backend.named_arrays()
    fresh = mlp(seed=9, batchnorm=True)
    fresh.set_weights([weights[k] for k in sorted(weights)])
    expected = backend.evaluate(x, y)
    logs = fresh.evaluate(x, y, verbose=0, return_dict=True)
    assert logs["loss"] == pytest.approx(expected.loss, rel=1e-5)


# ---------------------------------------------------------------------------- GAN
def test_keras_gan_backend_alternates_and_lays_out_generator_first():
    keras.utils.set_random_seed(0)
    generator = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(8),
        ]
    )
    discriminator = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1, activation="sigmoid")]
    )
    x = (np.random.default_rng(0).normal(size=(64, 8)) + 1).astype(np.float32)
    backend = gan_backend(GanModel(generator, discriminator, latent_dim=4, d_steps=2), sample=x)
    assert isinstance(backend, KerasGanBackend)
    n_g = sum(int(np.prod(v.shape)) for v in generator.trainable_variables)
    assert backend.g_part == slice(0, n_g)
    opt = backend.make_optimizer(parse_spec("rmsprop(lr=0.01)"))
    before = backend.params.copy()
    stats = backend.compute_gradients(x[:16], None)
    g, d = backend.g_part, backend.d_part
    assert not np.array_equal(backend.params[d], before[d]) and np.array_equal(backend.params[g], before[g])
    assert np.abs(backend.grads[g]).max() > 0 and not backend.grads[d].any()
    opt.step(backend.grads)
    assert not np.array_equal(backend.params[g], before[g])
    assert np.abs(backend.state).max() > 0  # the generator's BatchNorm statistics moved
    extras = backend.train_extras()
    assert set(extras) == {"d_loss", "g_loss", "d_real", "d_fake"} and 0 <= extras["d_real"] <= 1
    assert np.isfinite(stats.metric) and np.isfinite(backend.evaluate(x, None).metric)
    assert backend.generate(np.zeros((3, 4), np.float32)).shape == (3, 8)
    names = backend.named_arrays()
    generator.set_weights([names[k] for k in sorted(names) if k.startswith("generator/")])
    np.testing.assert_allclose(
        np.asarray(generator(np.ones((2, 4), np.float32), training=False)),
        backend.generate(np.ones((2, 4), np.float32)),
        rtol=1e-5,
        atol=1e-6,
    )


# ---------------------------------------------------------------------- frameworks
def test_a_torch_run_never_imports_tensorflow():
    code = (
        "import sys\n"
        "from nbdist.backends import backend_for, configure_frameworks\n"
        "from nbdist.train.definition import load_model_file\n"
        "import nbdist.roles.runner, nbdist.roles.master, nbdist.roles.worker, nbdist.roles.allreduce, nbdist.gan\n"
        "configure_frameworks(1, 0)\n"
        "d = load_model_file('examples/digits_mlp.py')\n"
        "configure_frameworks(1, 0)\n"
        "backend_for(d.make_model()).evaluate(*d.make_data().train_batch([0, 1]))\n"
        "print(sorted(m for m in ('tensorflow', 'keras') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_learning_rate_set_between_compiled_steps_and_schedules_by_name():
    """Warm-up and schedules (train/lr.py) set the lr of a compiled optimiser step between
    steps; Keras schedules are named like torch's, their steps being epochs."""
    x, _ = data()
    backend = backend_for(mlp(), sample=x)
    assert backend.check_optimizer(parse_spec("sgd(learning_rate=0.3)")) == pytest.approx(0.3)
    params = backend.params.copy()
    opt = backend.make_optimizer(parse_spec("sgd(learning_rate=0.3)"), params)
    moved = []
    for lr in (0.3, 0.05):
        opt.set_learning_rate(lr)
        before = params.copy()
        opt.step(np.ones_like(params))
        moved.append(float(before[0] - params[0]))
    assert moved == pytest.approx([0.3, 0.05], rel=1e-5)
    assert opt.learning_rate == pytest.approx(0.05)
    schedule = backend.checked_lr_schedule(parse_spec("ExponentialDecay(decay_steps=1, decay_rate=0.5)"), 0.2)
    assert [schedule.lr_at(e) for e in range(3)] == pytest.approx([0.2, 0.1, 0.05])
    with pytest.raises(
        SpecError,
        match=r"unknown Keras learning-rate schedule .* 'cosine' \(did you mean "
        r"'cosinedecay'\?\); choose one of: cosinedecay, cosinedecayrestarts",
    ):
        backend.checked_lr_schedule(parse_spec("cosine"), 0.2)
    with pytest.raises(SpecError, match="'cosinedecay' takes no parameter 'steps'; it takes: initial_learning_rate"):
        backend.checked_lr_schedule(parse_spec("cosinedecay(steps=3)"), 0.2)


# ----------------------------------------------------------------------- precision
@pytest.fixture
def restores_the_dtype_policy():
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_digits_learns_in_each_precision(precision, tmp_path):
    from mpi4py import MPI

    import nbdist

    result = nbdist.train(
        os.path.join(ROOT, "examples", "digits_keras.py"),
        comm=MPI.COMM_SELF,
        topology="allreduce",
        epochs=3,
        precision=precision,
        runs_dir=str(tmp_path),
        store="off",
        quiet=True,
    )
    assert result.history[-1]["val_acc"] >= 0.85
    # The policy was set while build_model() ran (the backend checks the model's), then put back.
    assert keras.mixed_precision.global_policy().name == "float32"


def test_fp16_skips_an_overflowed_step_and_the_model_must_be_made_under_the_policy(restores_the_dtype_policy):
    with pytest.raises(
        ModelError,
        match="--precision fp16: the Keras model was made with the dtype policy 'float32', not 'mixed_float16'",
    ):
        KerasBackend(mlp(), precision="fp16")
    keras.mixed_precision.set_global_policy("mixed_float16")
    mixed = mlp()
    with pytest.raises(ModelError, match="'mixed_float16', not 'float32'.*give --precision fp16 for this model"):
        KerasBackend(mixed)
    backend = KerasBackend(mixed, precision="fp16")
    opt = backend.make_optimizer(parse_spec("sgd(lr=0.1)"))
    x, y = data()
    backend.loss_scale.scale = 2.0**40  # beyond fp16's 65504 in the backward pass
    before = backend.params.copy()
    backend.compute_gradients(x, y)
    opt.step(backend.grads)
    assert opt.skipped == 1 and not np.isfinite(backend.grads).all()
    np.testing.assert_array_equal(backend.params, before)
    while not np.isfinite(backend.grads).all():
        backend.compute_gradients(x, y)
        opt.step(backend.grads)
    assert backend.loss_scale.scale < 2.0**40 and not np.array_equal(backend.params, before)
    # The scale is checkpointed with the RNG state (as PyTorch's; its exact resume: test_backend_torch).
    resumed = KerasBackend(mixed, precision="fp16")
    resumed.set_rng_state(backend.rng_state())
    assert resumed.loss_scale.scale == backend.loss_scale.scale


# ----------------------------------------------------------------- --sync-batchnorm
def test_sync_batchnorm_with_a_keras_model_is_one_clear_error(tmp_path):
    from mpi4py import MPI

    import nbdist
    from nbdist.errors import UserError

    with pytest.raises(
        UserError,
        match=r"^--sync-batchnorm is for PyTorch models: a Keras model trains as one traced "
        r"TensorFlow function .* drop --sync-batchnorm .* or use a PyTorch model$",
    ):
        nbdist.train(
            os.path.join(ROOT, "examples", "digits_keras.py"),
            comm=MPI.COMM_SELF,
            topology="allreduce",
            sync_batchnorm=True,
            epochs=1,
            runs_dir=str(tmp_path),
            store="off",
            quiet=True,
        )
    assert not any(tmp_path.iterdir())  # refused at set-up: no run directory


# ----------------------------------------------------------------- --worker-parallel pipeline
def test_keras_pipeline_stages_are_one_error():
    """--worker-parallel pipeline is PyTorch only: Keras stages are one clear error where
    the run builds its model (on every rank, before training)."""
    from nbdist.backends.stages import stage_model
    from nbdist.train.definition import definition_from_namespace

    def build_stages():
        return [keras.Sequential([keras.layers.Dense(16)]), keras.Sequential([keras.layers.Dense(10)])]

    definition = definition_from_namespace({"build_stages": build_stages}, "model file k.py")
    with pytest.raises(
        ModelError,
        match=r"pipeline is PyTorch only: stage 0 of build_stages\(\) is a Sequential, "
        r"not a torch.nn.Module",
    ):
        stage_model(definition.make_stages(2))
