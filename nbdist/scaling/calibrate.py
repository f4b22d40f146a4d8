"""The calibration probe: the performance model's inputs, measured on the ranks at hand.

Collective over the job's ranks (at least two), in well under a minute:

1. rank 0 alone (the others sleep in a barrier): the model's forward and backward at the
   batch size and at four times it, through nbdist's backend (probes.py); each update
   rule's worker and master work on flat buffers of the model's size; a checkpoint share;
   the gradient noise scale at the model's initial weights;
2. as many ranks as the node has cores (or ranks), computing at once: how much slower a
   step is with every core busy;
3. ranks 0 and 1: a message there and back and a two-rank Iallreduce of flat buffers of
   several sizes through the transport (transport/probe.py), the master's look at a
   client's posted receive, and a message's way when the ranks sleep between polls on
   cores kept busy (what more ranks than cores cost a wait);
4. two short real runs through nbdist's own loops (points.py): allreduce on one rank, and
   a master with one worker (Downpour) on two: what the loops cost beyond the parts above
   (the data, the records, the master's loop per update, the messages' way).
"""

from __future__ import annotations

import contextlib
import dataclasses
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
from nbdist.scaling.inputs import Calibration
from nbdist.scaling.load import CpuMeter, thread_turns, window_load
from nbdist.scaling.points import PointRunner
from nbdist.scaling.probes import build_backend, busy_cores, checkpoint_seconds, noise_scale, rule_costs, time_steps
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
MIN_CORES = 0.2  # the least of the cores a measurement is taken to have had


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
    brought back to what it is with the cores the ranks need (see `_share`). The two real
    runs are made `repeats` times each, the fastest kept."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size < 2:
        raise UserError("nbdist scale needs at least 2 MPI ranks: it measures messages between two of them")
    started = time.time()
    seconds = 0.6 if quick else 1.5
    busy = min(size, cores)
    collectives = Collectives(lambda: TIMEOUT)
    # Ranks 0 and 1 time messages and steps together (with the same sizes and counts), and
    # as many as the node has cores compute at once: those hold the model.
    data = _in_memory(definition.make_data()) if rank < max(2, busy) else None
    backend = build_backend(definition, data, base.threads, base.seed) if data is not None else None
    found: dict[str, Any] = {}
    try:
        idle_barrier(comm, TIMEOUT)
        if rank == 0:
            say(f"nbdist: calibrating on {size} ranks ({cores} cores): the model's step alone")
            t0 = time.time()
            found.update(_alone(backend, data, batch, seconds))
            found["alone_share"] = _share(meter, t0, time.time(), 1, cores)
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
    pair = _fastest(runner, SetUp("master-worker", "downpour"), 2, batch, steps, repeats, "calibration-downpour-2r")
    if rank != 0:
        return None, []
    if alone.point is None or pair.point is None:
        raise UserError(f"the calibration runs could not be measured: {alone.error or pair.error}")
    for point in (alone.point, pair.point):
        point.extra = {**(point.extra or {}), **window_load(meter, (point.extra or {}).get("window"), point.ranks)}
    calibration = _assemble(found, alone.point, pair.point, busy, model, batch, size, cores, started)
    return calibration, [alone.point, pair.point]


def _fastest(runner: PointRunner, setup: SetUp, ranks: int, batch: int, steps: int, repeats: int, name: str) -> Any:
    """The fastest of `repeats` runs of a calibration point (as the study keeps its points':
    other processes' load only slows a run), with its own name each."""
    best = None
    for i in range(max(1, repeats)):
        outcome = runner.run(setup, ranks, batch, steps, name=name if i == 0 else f"{name}-{i + 1}")
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


def _share(meter: CpuMeter | None, start: float, end: float, ranks: int, cores: int) -> float:
    """The share of a core rank 0 had between `start` and `end` while it computed with
    `ranks - 1` others: a time it measured then, times this, is the time with a core of
    its own. The kernel's own count where it keeps one (the time rank 0 ran over the time
    it was runnable: what the scheduler gave it, however the other processes were
    grouped); else even sharing of what the other processes left of the cores."""
    if meter is None:
        return 1.0
    schedule = meter.schedule(start, end, 1)[0]
    if schedule is not None and schedule[1] is not None:
        return max(schedule[1], MIN_CORES)
    free = max(cores - meter.others(start, end), MIN_CORES)
    return min(1.0, free / ranks)


