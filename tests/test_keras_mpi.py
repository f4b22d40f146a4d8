"""Keras models and GANs on real MPI ranks, all from ONE 4-rank job (keras_job.py):

- equivalences: Keras allreduce over 2 ranks == plain Keras on the concatenated batch,
  Keras Downpour with one worker == plain Keras SGD (to 1e-5);
- a Keras model learns digits (>= 0.90 validation accuracy) with every algorithm;
- a Keras GAN trained with EASGD on 3 workers draws digits measurably closer to the data
  than its untrained generator; its metrics are in the records (the PyTorch GAN: the same
  check ends notebooks/03_gan.ipynb, which test_notebooks.py executes);
- checkpoints and exact resume, early stopping, for a Keras model and a Keras GAN;
- mixed or unsupported input (a torch optimiser for a Keras model, a GAN with a
  gradient-pushing rule) is one clear error.

TensorFlow's start-up costs seconds per rank, a digits run a fraction of that: one job
trains everything (the resumes in later runs of the same job), each test reads its part.
The single-process Keras references are computed inside the job too, so this process
never imports TensorFlow, and no run uses PyTorch, so the job never imports it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from batched_runs import cut_at_markers
from conftest import BatchedRuns
from safetensors.numpy import load_file

from nbdist.metrics import read_log
from nbdist.train.stopping import VALIDATED_WITH

pytestmark = pytest.mark.mpi

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "tests" / "mpi_scripts"
KERAS_MLP = str(ROOT / "examples" / "digits_keras.py")
GAN_KERAS = str(ROOT / "examples" / "digits_gan_keras.py")
GAN_TORCH = str(ROOT / "examples" / "digits_gan.py")
TOL = 1e-5
ACCURACY, EPOCHS = 0.90, 8
GAN_EPOCHS = 6
DOWNPOUR = {"downpour-plain": "sgd(lr=0.1)", "downpour-momentum": "sgd(lr=0.1, momentum=0.9)"}

ACCURACY_RUNS = {
    "downpour": ["--algorithm", "downpour"],
    "easgd": ["--algorithm", "easgd"],
    "gem": ["--algorithm", "gem(lr=0.05, momentum=0.9, kappa=1.0)"],
    "adag": ["--algorithm", "adag"],
    "allreduce": ["--topology", "allreduce"],
}
GANS = {"gan-keras": GAN_KERAS}
# The GAN runs synchronously (EASGD all the same): exactly reproducible, it is also the
# straight run A of a resume test.
GAN_OPTIONS = {"gan-keras": ["--synchronous"]}
# Resumed runs: B trains the first half of run A's epochs and a later run of the job
# resumes it to the end, in new models and optimisers; A is the accuracy or GAN run of
# that name, checkpointing every epoch.
RESUMES = ("keras-allreduce", "gan-keras")
ERRORS = {
    "keras-torch-optimizer": ["--model", KERAS_MLP, "--algorithm", "easgd", "--worker-optimizer", "rprop(lr=0.01)"],
    "gan-downpour": ["--gan", "--model", GAN_TORCH, "--algorithm", "downpour"],
}


def _epochs(name: str) -> int:
    return GAN_EPOCHS if name.startswith("gan") else EPOCHS


def _runs(runs_dir: Path) -> tuple[list[str], list[list[str]]]:
    runs: dict[str, list[str]] = {
        f"keras-{name}": ["--model", KERAS_MLP, *argv] for name, argv in ACCURACY_RUNS.items()
    }
    runs.update(
        {name: ["--gan", "--model", model, "--workers", "3", *GAN_OPTIONS[name]] for name, model in GANS.items()}
    )
    for name in RESUMES:
        runs[f"{name}-B"] = [*runs[name], "--epochs", str(_epochs(name) // 2)]
        runs[name] += ["--checkpoint-every", "1"]
    for name in list(runs):
        if "--epochs" not in runs[name]:
            runs[name] += ["--epochs", str(_epochs(name))]
    runs["keras-early-stopping"] = [
        "--model",
        KERAS_MLP,
        "--epochs",
        "30",
        "--topology",
        "allreduce",
        "--worker-optimizer",
        "sgd(lr=1e-6)",
        "--early-stopping",
        "1",
        "--min-delta",
        "0.001",
    ]
    # val_mmd cannot improve by 1.0 (it is below 1): stops after the second validation.
    runs["gan-early-stopping"] = [
        "--gan",
        "--model",
        GAN_KERAS,
        "--epochs",
        "30",
        "--early-stopping",
        "1",
        "--monitor",
        "val_mmd",
        "--min-delta",
        "1.0",
    ]
    runs.update(ERRORS)
    names = list(runs)
    argvs = [[*runs[name], "--runs-dir", str(runs_dir), "--run-name", name, "--quiet"] for name in names]
    for name in RESUMES:
        names.append(f"{name}-B-resumed")
        argvs.append(["--resume", str(runs_dir / f"{name}-B"), "--epochs", str(_epochs(name)), "--no-quiet"])
    return names, argvs


class Job(BatchedRuns):
    """The job's runs, with its output cut per run and its other files."""

    def __init__(self, done, out: Path, names: list[str]):
        # A run that never ended has no code: BatchedRuns.run names it.
        codes = dict(zip(names, _codes(done.stdout, len(names)), strict=False))
        super().__init__(done.output, done.returncode, out / "runs", codes)
        self.out, self.stdout = out, done.stdout
        self.stderr = dict(zip(names, cut_at_markers(done.stderr, len(names))[0], strict=True))


