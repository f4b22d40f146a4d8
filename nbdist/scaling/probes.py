"""The calibration's measurements inside one process: a step of the model through nbdist's
backend, each update rule's worker and master work on flat buffers of the model's size, a
checkpoint share, and the gradient noise scale.

Each is timed on the real objects a run uses (the backend's `compute_gradients`, the
rule's `worker_step` / `worker_message` / `worker_reply` / `master_apply`, the
optimisers the run would make by default), for a bounded time.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nbdist.algorithms import Update, make_algorithm
from nbdist.algorithms.arrays import to_numpy
from nbdist.backends import Backend, backend_for, configure_frameworks, making_models
from nbdist.data.base import Data
from nbdist.metrics.noise_scale import simple_noise_scale
from nbdist.scaling.setups import master_worker_rules
from nbdist.specs import Spec, parse_spec
from nbdist.train.context import DEFAULT_MASTER_OPTIMIZER, DEFAULT_WORKER_OPTIMIZER
from nbdist.train.definition import ModelDefinition
from nbdist.transport.heap import keep_freed_memory

__all__ = [
    "Steps",
    "build_backend",
    "time_steps",
    "rule_costs",
    "noise_scale",
    "checkpoint_seconds",
    "busy_cores",
    "settle_allocator",
    "SPREAD_POINTS",
    "SETTLE_BATCHES",
]

SPREAD_POINTS = 21  # quantiles of the measured step times the simulator draws from


@dataclass(frozen=True, slots=True)
class Steps:
    """Step times of the model at one batch size: their mean and their spread (sorted
    quantiles over the mean)."""

    mean: float
    spread: list[float]
    count: int
    median: float = 0.0  # what ratios and slopes are taken of: a few slow steps do not move it


def build_backend(definition: ModelDefinition, data: Data, threads: int, seed: int) -> Backend:
    """The model as a run's rank holds it (fp32, on the host)."""
    configure_frameworks(threads, seed)
    with making_models("fp32"):
        model = definition.make_model()
    sample, _ = data.train_batch(np.arange(min(256, data.n_train)))
    return backend_for(model, definition.loss, definition.metric, sample=sample)


SETTLE_BATCHES = 8  # the batch of the steps that settle the allocator, in batches
SETTLE_STEPS = 5


def settle_allocator(backend: Backend, data: Data, batch: int) -> None:
    """A few forward and backward passes at SETTLE_BATCHES times the batch, before any step
    is timed. A fresh process's malloc (glibc's) hands blocks above its mmap threshold
    (128 KiB at first) back to the kernel when they are freed and trims the heap's free top
    beyond twice that threshold; it raises both only once it frees a larger block. Until
    then every step whose activations pass them gets its memory from the kernel anew, page
    by page (page faults, zeroed pages), and is slower for it, the more so the larger the
    batch: the step's growth with the batch came out too steep. A run's ranks are past that
    by their steady state (a larger batch has been through them: the noise scale's, a
    validation's), so every rank of the probe settles first, and times its steps past it.

    Settling alone leaves it to where a step's blocks land: now and then glibc trims the
    heap's top after every step all the same (a fresh process in a few, more on a loaded
    machine). So the thresholds are fixed first, as the MPI reducer's ranks fix them
    (transport/heap.py): what a step frees stays for the next."""
    keep_freed_memory(4 * backend.num_params)
    x, y = data.train_batch(np.arange(min(SETTLE_BATCHES * batch, data.n_train)))
    for _ in range(SETTLE_STEPS):
        backend.compute_gradients(x, y)


def _batches(data: Data, batch: int, rng: np.random.Generator) -> Callable[[], tuple[Any, Any]]:
    """Random batches of the training data, read as a run reads them."""

    def next_batch() -> tuple[Any, Any]:
        indices = np.sort(rng.choice(data.n_train, size=min(batch, data.n_train), replace=False))
        return data.train_batch(indices)

    return next_batch


