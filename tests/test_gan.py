"""GANs without MPI (PyTorch, so TensorFlow stays out of this process): the two-sample
statistic, the GAN backend's alternation and layout, how a GAN is defined, and which
options can train one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from nbdist.backends.base import ModelError
from nbdist.errors import OptionsError
from nbdist.gan import GanModel, GaussianMMD, gan_backend, median_distance
from nbdist.gan.torch_backend import TorchGanBackend
from nbdist.options import TrainOptions
from nbdist.specs import parse_spec
from nbdist.train.definition import definition_from_namespace
from nbdist.train.rules import check_gan

LATENT, FEATURES = 4, 6


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Tiny models: with two intra-op threads spinning against each other on a busy
    # two-core box, these steps ran 30 times slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_gan(d_steps: int = 1, sigmoid: bool = False, seed: int = 0) -> GanModel:
    torch.manual_seed(seed)
    generator = nn.Sequential(nn.Linear(LATENT, 8), nn.ReLU(), nn.Linear(8, FEATURES))
    layers = [nn.Linear(FEATURES, 8), nn.ReLU(), nn.Linear(8, 1)] + ([nn.Sigmoid()] if sigmoid else [])
    return GanModel(generator, nn.Sequential(*layers), LATENT, d_steps)


def real_batch(n: int = 16, seed: int = 1) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=(n, FEATURES)) + 2.0).astype(np.float32)


def ready(gan: GanModel, spec: str = "rmsprop(lr=0.01)"):
    backend = gan_backend(gan, sample=real_batch(64, seed=9))
    return backend, backend.make_optimizer(parse_spec(spec))


# ----------------------------------------------------------------------- statistic
def test_mmd_is_near_zero_for_one_distribution_and_grows_with_a_shift():
    rng = np.random.default_rng(0)
    mmd = GaussianMMD.for_data(rng.normal(size=(200, 5)))
    same = [mmd(rng.normal(size=(100, 5)), rng.normal(size=(100, 5))) for _ in range(20)]
    # Unbiased: no 1/n offset, the mean over repeats is about zero.
    assert abs(np.mean(same)) < 0.005
    shifted = [mmd(rng.normal(size=(100, 5)), rng.normal(size=(100, 5)) + shift) for shift in (0.5, 1.0, 2.0)]
    assert min(shifted) > 10 * np.std(same)
    assert shifted == sorted(shifted)
    assert np.isnan(mmd(rng.normal(size=(1, 5)), rng.normal(size=(5, 5))))


def test_median_distance_of_known_points():
    points = np.array([[0.0, 0.0], [3.0, 4.0], [6.0, 8.0]])  # distances 5, 5, 10
    assert median_distance(points) == pytest.approx(5.0)


# ------------------------------------------------------------------------- backend
def test_generator_first_in_one_flat_buffer():
    gan = make_gan()
    backend = gan_backend(gan)
    assert isinstance(backend, TorchGanBackend) and backend.metric_name == "mmd"
    n_g = sum(p.numel() for p in gan.generator.parameters())
    assert backend.g_part == slice(0, n_g) and backend.d_part == slice(n_g, backend.num_params)
    # The generator's parameters are views into the first part of the buffer.
    backend.params[backend.g_part] = 0.5
    assert all(bool((p == 0.5).all()) for p in gan.generator.parameters())
    assert not any(bool((p == 0.5).all()) for p in gan.discriminator.parameters())
    names = backend.named_arrays()
    assert {k.split(".")[0] for k in names} == {"generator", "discriminator"}


@pytest.mark.parametrize("d_steps", [1, 3])
def test_one_step_trains_the_discriminator_inside_and_leaves_the_generators_gradient(d_steps):
    backend, opt = ready(make_gan(d_steps))
    before = backend.params.copy()
    stats = backend.compute_gradients(real_batch(), None)
    g, d = backend.g_part, backend.d_part
    # The discriminator stepped (d_steps times) inside; the generator waits for opt.step.
    assert not np.array_equal(backend.params[d], before[d])
    assert np.array_equal(backend.params[g], before[g])
    assert np.abs(backend.grads[g]).max() > 0 and not backend.grads[d].any()
    opt.step(backend.grads)
    assert not np.array_equal(backend.params[g], before[g])
    assert stats.n == 16 and np.isfinite(stats.loss) and np.isfinite(stats.metric)
    extras = backend.train_extras()
    assert set(extras) == {"d_loss", "g_loss", "d_real", "d_fake"}
    assert 0 <= extras["d_real"] <= 1 and 0 <= extras["d_fake"] <= 1
    assert backend.train_extras() == {}  # means since the last call


def test_more_discriminator_steps_move_it_further():
    moves = []
    for d_steps in (1, 4):
        backend, _ = ready(make_gan(d_steps), "sgd(lr=0.05)")
        before = backend.params.copy()
        backend.compute_gradients(real_batch(), None)
        moves.append(np.abs(backend.params[backend.d_part] - before[backend.d_part]).sum())
    assert moves[1] > 2 * moves[0]


def test_training_brings_samples_closer_to_the_data():
    backend, opt = ready(make_gan())
    val = real_batch(200, seed=5)
    untrained = backend.evaluate(val, np.zeros(200)).metric
    for step in range(150):
        backend.compute_gradients(real_batch(32, seed=step + 10), None)
        opt.step(backend.grads)
    trained = backend.evaluate(val, np.zeros(200)).metric
    assert trained < untrained / 3, (untrained, trained)
    # Validation uses fixed noise: the same weights give the same value.
    assert backend.evaluate(val, np.zeros(200)).metric == trained


@pytest.mark.parametrize("sigmoid", [False, True])
def test_discriminator_outputs_are_logits_or_probabilities_when_it_ends_in_a_sigmoid(sigmoid):
    gan = make_gan(sigmoid=sigmoid)
    backend, _ = ready(gan)
    real = real_batch()
    with torch.no_grad():
        output = gan.discriminator(torch.from_numpy(real))
    expected = float((output if sigmoid else torch.sigmoid(output)).mean())
    backend.compute_gradients(real, None)  # D(x) is recorded before the discriminator's step
    assert backend.train_extras()["d_real"] == pytest.approx(expected, rel=1e-5)


def test_noise_and_optimisers_checkpoint_and_resume_exactly():
    first, opt_first = ready(make_gan())
    first.reseed(123)
    for _ in range(3):
        first.compute_gradients(real_batch(), None)
        opt_first.step(first.grads)
    saved = (first.params.copy(), first.rng_state(), opt_first.state_arrays())
    assert {k[:2] for k in saved[2]} == {"g.", "d."}
    first.compute_gradients(real_batch(), None)
    opt_first.step(first.grads)

    second, opt_second = ready(make_gan(seed=7))
    second.params[:] = saved[0]
    second.set_rng_state(saved[1])
    opt_second.load_state_arrays(saved[2])
    torch.set_rng_state(torch.from_numpy(saved[1]["torch_cpu"]))
    second.compute_gradients(real_batch(), None)
    opt_second.step(second.grads)
    np.testing.assert_array_equal(second.params, first.params)


def test_misuse_of_the_gan_backend_is_named():
    backend = gan_backend(make_gan())
    with pytest.raises(RuntimeError, match="make_optimizer"):
        backend.compute_gradients(real_batch(), None)
    with pytest.raises(ModelError, match="master takes none"):
        backend.make_optimizer(parse_spec("sgd(lr=0.1)"), params=backend.params.copy())
    with pytest.raises(ModelError, match="latent_dim >= 1"):
        gan_backend(GanModel(nn.Linear(1, 2), nn.Linear(2, 1), latent_dim=0))
    with pytest.raises(ModelError, match="must be a torch.nn.Module|nbdist trains"):
        gan_backend(GanModel(nn.Linear(1, 2), object(), latent_dim=1))


# ---------------------------------------------------------------------- definition
def test_a_gan_is_defined_by_generator_discriminator_and_latent_dim():
    gan = make_gan()
    ns = {"generator": gan.generator, "build_discriminator": lambda: gan.discriminator, "latent_dim": 4}
    definition = definition_from_namespace(ns, "the cell")
    built = definition.make_gan(d_steps=2)
    assert (built.generator, built.discriminator, built.latent_dim, built.d_steps) == (
        gan.generator,
        gan.discriminator,
        4,
        2,
    )
    with pytest.raises(ModelError, match="defines a generator and a discriminator but no model: train them with --gan"):
        definition.make_model()
    with pytest.raises(ModelError, match="defines no latent_dim"):
        definition_from_namespace({**ns, "latent_dim": None}, "the cell").make_gan(1)
    with pytest.raises(ModelError, match="defines no discriminator"):
        definition_from_namespace({"generator": gan.generator, "latent_dim": 4}, "f.py").make_gan(1)
    # build_model() may return the GanModel itself (the Python API).
    ready_made = definition_from_namespace({"build_model": lambda: make_gan()}, "api").make_gan(3)
    assert isinstance(ready_made, GanModel) and ready_made.d_steps == 3


@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(topology="allreduce"), "--gan trains on the master-worker topology"),
        (dict(procs_per_worker=2), "drop --procs-per-worker"),
        (dict(algorithm="downpour"), "downpour sends gradients"),
        (dict(algorithm="gem"), "gem sends gradients"),
    ],
)
def test_options_that_cannot_train_a_gan_are_one_error(changes, message):
    with pytest.raises(OptionsError, match=message):
        check_gan(TrainOptions(gan=True, **changes))


def test_gan_defaults_are_easgd_with_rmsprop_watching_val_mmd_and_adag_is_allowed():
    options = check_gan(TrainOptions(gan=True))
    assert (options.algorithm, options.worker_optimizer, options.monitor) == ("easgd", "rmsprop(lr=0.001)", "val_mmd")
    options = check_gan(
        TrainOptions(gan=True, algorithm="adag", worker_optimizer="adam(lr=1e-4)", monitor="val_d_fake")
    )
    assert (options.algorithm, options.worker_optimizer, options.monitor) == ("adag", "adam(lr=1e-4)", "val_d_fake")
    assert check_gan(TrainOptions()) == TrainOptions()
    with pytest.raises(OptionsError, match="--d-steps applies to GANs: add --gan"):
        check_gan(TrainOptions(d_steps=2))
