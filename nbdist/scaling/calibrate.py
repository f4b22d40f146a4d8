"""The calibration probe: the performance model's inputs, measured on the ranks at hand.

Collective over the job's ranks (at least two), in well under a minute:

1. rank 0 alone (the others sleep in a barrier): the model's forward and backward at the
   batch size and at four times it (each rank's allocator settled first, as a run's is:
   probes.settle_allocator), through nbdist's backend (probes.py); each update
   rule's worker and master work on flat buffers of the model's size; a checkpoint share;
   the gradient noise scale at the model's initial weights;
2. as many ranks as the node has cores (or ranks), computing at once: how much slower a
   step is with every core busy;
3. ranks 0 and 1: a message there and back and a two-rank Iallreduce of flat buffers of
   several sizes through the transport (transport/probe.py), the master's look at a
   client's posted receive, and a message's way when the ranks sleep between polls on
   cores kept busy (what more ranks than cores cost a wait);
4. three short real runs through nbdist's own loops (points.py): allreduce on one rank at
   the batch and at four times it, and a master with one worker (Downpour) on two: a step
   as a run takes it and its growth with the batch, and what the loops cost beyond the
   parts above (the data, the records, the master's loop per update, the messages' way).

What it finds is made into the model's inputs, a `Calibration`, by assemble.py (no MPI).
"""

from __future__ import annotations

import contextlib
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nbdist.data.arrays import ArrayData
from nbdist.data.base import Data
from nbdist.errors import UserError
from nbdist.options import TrainOptions
from nbdist.scaling.assemble import assemble, core_share, fit_line
from nbdist.scaling.inputs import Calibration
from nbdist.scaling.load import CpuMeter, thread_turns, window_load
from nbdist.scaling.points import PointRunner
from nbdist.scaling.probes import (
    build_backend,
    busy_cores,
    checkpoint_seconds,
    noise_scale,
    rule_costs,
    settle_allocator,
    time_steps,
)
from nbdist.scaling.setups import Point, SetUp
from nbdist.train.definition import ModelDefinition
from nbdist.transport.collectives import Collectives
from nbdist.transport.probe import (
    allreduce_seconds,
    free,
    idle_barrier,
    ping_pong,
    posted_test_seconds,
    split,
    step_and_reduce_seconds,
)
from nbdist.transport.waiting import LONGEST_SLEEP, poll_without_sleeping

__all__ = ["calibrate", "MESSAGE_SIZES"]

MESSAGE_SIZES = (8, 4096, 65536, 1 << 20)  # bytes, and the model's message
TIMEOUT = 600.0