def time_steps(backend: Backend, data: Data, batch: int, seconds: float, *, warm: int = 5, most: int = 400) -> Steps:
    """Forward and backward at `batch` samples, for about `seconds` (at least 8 steps),
    after `warm` steps and a fifth of `seconds` not counted (a rank's first steps allocate,
    and its core may still be waking up). Each step's time is what it takes with a core of
    its own (`_OwnCore`): on a shared node the wall clock would count other processes' turns."""
    next_batch = _batches(data, batch, np.random.default_rng(1))
    prepared = [next_batch() for _ in range(8)]
    warming, i = time.perf_counter(), 0
    while i < warm or time.perf_counter() - warming < seconds / 5:
        backend.compute_gradients(*prepared[i % len(prepared)])
        i += 1
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < 8 or (time.perf_counter() - started < seconds and len(times) < most):
        x, y = prepared[len(times) % len(prepared)]
        clock = _OwnCore()
        backend.compute_gradients(x, y)
        times.append(clock.seconds())
    mean = statistics.fmean(times)
    spread = np.quantile(np.asarray(times) / mean, np.linspace(0.0, 1.0, SPREAD_POINTS))
    return Steps(mean, [float(q) for q in spread], len(times), statistics.median(times))


class _OwnCore:
    """A stopwatch of the time a piece of work takes with a core of its own, on a node that
    other processes (or more ranks than cores) share: the process's CPU seconds, where
    fewer than the wall-clock seconds (the scheduler gave its core to others meanwhile),
    else the wall-clock seconds (a framework's threads ran in parallel)."""

    __slots__ = ("wall", "cpu")

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def seconds(self) -> float:
        return min(time.perf_counter() - self.wall, time.process_time() - self.cpu)


def _seconds_per_call(call: Callable[[], object], seconds: float, most: int = 200) -> float:
    call()  # the first call allocates
    count, started, clock = 0, time.perf_counter(), _OwnCore()
    while count < 3 or (time.perf_counter() - started < seconds and count < most):
        call()
        count += 1
    return clock.seconds() / count


def rule_costs(
    backend: Backend, seconds: float
) -> tuple[dict[str, float], dict[str, float], dict[str, float], dict[str, float], float]:
    """Per rule, on flat buffers of the model's size: a worker's `worker_step` per batch
    (with its local optimiser step between syncs), its side of one exchange
    (`worker_message` and `worker_reply`), the master's `master_apply` of one update and
    its `master_round` of a synchronous round of one; and the top master's merge of a
    sub-master's push."""
    n = backend.num_params
    params = np.array(to_numpy(backend.rule_params), dtype=np.float32, copy=True)
    rules = master_worker_rules()
    per = seconds / (4 * len(rules))
    step, exchange, apply, rounds = {}, {}, {}, {}
    # Each call repeats on the same synthetic buffers hundreds of times, whose values then
    # leave float32's range (DiLoCo's outer momentum) or meet 0/0 (ADAG's exchange without
    # a step between): only the time is kept, and numpy's warnings about values nothing
    # reads would look like a fault of the user's model.
    with np.errstate(all="ignore"):
        for name in rules:
            step[name], exchange[name], apply[name], rounds[name] = _one_rule(backend, name, params, per)
    centre, delta = params.copy(), np.full(n, 1e-6, np.float32)
    merge_rule = make_algorithm(Spec("downpour"))
    merge = _seconds_per_call(lambda: merge_rule.merge_master_steps(centre, [Update(delta, 0, 1, 0)]), per)
    return step, exchange, apply, rounds, merge


def _one_rule(backend: Backend, name: str, params: np.ndarray, per: float) -> tuple[float, float, float, float]:
    n = params.size
    params = params.copy()
    grad = np.full(n, 1e-6, np.float32)
    rule = make_algorithm(Spec(name))
    rule.bind(2)
    worker_opt = _optimizer(backend, DEFAULT_WORKER_OPTIMIZER, params) if rule.uses_worker_optimizer else None
    state = rule.new_worker_state(n, rule.default_sync_every)
    rule.worker_start(state, params)
    step = _seconds_per_call(lambda: rule.worker_step(state, params, grad, worker_opt), per)
    out, reply = np.zeros(n, np.float32), params.copy()

    def one_exchange() -> None:
        rule.worker_message(state, params, out)
        rule.worker_reply(state, params, reply)

    exchange = _seconds_per_call(one_exchange, per)
    centre = params.copy()
    master_state = rule.new_master_state(n)
    master_opt = _optimizer(backend, DEFAULT_MASTER_OPTIMIZER, centre) if rule.uses_master_optimizer else None
    payload = np.full(n, 1e-6, np.float32)
    apply = _seconds_per_call(
        lambda: rule.master_apply(master_state, centre, [Update(payload, 0, 32, 0)], master_opt), per
    )
    out = np.empty(n, np.float32)
    rounds = _seconds_per_call(
        lambda: rule.master_round(master_state, centre, iter([Update(payload, 0, 32, 0)]), [32], master_opt, out), per
    )
    return step, exchange, apply, rounds