def _codes(text: str, count: int) -> list[int]:
    return [int(rc) for _, rc in re.findall(r"^nbdist-test: run (\d+) rc=(-?\d+)$", text, re.MULTILINE)][:count]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    from conftest import run_mpi

    out = tmp_path_factory.mktemp("keras")
    names, argvs = _runs(out / "runs")
    spec = {
        "downpour": DOWNPOUR,
        "runs": argvs,
        "gans": {str(out / "runs" / name): model for name, model in GANS.items()},
    }
    (out / "spec.json").write_text(json.dumps(spec))
    done = run_mpi(4, [str(SCRIPTS / "keras_job.py"), str(out), str(out / "spec.json")], timeout=420)
    assert done.returncode == 0, done.output[-8000:]
    return Job(done, out, names)


def assert_weights_close(actual: dict, expected: dict, tol: float = TOL) -> None:
    assert set(actual) == set(expected), (sorted(actual), sorted(expected))
    for name in expected:
        diff = float(np.max(np.abs(actual[name] - expected[name])))
        assert diff <= tol, f"{name}: max abs difference {diff:.3g} > {tol:g}"


# ----------------------------------------------------------------------- equivalences
@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["equal", "unequal"])
def test_keras_allreduce_equals_one_process_on_the_concatenated_batch(job, layout):
    got = load_file(str(job.out / f"allreduce-{layout}.safetensors"))
    expected = load_file(str(job.out / f"allreduce-{layout}-reference.safetensors"))
    assert_weights_close(got, expected)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(DOWNPOUR))
def test_keras_downpour_one_worker_is_plain_keras_sgd(job, name):
    got = load_file(str(job.out / "runs" / name / "final" / "model.safetensors"))
    expected = load_file(str(job.out / f"{name}-reference.safetensors"))
    assert_weights_close(got, expected)
    summary = json.loads((job.out / "runs" / name / "summary.json").read_text())
    assert summary["epochs_run"] == 3
    # Training moved the weights far more than the tolerance: the comparison means something.
    assert np.abs(got["0000/net/hidden1/kernel"]).max() > 0.1


