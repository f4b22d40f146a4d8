"""Pipeline model parallelism (--worker-parallel pipeline) on real MPI ranks.

- a 2- and a 4-stage pipeline give the unsplit model's gradient to 1e-5, with GPipe and
  1F1B, on a batch that does not divide evenly into its micro-batches, as the worker's
  leader gathers it into the whole model's buffer (tests/mpi_scripts/pipeline_gradients.py);
- the schedules run every micro-batch's forward and backward once, in order;
- pipeline replicas under --topology allreduce (2 replicas x 2 stages, in the same job):
  the same weights after a few steps as 2 allreduce ranks with the unsplit model, digits
  learnt (through top-k too), checkpoints per stage rank and an exact resume.

The master/worker training runs (a rule with pipeline workers learning digits) are in
tests/test_train_mpi.py's jobs; bad input in tests/test_bad_input.py.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

SCRIPTS = Path(__file__).resolve().parent / "mpi_scripts"
sys.path.insert(0, str(SCRIPTS))

import pipeline_gradients as script  # noqa: E402

from nbdist.backends.stages import stage_model  # noqa: E402
from nbdist.backends.torch import TorchBackend  # noqa: E402
from nbdist.metrics import read_log  # noqa: E402
from nbdist.train.checkpoint import Checkpoints  # noqa: E402
from nbdist.train.pipeline_schedule import BACKWARD, FORWARD, SCHEDULES, schedule  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module")
def gradients(tmp_path_factory):
    from conftest import run_mpi

    out = tmp_path_factory.mktemp("pipeline")
    done = run_mpi(4, [str(SCRIPTS / "pipeline_gradients.py"), str(out)], timeout=240)
    assert done.returncode == 0, done.output
    assert done.stdout.count("OK rank") == 4, done.output
    return out, done.output


def run_dir(gradients, name: str):
    out, output = gradients
    assert re.search(rf"^run {re.escape(name)} rc=0$", output, re.M), output[-6000:]
    return out / "runs" / name


def unsplit_gradient() -> np.ndarray:
    """The whole model (the stages in a row, as a master holds it) on the whole batch."""
    backend = TorchBackend(stage_model(script.build_stages(1)))
    x, y = script.batch()
    backend.compute_gradients(x, y)
    return backend.grads.copy()


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages,pipeline", [(4, 0), (2, 0), (2, 1)])
def test_pipeline_stages_give_the_unsplit_models_gradient(gradients, name, stages, pipeline):
    expected = unsplit_gradient()
    actual = np.load(gradients[0] / f"{stages}-{name}-{pipeline}.npy")
    assert actual.shape == expected.shape
    assert np.abs(expected).max() > 1e-2  # a gradient that moves the weights
    diff = float(np.abs(actual - expected).max())
    assert diff <= TOL, f"{stages} stages, {name}: max abs difference {diff:.3g} > {TOL:g}"


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 3), (4, 8)])
def test_every_stage_runs_each_micro_batch_once_in_order(name, stages, micro):
    for stage in range(stages):
        steps = schedule(name, stage, stages, micro)
        for kind in (FORWARD, BACKWARD):
            assert [i for k, i in steps if k == kind] == list(range(micro))
        # A micro-batch's backward comes after its forward.
        assert all(steps.index((FORWARD, i)) < steps.index((BACKWARD, i)) for i in range(micro))
    if name == "1f1b":
        # The first stage holds at most `stages` micro-batches' activations at once.
        held, most = 0, 0
        for kind, _ in schedule(name, 0, stages, micro):
            held += 1 if kind == FORWARD else -1
            most = max(most, held)
        assert most == min(stages, micro)


WHOLE_MODEL = {"0.0.weight", "0.0.bias", "1.0.weight", "1.0.bias", "1.2.weight", "1.2.bias"}


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_pipeline_replicas_take_the_unsplit_allreduce_steps(gradients):
    # 2 replicas x 2 stages against 2 allreduce ranks with the stages in a row: the same
    # shards, the same gradient sum, so the same weights up to the order of float sums.
    run = run_dir(gradients, "replicas-few-steps")
    replicas = load_file(str(run / "final" / "model.safetensors"))
    run_dir(gradients, "allreduce")
    unsplit = load_file(str(run.parent / "allreduce-0" / "final" / "model.safetensors"))
    assert set(replicas) == set(unsplit) == WHOLE_MODEL
    # The steps moved the weights: 10 classes at random would be 0.1.
    assert json.loads((run / "summary.json").read_text())["final"]["val_acc"] > 0.3
    diff = max(float(np.abs(replicas[k] - unsplit[k]).max()) for k in unsplit)
    assert diff <= TOL, f"pipeline replicas differ from allreduce by {diff:.3g}"


def learnt_digits(gradients, name: str):
    """Run `name`'s directory, once its summary shows >= 0.90 on digits, every sample
    trained once an epoch, and the whole model written out."""
    run = run_dir(gradients, name)
    history = json.loads((run / "summary.json").read_text())["history"]
    assert history[-1]["val_acc"] >= 0.90, history
    assert all(h["samples"] == 1437 for h in history), history
    assert set(load_file(str(run / "final" / "model.safetensors"))) == WHOLE_MODEL
    return run


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_pipeline_replicas_learn_digits_and_resume_exactly(gradients):
    run = learnt_digits(gradients, "replicas-learn")
    # Each stage rank checkpoints its own stage; replica 1's stages keep replica 0's weights.
    path = run / "checkpoints" / "epoch-0012"
    sizes = [Checkpoints.read_rank(path, rank)[0]["model"]["params"].size for rank in range(4)]
    assert sizes == [64 * 128 + 128, 128 * 64 + 64 + 64 * 10 + 10] * 2, sizes
    for rank in (2, 3):
        assert "model/params" not in load_file(str(path / f"rank-{rank:05d}.safetensors"))
    # Stopped after one epoch and resumed to two: where the straight run ended.
    run_dir(gradients, "replicas-resumed (resume)")
    resumed = load_file(str(run.parent / "replicas-resumed" / "final" / "model.safetensors"))
    straight = load_file(str(run_dir(gradients, "replicas-few-steps") / "final" / "model.safetensors"))
    assert set(resumed) == WHOLE_MODEL and all(np.array_equal(resumed[k], straight[k]) for k in straight)


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_compressed_pipeline_replicas_learn_digits(gradients):
    run = learnt_digits(gradients, "replicas-topk")
    # The same steps as replicas-learn, each stage's buckets in fewer bytes (a tenth of
    # the values, and their indices).
    sent = {
        name: sum(r["values"]["bytes_sent"] for r in read_log(run.parent / name, "train"))
        for name in ("replicas-learn", "replicas-topk")
    }
    assert 0 < sent["replicas-topk"] < sent["replicas-learn"] / 4, sent