def _rank_shares(point: Point, cores: int) -> list[float]:
    """Each rank's share of a core while it was runnable during a calibration run's steady
    state (load.window_load's "shares"); where unknown, even sharing of what other
    processes left of the cores."""
    extra = point.extra or {}
    even = min(1.0, max(cores - extra.get("others", 0.0), MIN_CORES) / point.ranks)
    shares = extra.get("shares") or [None] * point.ranks
    return [max(s, MIN_CORES) if s is not None else even for s in shares]


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
            found["p2p"] = _fit(sizes, one_way)
            found["allreduce"] = _fit(sizes, reduce)
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
            fitted = _fit(sizes, one_way)
            return fitted if rank == 0 else None
        return None
    finally:
        free(pair)
        idle_barrier(comm, TIMEOUT)


def _at_share(point: Point, share: float, master_share: float | None = None) -> Point:
    """A measured point's times as with a core of its own: its workers' (whose records
    give the phases) had `share` of one, its master `master_share` (its busy time is its
    utilisation times the cycle; processor sharing: a busy second is `share` CPU seconds)."""
    util = point.master_utilisation
    if util is not None and master_share is not None:
        util = util * master_share / share  # over the cycle brought back by `share`
    return dataclasses.replace(
        point,
        step_s=point.step_s * share,
        compute_s=point.compute_s * share,
        communicate_s=point.communicate_s * share,
        wait_s=point.wait_s * share,
        samples_per_s=point.samples_per_s / share,
        master_utilisation=util,
    )


def _oversubscribed_step(
    pair: Any, rank: int, cores: int, backend: Any, data: Any, batch: int, message: int, seconds: float
) -> tuple[float, float]:
    """What one more runnable process than cores costs a synchronous step beyond sharing
    the cores evenly, and how long rank 0 waited for a core each time it became runnable
    meanwhile (`load.thread_turns`): two ranks take allreduce steps (forward, backward, the gradient's
    allreduce) with the cores to themselves, then with cores - 1 spinning processes beside
    them and sleeping between polls; the second's step over the first's times
    (cores + 1) / cores. The cores are time-sliced, not shared evenly: a rank that is last
    to finish its step may wait for a slice, and the others for it."""
    x, y = data.train_batch(np.arange(min(batch, data.n_train)))

    def step() -> None:
        backend.compute_gradients(x, y)

    # The same count on both ranks (each step is a collective): from the options, not a timing.
    quiet_steps = max(10, int(seconds * 20))
    quiet = step_and_reduce_seconds(pair, step, message, quiet_steps, TIMEOUT)
    with busy_cores(cores - 1) if rank == 0 else contextlib.nullcontext():
        poll_without_sleeping(False)
        before = thread_turns()
        try:
            loaded = step_and_reduce_seconds(pair, step, message, quiet_steps, TIMEOUT)
        finally:
            poll_without_sleeping(2 <= cores)
        after = thread_turns()
    # The mean wait for a core each time this rank became runnable (woke from a poll's
    # sleep, or was preempted): what a rank waits for its turn with one runnable too many.
    turns = after[2] - before[2]
    turn = (after[1] - before[1]) / turns if turns > 0 else 0.0
    return max(0.0, loaded - quiet * (cores + 1) / cores), turn


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


