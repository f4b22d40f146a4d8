"""torch.optim without torch._dynamo until something compiles (nbdist/backends/torch_dynamo.py).

Each check runs in a fresh Python process: whether torch._dynamo is imported is a fact of
the whole process, and pytest's own process may have imported it already.
"""

from __future__ import annotations

import json

import numpy as np
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
print(json.dumps({"status": status, "dynamo": "torch._dynamo" in sys.modules, "weights": weights}))
"""

# A training step compiled by torch.compile, which calls the optimiser's wrapped methods
# inside the compiled region; dynamo's own disabled functions must be back in place.
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
print(json.dumps({
    "deferred_before": deferred_before,
    "deferred_after": len(deferred_functions()),
    "graphs": sum(counters["stats"].values()),
    "zero_grad_disabled": cache is not None and cache is not Optimizer.zero_grad.__wrapped__,
    "first": losses[0], "last": losses[-1],
}))
"""


def _last_json(output: str) -> dict:
    return json.loads(output.strip().splitlines()[-1])


def test_a_plain_run_never_imports_dynamo_and_steps_as_torch_optim_does(tmp_path):
    done = run_python(["-c", PLAIN_RUN, str(tmp_path)], cwd=ROOT, timeout=180)
    assert done.returncode == 0, done.output[-3000:]
    got = _last_json(done.stdout)
    assert got["status"] == 0, done.output[-3000:]
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


def test_a_compiled_step_still_trains_with_dynamo_disabled_methods(tmp_path):
    done = run_python(["-c", COMPILED_RUN], cwd=ROOT, timeout=180)
    assert done.returncode == 0, done.output[-3000:]
    got = _last_json(done.stdout)
    assert got["deferred_before"] >= 4, "nothing was deferred: the check below would prove nothing"
    assert got["deferred_after"] == 0, "importing torch._dynamo left plain functions in dynamo's caches"
    assert got["zero_grad_disabled"], "zero_grad is not disabled for dynamo once dynamo is imported"
    assert got["graphs"] > 0, "torch.compile compiled nothing"
    assert got["last"] < 0.5 * got["first"], got


def test_the_deferral_is_skipped_once_dynamo_is_imported():
    code = (
        "import sys, torch._dynamo\n"
        "from nbdist.backends.torch_dynamo import defer_dynamo_import, deferred_functions\n"
        "defer_dynamo_import()\n"
        "print(len(deferred_functions()))\n"
    )
    done = run_python(["-c", code], cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.output[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "0"
