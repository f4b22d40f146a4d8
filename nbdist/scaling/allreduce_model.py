"""The analytic model's allreduce topology, and the slowest of several ranks' steps.

An allreduce step (model.py's docstring has the whole model) is the slowest rank's
forward and backward, the loop's own costs and the part of the gradient's allreduce that
backward does not hide; the allreduce is ring or tree, whichever is faster, in buckets,
within a node and between nodes. The slowest of W ranks (`expected_max`, or `makespan`
where they share fewer cores) also sets a synchronous master/worker round, which model.py
takes from here. The functions read a `PerformanceModel`'s calibration, machine and
compute costs; `PerformanceModel.allreduce_s` and `.predict` are the ways in.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from nbdist.scaling.setups import Point, SetUp

if TYPE_CHECKING:
    from nbdist.scaling.model import PerformanceModel

__all__ = [
    "allreduce_point",
    "allreduce_seconds",
    "bucketed_collective_s",
    "expected_max",
    "makespan",
    "BACKWARD_SHARE",
]

# The share of a step's compute that is the backward pass (about twice the forward's
# work): what gradient buckets can overlap.
BACKWARD_SHARE = 2.0 / 3.0


def expected_max(spread: list[float], count: int) -> float:
    """E[max] of `count` draws from the empirical distribution `spread` (sorted values)."""
    n = len(spread)
    total = 0.0
    for i, value in enumerate(spread, start=1):
        total += value * ((i / n) ** count - ((i - 1) / n) ** count)
    return total


def makespan(spread: list[float], count: int, cores: float) -> float:
    """When the last of `count` jobs ends, their works the expected order statistics of
    `spread`, sharing `cores` equally (processor sharing); the largest when each has a core."""
    n = len(spread)
    works = [spread[min(n - 1, int((i + 0.5) / count * n))] for i in range(count)]
    works.sort()
    done, previous = 0.0, 0.0
    for i, work in enumerate(works):
        running = count - i
        done += (work - previous) * max(running, cores) / cores
        previous = work
    return done


def allreduce_seconds(model: PerformanceModel, ranks: int, nbytes: int, algorithm: str = "best") -> float:
    """An allreduce of `nbytes` over `ranks` ranks, in buckets; "ring", "tree" or the faster."""
    if ranks <= 1:
        return 0.0
    if algorithm == "best":
        return min(allreduce_seconds(model, ranks, nbytes, "ring"), allreduce_seconds(model, ranks, nbytes, "tree"))
    cal, machine = model.cal, model.machine
    buckets = max(1, math.ceil(nbytes / model.bucket_bytes))
    per_node = min(machine.ranks_per_node(ranks), ranks)
    nodes = machine.nodes_for(ranks)
    alpha = cal.allreduce_alpha_s
    if machine.sleeps(ranks):
        alpha += model.sleeping_wait_s()  # a round waits for a peer that sleeps between polls
    within = bucketed_collective_s(algorithm, per_node, nbytes, buckets, alpha, cal.allreduce_beta_s)
    between = bucketed_collective_s(algorithm, nodes, nbytes, buckets, machine.net.latency_s, machine.net.beta_s)
    return within + between


def allreduce_point(model: PerformanceModel, setup: SetUp, ranks: int, batch: int) -> Point:
    """The figures of an allreduce set-up on `ranks` ranks."""
    cal, machine = model.cal, model.machine
    per_node, cores = machine.ranks_per_node(ranks), machine.cores
    compute = model.compute_s(batch, min(per_node, machine.own_cores))
    loop = cal.allreduce_loop_s
    if per_node > cores:  # the ranks take turns on the cores: every step's work stretches
        share = per_node / cores
        if machine.sleeps(ranks):  # a rank that is done sleeps: the others get its share
            slowest = compute * makespan(cal.spread, per_node, cores)
        else:  # a rank that is done polls (the node has a core per rank): it keeps its share
            slowest = compute * expected_max(cal.spread, per_node) * share
        slowest += model.slicing_s(per_node)
        loop *= share
        mean_compute = compute * share
    else:
        slowest = compute * expected_max(cal.spread, ranks)
        mean_compute = compute
    nbytes = 4 * cal.params
    reduce = model.allreduce_s(ranks, nbytes)
    buckets = max(1, math.ceil(nbytes / model.bucket_bytes))
    hidden = model.overlap * BACKWARD_SHARE * mean_compute * (buckets - 1) / buckets
    exposed = max(reduce / buckets, reduce - hidden) if ranks > 1 else 0.0
    step = slowest + loop + exposed
    return Point(
        setup,
        ranks,
        ranks,
        batch,
        samples_per_s=ranks * batch / step,
        step_s=step,
        compute_s=mean_compute + loop,
        communicate_s=exposed,
        wait_s=slowest - mean_compute,
        staleness_mean=0.0,
        staleness_p99=0.0,
        cores=machine.cores_for(ranks),
        oversubscribed=machine.sleeps(ranks),
    )


def bucketed_collective_s(algorithm: str, ranks: int, nbytes: int, buckets: int, alpha: float, beta: float) -> float:
    """One allreduce over `ranks` peers with per-message `alpha` and per-byte `beta`, sent as
    `buckets` reductions (each pays the latency terms; the bytes add up)."""
    if ranks <= 1:
        return 0.0
    if algorithm == "ring":
        return buckets * 2 * (ranks - 1) * alpha + 2 * (ranks - 1) / ranks * nbytes * beta
    rounds = math.ceil(math.log2(ranks))
    return buckets * rounds * alpha + rounds * nbytes * beta