def calibrate(
    comm: Any,
    definition: ModelDefinition,
    base: TrainOptions,
    *,
    batch: int,
    model: str,
    runs_dir: Path,
    cores: int,
    quick: bool = False,
    run_seconds: float = 3.0,
    repeats: int = 1,
    meter: CpuMeter | None = None,
    say: Callable[[str], None] = print,
) -> tuple[Calibration | None, list[Point]]:
    """Measure the inputs; on rank 0 the Calibration and the two points its real runs
    measured (allreduce on one rank, a master and one worker), (None, []) elsewhere.
    `meter` (rank 0's): what other processes took of the cores meanwhile; each time is
    brought back to what it is with the cores the ranks need (see assemble.py's
    `core_share`). The two real runs are made `repeats` times each, the fastest kept."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size < 2:
        raise UserError("nbdist scale needs at least 2 MPI ranks: it measures messages between two of them")
    started = time.time()
    seconds = 0.6 if quick else 1.5
    busy = min(size, cores)
    collectives = Collectives(lambda: TIMEOUT)
    # Ranks 0 and 1 time messages and steps together (with the same sizes and counts), and
    # as many as the node has cores compute at once; every rank settles its allocator as a
    # run's rank has (probes.settle_allocator): the points run on them all afterwards.
    loaded = _in_memory(definition.make_data())
    backend: Any = build_backend(definition, loaded, base.threads, base.seed)
    settle_allocator(backend, loaded, batch)
    data: Data | None = loaded
    if rank >= max(2, busy):
        loaded.close()
        data, backend = None, None
    found: dict[str, Any] = {}
    try:
        idle_barrier(comm, TIMEOUT)
        if rank == 0:
            say(f"nbdist: calibrating on {size} ranks ({cores} cores): the model's step alone")
            t0 = time.time()
            found.update(_alone(backend, data, batch, seconds))
            found["alone_share"] = core_share(meter, t0, time.time(), 1, cores)
        found["busy"] = _busy_rounds(comm, backend, data, batch, seconds, busy)
    finally:
        if data is not None:
            data.close()
    if rank == 0:
        say(f"nbdist: calibrating: messages and allreduce between two ranks, {busy} ranks computing at once")
    found.update(_messages(comm, cores, backend, data, batch, seconds))
    runner = PointRunner(comm, definition, base, runs_dir, cores, TIMEOUT)
    steps = int(min(5000, max(40, run_seconds / found["step_s"]))) if rank == 0 else 0
    steps = collectives.allgather(comm, steps, "the calibration")[0]
    alone = _fastest(runner, SetUp("allreduce"), 1, batch, steps, repeats, "calibration-allreduce-1r")
    # The step's growth with the batch as a run's step grows: one rank at the strong
    # scaling's total batch of 4 ranks (the probe's own slope stands in where it fails).
    big_batch = min(4 * batch, found.get("train_samples", 4 * batch)) if rank == 0 else 0
    big_batch = collectives.allgather(comm, big_batch, "the calibration")[0]
    big = _fastest(
        runner, SetUp("allreduce"), 1, big_batch, max(40, steps // 3), repeats, "calibration-allreduce-1r-big", "strong"
    )
    pair = _fastest(runner, SetUp("master-worker", "downpour"), 2, batch, steps, repeats, "calibration-downpour-2r")
    if rank != 0:
        return None, []
    if alone.point is None or pair.point is None:
        raise UserError(f"the calibration runs could not be measured: {alone.error or pair.error}")
    points = [p for p in (alone.point, big.point, pair.point) if p is not None]
    for point in points:
        point.extra = {**(point.extra or {}), **window_load(meter, (point.extra or {}).get("window"), point.ranks)}
    calibration = assemble(
        found,
        alone.point,
        pair.point,
        busy,
        model,
        batch,
        size,
        cores,
        started,
        poll_sleep_s=LONGEST_SLEEP,
        big=big.point if big_batch > batch else None,
    )
    return calibration, points


def _fastest(
    runner: PointRunner,
    setup: SetUp,
    ranks: int,
    batch: int,
    steps: int,
    repeats: int,
    name: str,
    scaling: str = "weak",
) -> Any:
    """The fastest of `repeats` runs of a calibration point (as the study keeps its points':
    other processes' load only slows a run), with its own name each."""
    best = None
    for i in range(max(1, repeats)):
        outcome = runner.run(setup, ranks, batch, steps, scaling, name=name if i == 0 else f"{name}-{i + 1}")
        if best is None or best.point is None:
            best = outcome
        elif outcome.point is not None and outcome.point.samples_per_s > best.point.samples_per_s:
            best = outcome
    return best


BUSY_ROUNDS = 3


def _busy_rounds(comm: Any, backend: Any, data: Any, batch: int, seconds: float, busy: int) -> float:
    """How much slower rank 0's step is while `busy` ranks compute at once than alone (each
    time with a core of its own, as the probe times steps), over BUSY_ROUNDS rounds of alone
    then together: the least of the together times over the least of the alone ones. Other
    processes' load only slows a step, even its own CPU time (caches, a busy sibling
    thread), and a burst of it during one together round would otherwise pass for what our
    own ranks cost each other."""
    alone: list[float] = []
    together: list[float] = []
    for _ in range(BUSY_ROUNDS):
        for members in (1, busy):
            idle_barrier(comm, TIMEOUT)
            if comm.Get_rank() < members:
                median = time_steps(backend, data, batch, seconds / BUSY_ROUNDS, warm=2).median
                (alone if members == 1 else together).append(median)
    idle_barrier(comm, TIMEOUT)
    if comm.Get_rank() != 0 or not alone or not together:
        return 1.0
    return max(1.0, min(together) / min(alone))


# The most training samples the probe reads into memory (its batches come from there).
PROBE_SAMPLES = 4096


def _in_memory(data: Data) -> Data:
    """Some of the data as arrays, the reader closed: the probe times the model's step, not
    the files' reading (a file reader's threads would run meanwhile; the short real runs
    count the reading)."""
    try:
        x, y = data.train_batch(np.arange(min(data.n_train, PROBE_SAMPLES)))
        n_train = data.n_train
    finally:
        data.close()
    return _Counted(x, y, x[:1], y[:1], name="probe", n_all=n_train)


@dataclass(slots=True)
class _Counted(ArrayData):
    """Arrays that remember the size of the training set they were taken from."""

    n_all: int = 0


SLOPE_ROUNDS = 3


def _alone(backend: Any, data: Any, batch: int, seconds: float) -> dict[str, Any]:
    """Rank 0 with the node to itself."""
    full = time_steps(backend, data, batch, seconds)
    # The slope from the batch up (strong scaling shares a larger total batch): at a
    # quarter of the batch the step is mostly its fixed costs. Medians, of rounds of the
    # two batches one after the other: a few slow steps, or a neighbour's load that comes
    # and goes over the probe (which slows even a core's own time: caches, a busy sibling
    # thread), do not tilt the slope.
    big_batch = min(4 * batch, data.n_train)
    slopes = []
    if big_batch > batch:
        for _ in range(SLOPE_ROUNDS):
            small = time_steps(backend, data, batch, seconds / SLOPE_ROUNDS, warm=2).median
            big = time_steps(backend, data, big_batch, seconds / SLOPE_ROUNDS, warm=2).median
            slopes.append((big - small) / (big_batch - batch))
    per_sample = max(0.0, statistics.median(slopes)) if slopes else 0.0
    step, exchange, apply, rounds, merge = rule_costs(backend, seconds)
    b_simple, noise_range, batches = noise_scale(backend, data, batch, 2 * seconds)
    return {
        "step_s": full.mean,
        "step_median": full.median,
        "round": rounds,
        "spread": full.spread,
        "per_sample_s": per_sample,
        "worker_step": step,
        "worker_exchange": exchange,
        "apply": apply,
        "merge": merge,
        "noise_scale": b_simple,
        "noise_range": noise_range,
        "noise_batches": batches,
        "train_samples": data.n_all,
        "checkpoint_s": checkpoint_seconds(backend),
        "params": backend.num_params,
        "state": int(np.asarray(backend.state).size),
    }


def _messages(comm: Any, cores: int, backend: Any, data: Any, batch: int, seconds: float) -> dict[str, Any]:
    """Ranks 0 and 1: one-way message times and two-rank allreduce times by size (fitted
    to alpha + bytes x beta); rank 0: a posted receive looked at; what more ranks than
    cores cost a message and a synchronous step. The others wait."""
    rank = comm.Get_rank()
    message = 4 * backend.num_params if backend is not None else 0
    pair = split(comm, rank < 2)
    found: dict[str, Any] = {}
    hosts = Collectives(lambda: TIMEOUT).allgather(comm, socket.gethostname(), "the calibration's nodes")
    try:
        if rank < 2:
            poll_without_sleeping(2 <= cores)  # as a run of two ranks on this node polls
            sizes = sorted({*MESSAGE_SIZES, max(8, message)})
            repeats = [max(5, min(200, int(seconds * 2e8 / max(s, 1e4) / 4))) for s in sizes]
            one_way = [ping_pong(pair, 1 - rank, s, r, TIMEOUT) for s, r in zip(sizes, repeats, strict=True)]
            reduce = [allreduce_seconds(pair, s, r, TIMEOUT) for s, r in zip(sizes, repeats, strict=True)]
            found["p2p"] = fit_line(sizes, one_way)
            found["allreduce"] = fit_line(sizes, reduce)
            if rank == 0:
                found["client_test_s"] = posted_test_seconds(pair, 64, 200)
            found["wake_s"] = _sleeping_wait(pair, rank, cores, max(8, message), one_way[sizes.index(max(8, message))])
            if backend is not None:
                found["round_extra_s"], found["turn_s"] = _oversubscribed_step(
                    pair, rank, cores, backend, data, batch, message, seconds
                )
    finally:
        free(pair)
        idle_barrier(comm, TIMEOUT)
    found["between_nodes"] = _between_nodes(comm, hosts, seconds)
    return found


def _between_nodes(comm: Any, hosts: list[str], seconds: float) -> tuple[float, float] | None:
    """Where the job's ranks span nodes: one-way message times between rank 0 and the first
    rank on another node, by size, fitted to alpha + bytes x beta (on rank 0; None
    elsewhere, and on one node, where a preset stands in for the network)."""
    rank = comm.Get_rank()
    other = next((r for r, host in enumerate(hosts) if host != hosts[0]), None)
    if other is None:
        return None
    pair = split(comm, rank in (0, other))
    try:
        if rank in (0, other):
            sizes = sorted({*MESSAGE_SIZES, 1 << 22})
            repeats = [max(5, min(100, int(seconds * 1e8 / max(s, 1e4) / 4))) for s in sizes]
            one_way = [ping_pong(pair, 1 - pair.Get_rank(), s, r, TIMEOUT) for s, r in zip(sizes, repeats, strict=True)]
            fitted = fit_line(sizes, one_way)
            return fitted if rank == 0 else None
        return None
    finally:
        free(pair)
        idle_barrier(comm, TIMEOUT)


SLICING_PROBES = 3  # the (quiet, loaded) pairs of _oversubscribed_step, the median kept


def _oversubscribed_step(
    pair: Any, rank: int, cores: int, backend: Any, data: Any, batch: int, message: int, seconds: float
) -> tuple[float, float]:
    """What one more runnable process than cores costs a synchronous step beyond sharing
    the cores evenly, and how long rank 0 waited for a core each time it became runnable
    meanwhile (`load.thread_turns`): two ranks take allreduce steps (forward, backward, the gradient's
    allreduce) with the cores to themselves, then with cores - 1 spinning processes beside
    them and sleeping between polls; the second's step over the first's times
    (cores + 1) / cores. The cores are time-sliced, not shared evenly: a rank that is last
    to finish its step may wait for a slice, and the others for it. SLICING_PROBES pairs of
    (quiet, loaded), the median kept: one pair now and then comes out far off, and every
    allreduce step on shared cores is charged what it says."""
    x, y = data.train_batch(np.arange(min(batch, data.n_train)))

    def step() -> None:
        backend.compute_gradients(x, y)

    # The same counts on both ranks (each step is a collective): from the options, not a timing.
    quiet_steps = max(10, int(seconds * 20))
    extras, waited, turns = [], 0.0, 0
    for _ in range(SLICING_PROBES):
        quiet = step_and_reduce_seconds(pair, step, message, quiet_steps, TIMEOUT)
        with busy_cores(cores - 1) if rank == 0 else contextlib.nullcontext():
            poll_without_sleeping(False)
            before = thread_turns()
            try:
                loaded = step_and_reduce_seconds(pair, step, message, quiet_steps, TIMEOUT)
            finally:
                poll_without_sleeping(2 <= cores)
            after = thread_turns()
        extras.append(max(0.0, loaded - quiet * (cores + 1) / cores))
        waited, turns = waited + after[1] - before[1], turns + after[2] - before[2]
    # The mean wait for a core each time this rank became runnable (woke from a poll's
    # sleep, or was preempted): what a rank waits for its turn with one runnable too many.
    return statistics.median(extras), waited / turns if turns > 0 else 0.0


def _sleeping_wait(pair: Any, rank: int, cores: int, message: int, quiet: float) -> float:
    """What a message costs more when more ranks than cores share the node: its receiver
    waits by sleeping between polls (as --busy-poll auto has it then), and wakes on cores
    that other processes keep busy (rank 0 starts as many spinning processes as cores)."""
    # One more runnable process than cores, as three ranks on two cores have it.
    with busy_cores(cores - 1) if rank == 0 else contextlib.nullcontext():
        poll_without_sleeping(False)
        try:
            loaded = ping_pong(pair, 1 - rank, message, 50, TIMEOUT)
        finally:
            poll_without_sleeping(2 <= cores)
    return max(0.0, loaded - quiet)
