"""What the update-rule tests share: a master and k workers simulated in one process,
calling a rule's methods in the order the master/worker topology does, with the real
TorchBackend and its flat optimisers; plain single-process torch training to compare
with; and the parametrisation of the contract tests, computed from the rule registry.

The contract tests (test_rule_contracts.py) run on every master/worker rule registered
on nbdist.algorithms.RULES when they are collected: a rule added in its own module (or a
test's toy rule) is tested without a list to add it to."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

from nbdist.algorithms import RULES, Algorithm, Update, allreduce_sgd
from nbdist.algorithms.arrays import to_numpy
from nbdist.backends import DeviceRequest
from nbdist.backends.torch import TorchBackend, TorchFlatOptimizer, torch_optimizers
from nbdist.specs import parse_spec
from nbdist.transport.staging import Staging

F32 = np.float32


# ----------------------------------------------------------------------------- the contract tests' rules
def master_worker_rules(where: Callable[[type[Algorithm]], bool] = lambda rule: True) -> list:
    """pytest params, one per master/worker rule registered now that `where` accepts, with
    the rule's name as the test id."""
    return [
        pytest.param(rule, id=name)
        for name, rule in RULES.items()
        if isinstance(rule, type) and issubclass(rule, Algorithm) and where(rule)
    ]


def build(rule: type[Algorithm]) -> Algorithm:
    """The rule with the parameters that exercise all of it (its example_parameters)."""
    return rule(**rule.example_parameters)


WORKER_OPT = "sgd(lr=0.1, momentum=0.9)"
MASTER_OPT = "adam(lr=0.01)"


def optimizers(rule: type[Algorithm]) -> dict[str, str]:
    """The optimisers the rule steps with, as the Simulation takes them."""
    return {
        **({"worker_opt": WORKER_OPT} if rule.uses_worker_optimizer else {}),
        **({"master_opt": MASTER_OPT} if rule.uses_master_optimizer else {}),
    }


def device_runs() -> dict[str, dict]:
    """Every master/worker rule registered now, as the device tests run it (test_gpu.py):
    `rule` makes it (with its example_parameters), the rest are its optimisers."""
    return {
        param.id: {"rule": functools.partial(build, param.values[0]), **optimizers(param.values[0])}
        for param in master_worker_rules()
    }


# ----------------------------------------------------------------------------- simulation
def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def make_batches(count: int, size: int, seed: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.normal(size=(size, 6)).astype(F32), rng.integers(0, 3, size=size)) for _ in range(count)]


def flat(model: nn.Module) -> np.ndarray:
    """A model's weights laid out like TorchBackend.params (reverse registration order)."""
    return torch.cat([p.detach().reshape(-1) for p in reversed(list(model.parameters()))]).numpy().copy()