def _optimizer(backend: Backend, spec: str, params: np.ndarray) -> Any:
    return backend.make_optimizer(parse_spec(spec, what="optimizer"), params)


def noise_scale(
    backend: Backend, data: Data, batch: int, seconds: float
) -> tuple[float | None, tuple[float, float] | None, tuple[int, int]]:
    """B_simple = tr(Sigma) / |G|^2 at the model's current weights, from the squared norms
    of mean gradients over batches of `batch` and of 8 x `batch` samples (metrics/noise_scale.py),
    with its 16th and 84th percentiles over the batches resampled; None where the data are
    too few for two batch sizes or the estimate is not positive."""
    big = min(8 * batch, data.n_train // 2)
    if big <= batch:
        return None, None, (batch, big)
    rng = np.random.default_rng(7)
    small_batches, big_batches = _batches(data, batch, rng), _batches(data, big, rng)
    small_sq: list[float] = []
    big_sq: list[float] = []
    started = time.perf_counter()
    while len(big_sq) < 4 or (time.perf_counter() - started < seconds and len(big_sq) < 40):
        for _ in range(4):
            backend.compute_gradients(*small_batches())
            small_sq.append(_squared_norm(backend))
        backend.compute_gradients(*big_batches())
        big_sq.append(_squared_norm(backend))
    estimate = simple_noise_scale(small_sq, batch, big_sq, big)
    if not (estimate.gradient_sq > 0 and estimate.trace_sigma > 0):
        return None, None, (batch, big)
    resampled = []
    small_a, big_a = np.asarray(small_sq), np.asarray(big_sq)
    for _ in range(200):
        again = simple_noise_scale(
            list(rng.choice(small_a, small_a.size)), batch, list(rng.choice(big_a, big_a.size)), big
        )
        if again.gradient_sq > 0 and again.trace_sigma > 0:
            resampled.append(again.b_simple)
    low, high = np.percentile(resampled, [16, 84]) if resampled else (estimate.b_simple, estimate.b_simple)
    return float(estimate.b_simple), (float(low), float(high)), (batch, big)


def _squared_norm(backend: Backend) -> float:
    grads = np.asarray(to_numpy(backend.rule_grads), dtype=np.float64)
    return float(np.dot(grads, grads))


# A spinning process ends by itself when the rank that started it is gone, or after a while,
# whatever becomes of the rank (a killed rank cannot end it).
SPINNER = (
    "import os, time\n"
    "parent, end = os.getppid(), time.monotonic() + 60\n"
    "while os.getppid() == parent and time.monotonic() < end:\n"
    "    pass\n"
)


@contextlib.contextmanager
def busy_cores(cores: int) -> Iterator[None]:
    """`cores` processes that keep as many cores busy while the block runs (as computing
    ranks do where more ranks than cores share a node); ended after, by their ids."""
    spinners = [subprocess.Popen([sys.executable, "-c", SPINNER]) for _ in range(max(0, cores))]
    try:
        time.sleep(0.05)
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
        for spinner in spinners:
            spinner.wait(timeout=10)


def checkpoint_seconds(backend: Backend) -> float:
    """Writing one rank's share of a checkpoint: the weights as safetensors, flushed to disk."""
    from safetensors.numpy import save_file

    arrays = {"params": np.array(to_numpy(backend.rule_params), dtype=np.float32, copy=True)}
    with tempfile.TemporaryDirectory(prefix="nbdist-probe-") as tmp:
        path = Path(tmp) / "share.safetensors"
        started = time.perf_counter()
        save_file(arrays, str(path))
        with open(path, "rb") as fh:
            os.fsync(fh.fileno())
        return time.perf_counter() - started