# ------------------------------------------------------------------------- accuracy
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(ACCURACY_RUNS))
def test_keras_model_learns_digits_with_every_algorithm(job, name):
    summary = job.summary(f"keras-{name}")
    assert summary["stop_reason"] == f"completed {EPOCHS} epochs"
    final = summary["final"]["val_acc"]
    assert final >= ACCURACY, f"{name}: val_acc {final:.4f} after {EPOCHS} epochs: {summary['history']}"
    # The final weights are the Keras model's variables by path.
    weights = load_file(str(job.run(f"keras-{name}") / "final" / "model.safetensors"))
    assert sorted(k.rsplit("/", 1)[1] for k in weights) == ["bias", "bias", "kernel", "kernel"], sorted(weights)


# ------------------------------------------------------------------------------- GANs
def _mmd(x: np.ndarray, y: np.ndarray, width: float) -> float:
    """The test's own fixed two-sample statistic: biased MMD^2, one Gaussian kernel."""

    def k(a, b):
        d = (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2 * a @ b.T
        return np.exp(-np.maximum(d, 0) / (2 * width**2))

    return float(k(x, x).mean() + k(y, y).mean() - 2 * k(x, y).mean())


def _digits_in_tanh_range() -> np.ndarray:
    from sklearn.datasets import load_digits

    return (load_digits().data / 8.0 - 1.0).astype(np.float64)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(GANS))
def test_gan_trained_with_easgd_on_three_workers_draws_closer_to_the_data(job, name):
    summary = job.summary(name)
    assert summary["stop_reason"] == f"completed {GAN_EPOCHS} epochs"
    layout = json.loads((job.run(name) / "layout.json").read_text())["options"]
    assert layout["workers"] == 3
    options = json.loads((job.run(name) / "options.json").read_text())
    assert (options["algorithm"], options["worker_optimizer"]) == ("easgd", "rmsprop(lr=0.001)")

    real = _digits_in_tanh_range()
    samples = np.load(job.out / f"{name}-samples.npz")
    before, after = samples["before"].reshape(500, -1), samples["after"].reshape(500, -1)
    width = 4.0  # about the median distance between two digits in [-1, 1]^64
    untrained, trained = _mmd(real[:500], before, width), _mmd(real[:500], after, width)
    # The margin: a trained generator's samples at most a third as far from the data.
    assert trained < untrained / 3, f"{name}: MMD^2 untrained {untrained:.4f}, trained {trained:.4f}"
    # And nbdist's own validation statistic fell over the epochs.
    history = summary["history"]
    assert history[-1]["val_mmd"] < history[0]["val_mmd"], history


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(GANS))
def test_gan_metrics_are_in_the_records(job, name):
    run = job.run(name)
    workers = [r for r in read_log(run, "train") if r["role"] == "worker"]
    assert {r["rank"] for r in workers} == {1, 2, 3}
    for key in ("d_loss", "g_loss", "d_real", "d_fake"):
        values = [r["values"][key] for r in workers if key in r["values"]]
        assert values and all(np.isfinite(values)), key
        if key in ("d_real", "d_fake"):  # mean discriminator outputs, probabilities
            assert all(0.0 <= v <= 1.0 for v in values), (key, values)
    epochs = [r["values"] for r in read_log(run, "epoch")]
    assert [e["epoch"] for e in epochs] == list(range(1, GAN_EPOCHS + 1))
    assert all({"train_loss", "train_mmd", "val_loss", "val_mmd"} <= set(e) for e in epochs)
    weights = load_file(str(run / "final" / "model.safetensors"))
    parts = {re.split(r"[./]", k)[0] for k in weights}
    assert parts == {"generator", "discriminator"}, sorted(weights)