def reference_run(model: nn.Module, spec: str, batches) -> np.ndarray:
    """Plain single-process training: per-parameter torch.optim (single-tensor path)."""
    ref = copy.deepcopy(model)
    s = parse_spec(spec)
    opt = torch_optimizers()[s.name](ref.parameters(), **s.kwargs, foreach=False)
    loss_fn = nn.CrossEntropyLoss()
    for x, y in batches:
        opt.zero_grad()
        loss_fn(ref(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()
    return flat(ref)


def assert_close(actual, expected, rtol=1e-6, atol=1e-7):
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


class Simulation:
    """One master and k workers in one process, calling the rule as roles/master/ does.

    synchronous: the master waits for every worker's update and applies them together.
    asynchronous: every worker computes from the weights it holds, then the master
    serves the updates one at a time (as Testsome hands them over), so the later ones
    are stale by the number served before them.

    tensors: every backend is placed with --device cpu (or the device named, "cuda" in the
    GPU tests), so the rules run on torch tensors and every message and reply goes through
    the transport's staging, as on a GPU.
    """

    def __init__(
        self,
        algorithm,
        model: nn.Module,
        k: int,
        *,
        worker_opt: str | None = None,
        master_opt: str | None = None,
        sync_every: int = 1,
        synchronous: bool = False,
        tensors: bool | str = False,
    ):
        self.algorithm, self.k, self.synchronous = algorithm, k, synchronous
        algorithm.bind(k)
        algorithm.asynchronous = not synchronous  # as the run sets it (train/settle.py)
        self.master = self._backend(model, tensors)
        self.centre = self.master.rule_params
        n = self.master.num_params
        self.master_state = algorithm.new_master_state(n, like=self.centre)
        self.master_opt = (
            self.master.make_optimizer(parse_spec(master_opt))
            if master_opt and algorithm.uses_master_optimizer
            else None
        )
        self.workers = [self._backend(model, tensors) for _ in range(k)]
        self.worker_opts = [
            w.make_optimizer(parse_spec(worker_opt)) if worker_opt and algorithm.uses_worker_optimizer else None
            for w in self.workers
        ]
        self.worker_states = [algorithm.new_worker_state(n, sync_every, like=w.rule_params) for w in self.workers]
        self.version = 0
        self.worker_versions = [0] * k
        self.samples = [0] * k
        self.stalenesses: list[int] = []
        for w, state in zip(self.workers, self.worker_states, strict=True):
            w.rule_params[...] = self.centre  # the Bcast of the initial weights
            algorithm.worker_start(state, w.rule_params)

    @staticmethod
    def _backend(model: nn.Module, tensors: bool | str) -> TorchBackend:
        backend = TorchBackend(copy.deepcopy(model))
        if tensors:
            backend.place(DeviceRequest(tensors if isinstance(tensors, str) else "cpu"))
        return backend

    def run(self, batches_per_worker) -> None:
        """batches_per_worker[i]: worker i's (x, y) batches of one epoch, all of one length."""
        steps = len(batches_per_worker[0])
        algo = self.algorithm
        for step in range(steps):
            pending: list[tuple[int, np.ndarray, int]] = []
            for i, w in enumerate(self.workers):
                x, y = batches_per_worker[i][step]
                w.compute_gradients(x, y)
                self.samples[i] += len(y)
                sync = algo.worker_step(self.worker_states[i], w.rule_params, w.rule_grads, self.worker_opts[i])
                if sync or step == steps - 1:
                    message = Staging.of_host(np.empty(w.num_params, F32), w.rule_params, w.copier)
                    algo.worker_message(self.worker_states[i], w.rule_params, message.device)
                    # What the master's receive buffer holds, as its rule sees it.
                    received = Staging.of_host(message.to_host().copy(), self.centre, self.master.copier)
                    received.to_device()
                    out = received.device
                    pending.append((i, out, self.samples[i]))
                    self.samples[i] = 0
            if not pending:
                continue
            if self.synchronous:
                assert len(pending) == self.k
                groups = [pending]
            else:
                groups = [[p] for p in pending]
            for group in groups:
                # Staleness as the master sees it: its version now - the one the worker used.
                updates = [Update(out, self.version - self.worker_versions[i], samples) for i, out, samples in group]
                replies = algo.master_apply(self.master_state, self.centre, updates, self.master_opt)
                self.version += 1
                assert len(replies) == len(group)
                for (i, _, _), update, reply in zip(group, updates, replies, strict=True):
                    self.stalenesses.append(update.staleness)
                    worker = self.workers[i]
                    received = Staging.of_host(to_numpy(reply).copy(), worker.rule_params, worker.copier)  # MPI's
                    received.to_device()
                    algo.worker_reply(self.worker_states[i], worker.rule_params, received.device)
                    self.worker_versions[i] = self.version


# ----------------------------------------------------------------------------- one master step
# Each master against its source's update, written out here in float64: one asynchronous
# update that is STALE versions old, then a synchronous round of three updates with
# different sample counts, which every rule averages, sample-weighted.
C0 = np.array([0.5, -1.0, 2.0, 0.25])
PAYLOADS = [np.array([0.2, -0.4, 0.1, 1.0]), np.array([-0.3, 0.5, 0.0, 0.6]), np.array([1.0, 0.25, -0.5, -0.2])]
SAMPLES = [5, 7, 12]
STALE = 3


def master_round(algo, payloads, samples, staleness, opt_spec=None):
    """(centre after master_apply from C0, replies); staleness is each update's."""
    centre = C0.astype(F32)
    opt = TorchFlatOptimizer(torch.optim.SGD, parse_spec(opt_spec), centre) if opt_spec else None
    updates = [Update(np.array(p, F32), s, n) for p, s, n in zip(payloads, staleness, samples, strict=True)]
    replies = algo.master_apply(algo.new_master_state(C0.size), centre, updates, opt)
    return centre, [np.array(r, copy=True) for r in replies]


def sample_mean(vectors, samples):
    return sum(n * v for n, v in zip(samples, vectors, strict=True)) / sum(samples)


def scramble(state, rng) -> None:
    """Random values in every field of a rule state (arrays and counters)."""
    for name in state.__dataclass_fields__:
        value = getattr(state, name)
        if isinstance(value, np.ndarray):
            value[:] = rng.normal(size=value.shape)
        else:
            setattr(state, name, int(rng.integers(2, 50)))


def allreduce_sgd_steps(tensors: bool | str) -> np.ndarray:
    """Three allreduce_sgd steps with momentum of the test model on one batch, with the
    backend placed as Simulation places it (`tensors`); the final weights on the host."""
    x, y = make_batches(1, 9, seed=4)[0]
    backend = Simulation._backend(make_model(), tensors)
    opt = backend.make_optimizer(parse_spec("sgd(lr=0.1, momentum=0.9)"))
    for _ in range(3):
        backend.compute_gradients(x, y)
        allreduce_sgd.apply(opt, backend.rule_grads)
    return to_numpy(backend.rule_params).copy()