def _fit(sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """alpha, beta of seconds = alpha + bytes x beta (least squares; both kept positive)."""
    slope, intercept = np.polyfit(np.asarray(sizes, float), np.asarray(seconds, float), 1)
    return max(float(intercept), min(seconds) * 0.5, 1e-7), max(float(slope), 1e-13)


def _assemble(
    found: dict[str, Any],
    alone: Any,
    pair: Any,
    busy_ranks: int,
    model: str,
    batch: int,
    size: int,
    cores: int,
    started: float,
) -> Calibration:
    """The inputs, from the parts measured and the two real runs."""
    notes = []
    # The probe's compute times are a core's own already (probes._OwnCore); the checkpoint
    # (disk as well as CPU) is brought back by the share of a core rank 0 had.
    alone_share = found["alone_share"]
    found["checkpoint_s"] *= alone_share
    alone = _at_share(alone, _rank_shares(alone, cores)[0])
    master_share, worker_share = _rank_shares(pair, cores)
    pair = _at_share(pair, worker_share, master_share)
    if alone_share < 1.0:
        notes.append(
            f"other processes used the cores meanwhile: times brought back to a core each (share {alone_share:.2f})"
        )
    busy = found["busy"]
    if 1 < busy_ranks < cores:
        busy = 1.0 + (busy - 1.0) * (cores - 1) / (busy_ranks - 1)
        notes.append(f"busy factor extrapolated from {busy_ranks} ranks computing to {cores} cores")
    p2p_alpha, p2p_beta = found["p2p"]
    ar_alpha, ar_beta = found["allreduce"]
    params, state = found["params"], found["state"]
    message = 4 * (params + state)
    # A lone allreduce rank's step beyond forward and backward: data, optimiser, records.
    allreduce_loop = max(0.0, alone.step_s - found["step_s"])
    # The master with one worker: busy (not waiting) per update, which the model rebuilds
    # as its loop + the rule's apply + the receive + one client looked at.
    cycle = pair.step_s
    busy_per_update = (pair.master_utilisation or 0.0) * cycle
    apply = found["apply"]
    receive = message * p2p_beta
    master_fixed = max(0.0, busy_per_update - apply["downpour"])
    service = master_fixed + apply["downpour"] + receive + found["client_test_s"]
    # The worker waits for the master's service and the messages' way there and back.
    reply_latency = max(2 * p2p_alpha, pair.wait_s - service)
    # The rest of the worker's cycle beyond its compute (the model's step and the rule's
    # worker_step) and its waiting: the rule's exchange work, its send, the data and the
    # records (measured with Downpour; the other rules differ by what their exchange work
    # costs more or less).
    talk = max(0.0, cycle - pair.wait_s - pair.compute_s)
    exchange = {
        r: max(0.0, talk + s - found["worker_exchange"]["downpour"]) for r, s in found["worker_exchange"].items()
    }
    # And within its compute phase, beyond the model's step (one worker computes alone; the
    # master's polling does not slow it) and the rule's worker_step: the lr, the loss check,
    # the tallies, once per batch.
    per_batch = max(0.0, pair.compute_s - found["step_s"] - found["worker_step"]["downpour"])
    worker_step = {r: s + per_batch for r, s in found["worker_step"].items()}
    return Calibration(
        model=model,
        params=params,
        state=state,
        batch_size=batch,
        cores=cores,
        step_s=found["step_s"],
        per_sample_s=found["per_sample_s"],
        busy_factor=busy,
        spread=found["spread"],
        allreduce_loop_s=allreduce_loop,
        worker_step_s=worker_step,
        worker_exchange_s=exchange,
        p2p_alpha_s=p2p_alpha,
        p2p_beta_s=p2p_beta,
        allreduce_alpha_s=ar_alpha,
        allreduce_beta_s=ar_beta,
        apply_s=apply,
        round_s=found["round"],
        merge_s=found["merge"],
        master_fixed_s=master_fixed,
        client_test_s=found["client_test_s"],
        reply_latency_s=reply_latency,
        poll_sleep_s=LONGEST_SLEEP,
        wake_s=found["wake_s"],
        round_extra_s=found.get("round_extra_s", 0.0) * alone_share,
        turn_s=found.get("turn_s", 0.0),
        checkpoint_s=found["checkpoint_s"],
        between_nodes=found.get("between_nodes"),
        noise_scale=found["noise_scale"],
        noise_range=found["noise_range"],
        noise_batches=tuple(found["noise_batches"]),
        train_samples=found["train_samples"],
        ranks=size,
        host=socket.gethostname(),
        when=started,
        seconds=time.time() - started,
        notes=notes,
    )