# ------------------------------------------------------------- resume, early stopping
def _weight_id(key: str) -> tuple[str, ...]:
    parts = key.split("/")
    return (*parts[:-1][: 2 if parts[0] in ("generator", "discriminator") else 1], parts[-1])


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(RESUMES))
def test_keras_and_gan_runs_resume_exactly(job, name):
    a, b = job.run(name), job.run(f"{name}-B")
    job.run(f"{name}-B-resumed")
    epochs = _epochs(name)
    assert re.search(
        rf"resumed from \S*/{name}-B/checkpoints/epoch-{epochs // 2:04d} at epoch {epochs // 2 + 1}\b", job.stdout
    ), job.stdout
    weights_a = load_file(str(a / "final" / "model.safetensors"))
    weights_b = load_file(str(b / "final" / "model.safetensors"))
    # Keras paths hold per-process layer counters (dense_7): the keys' index and
    # variable name say which weight it is.
    assert [_weight_id(k) for k in sorted(weights_a)] == [_weight_id(k) for k in sorted(weights_b)]
    for key_a, key_b in zip(sorted(weights_a), sorted(weights_b), strict=True):
        diff = float(np.max(np.abs(weights_a[key_a].astype(np.float64) - weights_b[key_b])))
        assert diff <= 1e-6, f"{key_a}: resumed run differs from the straight run by {diff:g}"
    history_a = json.loads((a / "summary.json").read_text())["history"]
    history_b = json.loads((b / "summary.json").read_text())["history"]
    assert [h["epoch"] for h in history_b] == list(range(1, epochs + 1))
    np.testing.assert_allclose([h["val_loss"] for h in history_b], [h["val_loss"] for h in history_a], rtol=1e-6)
    labels = sorted(p.name for p in (a / "checkpoints").iterdir() if p.is_dir())
    assert labels == [f"epoch-{e:04d}" for e in range(epochs - 2, epochs + 1)]  # --keep-checkpoints 3
    if name.startswith("gan"):
        # The worker checkpoints the optimiser of each model, and the noise generator.
        arrays = load_file(str(a / "checkpoints" / f"epoch-{epochs:04d}" / "rank-00001.safetensors"))
        assert any(k.startswith("opt/g.") for k in arrays) and any(k.startswith("opt/d.") for k in arrays)
        assert "rng/gan_noise" in arrays


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["keras-early-stopping", "gan-early-stopping"])
def test_early_stopping(job, name):
    summary = job.summary(name)
    assert "early stopping" in summary["stop_reason"], summary["stop_reason"]
    history = summary["history"]
    if name.startswith("keras"):  # allreduce decides at the epoch's end
        assert summary["epochs_run"] == 2, history
    else:
        # Patience counts validations: epochs that ended together on one centre share one
        # (VALIDATED_WITH), counted once. The second counted one decides; the master/worker
        # run is asynchronous, and its workers go on while the master validates, so the
        # validation already started when the stop began may still come in after it.
        counted = [h["epoch"] for h in history if "val_mmd" in h and VALIDATED_WITH not in h]
        assert len(counted) >= 2 and len([e for e in counted if e > counted[1]]) <= 1, history
        assert summary["epochs_run"] == counted[-1], history
    # The decision is checkpointed: at the epoch's end (allreduce), or as the stop the
    # master then asks of its workers (master-worker).
    latest = json.loads((job.run(name) / "checkpoints" / "LATEST.json").read_text())["label"]
    assert latest == "epoch-0002" if name.startswith("keras") else latest.startswith("stopped-"), latest


# ------------------------------------------------------------------------ bad input
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "name, needles",
    [
        (
            "keras-torch-optimizer",
            [
                "'rprop' is a PyTorch optimizer (torch.optim)",
                "the model is a Keras model",
                "keras.optimizers",
                "rmsprop",
            ],
        ),
        ("gan-downpour", ["--gan trains with easgd, adag or dynsgd", "downpour sends gradients"]),
    ],
)
def test_mixed_or_unsupported_input_is_one_clear_error(job, name, needles):
    assert job.codes[name] == 2
    err = job.stderr[name]
    lines = [line for line in err.splitlines() if "nbdist: error" in line]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
