"""torch.optim without torch._dynamo until something compiles (nbdist/backends/torch_dynamo.py).

The checks run in ONE fresh Python process, one stage after the other: whether
torch._dynamo is imported is a fact of the whole process, and pytest's own process may have
imported it already. The stages follow the life of a process: a plain run (dynamo never
imported), then a compiled step (it imports dynamo), then the deferral asked for again
(skipped). Each stage prints one JSON line; each test reads its own (a process costs
seconds of importing torch and dynamo, the checks themselves almost nothing).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import ROOT, run_python

# A real training run in one process (the allreduce topology on one rank), then every
# optimiser nbdist offers stepped by nbdist's flat optimiser; torch._dynamo must never
# have been imported, and the weights go back to the test for comparison.
PLAIN_RUN = """
import json, sys
import numpy as np
from nbdist.cli import main
status = main(["train", "--model", "examples/digits_mlp.py", "--epochs", "2", "--topology", "allreduce",
               "--worker-optimizer", "adam(lr=0.01)", "--runs-dir", sys.argv[1], "--quiet"])
from nbdist.backends.torch import TorchFlatOptimizer, torch_optimizers
from nbdist.specs import parse_spec
weights = {}
for name, cls in torch_optimizers().items():
    if name == "muon":  # 2-D parameters only: it cannot step a flat buffer
        continue
    params = np.linspace(-1, 1, 300, dtype=np.float32)
    opt = TorchFlatOptimizer(cls, parse_spec(name), params)
    for step in range(4):
        opt.step(np.cos(params * (step + 1)).astype(np.float32))
    weights[name] = params.tolist()
print("PLAIN", json.dumps({"status": status, "dynamo": "torch._dynamo" in sys.modules, "weights": weights}))
"""

# Then a training step compiled by torch.compile (the plain run's deferral still in place),
# which calls the optimiser's wrapped methods inside the compiled region; dynamo's own
# disabled functions must be back in place.
COMPILED_RUN = """
import json, sys
import torch
from torch import nn
import nbdist.backends.torch  # defers the dynamo import
from nbdist.backends.torch_dynamo import deferred_functions
deferred_before = len(deferred_functions())
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
x = torch.randn(256, 8)
y = (x[:, 0] + x[:, 1] > 0).long()

@torch.compile(backend="eager")
def step():
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    return loss.detach()

losses = []
for _ in range(40):
    losses.append(float(step()))
    opt.step()
from torch._dynamo.utils import counters
from torch.optim import Optimizer
cache = getattr(Optimizer.zero_grad.__wrapped__, "__dynamo_disable", None)
print("COMPILED", json.dumps({
    "deferred_before": deferred_before,
    "deferred_after": len(deferred_functions()),
    "graphs": sum(counters["stats"].values()),
    "zero_grad_disabled": cache is not None and cache is not Optimizer.zero_grad.__wrapped__,
    "first": losses[0], "last": losses[-1],
}))
"""


# torch._dynamo is imported now (by the compiled step): asking for the deferral again does
# nothing. Some wrapped functions' caches are still empty (those the step never called), so
# a deferral that did not check for dynamo would fill them, and this stage would see it.
SKIPPED_RUN = """
import json
from torch.optim import Optimizer
from nbdist.backends.torch_dynamo import defer_dynamo_import, deferred_functions
empty = [name for name, value in vars(Optimizer).items()
         if callable(getattr(value, "__wrapped__", None))
         and getattr(value.__wrapped__, "__dynamo_disable", None) is None]
defer_dynamo_import()
print("SKIPPED", json.dumps({"empty_caches": empty, "deferred": len(deferred_functions())}))
"""


def _stage(done, name: str) -> dict:
    """The JSON line the stage `name` printed (it fails the test when there is none)."""
    lines = [line for line in done.stdout.splitlines() if line.startswith(name + " ")]
    assert len(lines) == 1, done.output[-3000:]
    return json.loads(lines[0].removeprefix(name + " "))


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    """The three stages, in one fresh process; it must end well."""
    done = run_python(
        ["-c", PLAIN_RUN + COMPILED_RUN + SKIPPED_RUN, str(tmp_path_factory.mktemp("plain"))], cwd=ROOT, timeout=240
    )
    assert done.returncode == 0, done.output[-3000:]
    return done


def test_a_plain_run_never_imports_dynamo_and_steps_as_torch_optim_does(stages):
    got = _stage(stages, "PLAIN")
    assert got["status"] == 0, stages.output[-3000:]
    assert got["dynamo"] is False, "a run that compiles nothing imported torch._dynamo"
    # The same steps through torch.optim's own step() (which imports dynamo: this
    # process may have it already), bit for bit.
    from nbdist.backends.torch import torch_optimizers
    from nbdist.specs import parse_spec

    assert len(got["weights"]) >= 10
    for name, weights in got["weights"].items():
        params = torch.from_numpy(np.linspace(-1, 1, 300, dtype=np.float32))
        cls = torch_optimizers()[name]
        kwargs = dict(parse_spec(name).kwargs)
        try:
            opt = cls([params], **kwargs, fused=True)
        except (TypeError, ValueError, RuntimeError):
            opt = cls([params], **kwargs)
        for step in range(4):
            params.grad = torch.from_numpy(np.cos(params.numpy() * (step + 1)).astype(np.float32))
            opt.step()
        assert np.array_equal(params.numpy(), np.asarray(weights, np.float32)), name


def test_a_compiled_step_still_trains_with_dynamo_disabled_methods(stages):
    got = _stage(stages, "COMPILED")
    assert got["deferred_before"] >= 4, "nothing was deferred: the check below would prove nothing"
    assert got["deferred_after"] == 0, "importing torch._dynamo left plain functions in dynamo's caches"
    assert got["zero_grad_disabled"], "zero_grad is not disabled for dynamo once dynamo is imported"
    assert got["graphs"] > 0, "torch.compile compiled nothing"
    assert got["last"] < 0.5 * got["first"], got


def test_the_deferral_is_skipped_once_dynamo_is_imported(stages):
    got = _stage(stages, "SKIPPED")
    assert got["empty_caches"], "every cache was filled: the check below would prove nothing"
    assert got["deferred"] == 0
