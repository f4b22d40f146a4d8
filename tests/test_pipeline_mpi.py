"""Pipeline model parallelism (--worker-parallel pipeline) on real MPI ranks.

- a 2- and a 4-stage pipeline give the unsplit model's gradient to 1e-5, with GPipe and
  1F1B, on a batch that does not divide evenly into its micro-batches, as the worker's
  leader gathers it into the whole model's buffer (tests/mpi_scripts/pipeline_gradients.py);
- the schedules run every micro-batch's forward and backward once, in order.

The training runs (a master/worker rule with pipeline workers learning digits) are in
tests/test_train_mpi.py's jobs; bad input in tests/test_bad_input.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPTS = Path(__file__).resolve().parent / "mpi_scripts"
sys.path.insert(0, str(SCRIPTS))

import pipeline_gradients as script  # noqa: E402

from nbdist.backends.stages import stage_model  # noqa: E402
from nbdist.backends.torch import TorchBackend  # noqa: E402
from nbdist.train.pipeline_schedule import BACKWARD, FORWARD, SCHEDULES, schedule  # noqa: E402

TOL = 1e-5


@pytest.fixture(scope="module")
def gradients(tmp_path_factory):
    from conftest import run_mpi

    out = tmp_path_factory.mktemp("pipeline")
    done = run_mpi(4, [str(SCRIPTS / "pipeline_gradients.py"), str(out)], timeout=120)
    assert done.returncode == 0, done.output
    assert done.stdout.count("OK rank") == 4, done.output
    return out


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
    actual = np.load(gradients / f"{stages}-{name}-{pipeline}.npy")
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
