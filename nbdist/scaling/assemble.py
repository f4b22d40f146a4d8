"""The calibration's measurements made into the performance model's inputs.

calibrate.py measures on the job's ranks (MPI); what it found becomes a `Calibration`
here, with no MPI: each time is brought back to what it is with a core of its own (the
share of a core a rank had while it was measured, from the kernel's counts or from what
other processes left of the cores), message times are fitted to alpha + bytes x beta, and
the loops' own costs are what the two short real runs took beyond the parts measured
alone.
"""

from __future__ import annotations

import dataclasses
import socket
import time
from typing import Any

import numpy as np

from nbdist.scaling.inputs import Calibration
from nbdist.scaling.load import CpuMeter
from nbdist.scaling.setups import Point

__all__ = ["assemble", "at_share", "core_share", "fit_line", "rank_shares", "MIN_CORES"]

MIN_CORES = 0.2  # the least of the cores a measurement is taken to have had


def core_share(meter: CpuMeter | None, start: float, end: float, ranks: int, cores: int) -> float:
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


def rank_shares(point: Point, cores: int) -> list[float]:
    """Each rank's share of a core while it was runnable during a calibration run's steady
    state (load.window_load's "shares"); where unknown, even sharing of what other
    processes left of the cores."""
    extra = point.extra or {}
    even = min(1.0, max(cores - extra.get("others", 0.0), MIN_CORES) / point.ranks)
    shares = extra.get("shares") or [None] * point.ranks
    return [max(s, MIN_CORES) if s is not None else even for s in shares]


def at_share(point: Point, share: float, master_share: float | None = None) -> Point:
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


def fit_line(sizes: list[int], seconds: list[float]) -> tuple[float, float]:
    """alpha, beta of seconds = alpha + bytes x beta (least squares; both kept positive)."""
    slope, intercept = np.polyfit(np.asarray(sizes, float), np.asarray(seconds, float), 1)
    return max(float(intercept), min(seconds) * 0.5, 1e-7), max(float(slope), 1e-13)


def assemble(
    found: dict[str, Any],
    alone: Any,
    pair: Any,
    busy_ranks: int,
    model: str,
    batch: int,
    size: int,
    cores: int,
    started: float,
    *,
    poll_sleep_s: float,
    big: Any = None,
) -> Calibration:
    """The inputs, from the parts measured (`found`, calibrate.py's) and the real runs
    (`big`: the lone allreduce rank at a larger batch, where there is one);
    `poll_sleep_s`: the longest sleep of a rank that sleeps between polls."""
    notes: list[str] = []
    # The probe's compute times are a core's own already (probes._OwnCore); the checkpoint
    # (disk as well as CPU) is brought back by the share of a core rank 0 had.
    alone_share = found["alone_share"]
    found["checkpoint_s"] *= alone_share
    alone = at_share(alone, rank_shares(alone, cores)[0])
    master_share, worker_share = rank_shares(pair, cores)
    pair = at_share(pair, worker_share, master_share)
    step, per_sample = found["step_s"], _growth(found, alone, big, cores, notes)
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
    allreduce_loop = max(0.0, alone.step_s - step)
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
    per_batch = max(0.0, pair.compute_s - step - found["worker_step"]["downpour"])
    worker_step = {r: s + per_batch for r, s in found["worker_step"].items()}
    return Calibration(
        model=model,
        params=params,
        state=state,
        batch_size=batch,
        cores=cores,
        step_s=step,
        per_sample_s=per_sample,
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
        poll_sleep_s=poll_sleep_s,
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


def _growth(found: dict[str, Any], alone: Point, big: Point | None, cores: int, notes: list[str]) -> float:
    """A step's growth per sample of the batch, as the real runs took it: the lone
    allreduce rank's compute phase at four times the batch over that at the batch (each
    brought back to a core of its own); the probe's where that run is missing or shows
    none. The probe's own growth is the difference of two medians of half a second each,
    divided by three batches: small noise in either is a large error in it, and the
    strong scaling's points (one worker at four times the batch) inherit it whole."""
    per_sample = found["per_sample_s"]
    if big is not None and big.batch > alone.batch:
        big = at_share(big, rank_shares(big, cores)[0])
        slope = (big.compute_s - alone.compute_s) / (big.batch - alone.batch)
        if slope > 0:
            per_sample = slope
            notes.append(
                f"the step's growth with the batch as the runs took it: {slope * 1e6:.3g} us per sample "
                f"(the probe's {found['per_sample_s'] * 1e6:.3g} us)"
            )
    return per_sample
