"""--seed reproduces a run's initial weights however the model's code imports its framework:
a model built at the top of a model file right after `import torch`, or a build_model()
that imports torch inside, is drawn after nbdist seeds torch (backends/import_hooks.py),
not before, from a generator nothing had seeded."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import ROOT
from torch import nn

from nbdist.backends import backend_for

# Rank 0's set-up as every run makes it (settle), in a fresh interpreter: torch not yet imported.
SET_UP = """
import json, sys
from nbdist.backends import DeviceRequest
from nbdist.options import TrainOptions
from nbdist.train.definition import load_model_file
from nbdist.train.settle import settle
options = TrainOptions(topology="allreduce", epochs=1, seed=int(sys.argv[2]))
settled = settle(options, lambda: load_model_file(sys.argv[1]), 1, 0, DeviceRequest("cpu"), here=False)
print(json.dumps(settled.backend.params.tolist()))
"""

MODEL_FILES = {
    "built at the top, after import torch": (
        "import torch.nn as nn\nmodel = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))\n"
    ),
    "build_model() imports torch inside": (
        "def build_model():\n"
        "    import torch.nn as nn\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))\n"
    ),
}


def _set_up_weights(model_file, *seeds: int) -> list[np.ndarray]:
    """Rank 0's initial weights from SET_UP in one fresh interpreter per seed, all at once."""
    argv = [[sys.executable, "-c", SET_UP, str(model_file), str(seed)] for seed in seeds]
    running = [subprocess.Popen(a, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for a in argv]
    weights = []
    try:
        for process in running:
            out, err = process.communicate(timeout=180)
            assert process.returncode == 0, err[-3000:]
            weights.append(np.array(json.loads(out.strip().splitlines()[-1]), dtype=np.float32))
    finally:
        for process in running:
            if process.poll() is None:
                process.kill()
                process.wait()
    return weights


def _seeded_weights(seed: int) -> np.ndarray:
    torch.manual_seed(seed)
    return backend_for(nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))).params.copy()


@pytest.mark.parametrize("form", list(MODEL_FILES))
def test_a_seed_gives_the_initial_weights_torch_draws_from_it(form, tmp_path):
    model_file = tmp_path / "model.py"
    model_file.write_text(MODEL_FILES[form])
    (weights,) = _set_up_weights(model_file, 3)
    np.testing.assert_array_equal(weights, _seeded_weights(3))
    assert not np.array_equal(weights, _seeded_weights(4))


def test_a_seed_gives_the_same_initial_weights_to_a_keras_model_built_at_the_top(tmp_path):
    """Keras draws from generators its own start-up leaves in a state of their own, so the
    check is two fresh interpreters against each other: equal for one seed."""
    pytest.importorskip("keras")
    model_file = tmp_path / "model.py"
    model_file.write_text(
        "import keras\n"
        "model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(16, activation='relu'),\n"
        "                          keras.layers.Dense(10, activation='softmax')])\n"
        "model.compile(loss='sparse_categorical_crossentropy', metrics=['accuracy'])\n"
    )
    first, second = _set_up_weights(model_file, 3, 3)
    np.testing.assert_array_equal(first, second)
