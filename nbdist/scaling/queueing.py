"""Mean Value Analysis of the closed queueing networks a master and its workers make.

W workers cycle: each computes (a delay, or a share of the node's cores when there are
more ranks than cores), sends its update, queues at the master, is served, and waits for
the reply. The master is one FIFO server. MVA (Reiser and Lavenberg 1980) gives the
throughput X, the time R spent at the master (queueing and service) and the mean queue
length Q exactly for exponential product-form networks; for the nearly deterministic
times of a master's service the update in service is taken to have half its time left
(`_residence`), which keeps the model within a few per cent of the simulator at the knee. Its
asymptotes: X = W / (Z + S) while the master is idle most of the time, X = 1 / S once it
is saturated, with the knee at W* = (Z + S) / S.

Shared cores (one node, more ranks than cores) are modelled as processor sharing among
the workers: with j of the W computing, the master has an update to serve unless j = W,
and its service holds a core (its bursts are short, and Linux runs a process that slept as
soon as it wakes), so each computing worker gets min(1, (cores - [j < W]) / j) of a core.
Where other processes leave the ranks less than one core, the master's service holds what
they leave and takes longer by as much: no CPU second is given twice.
The workers' compute is then a load-dependent station (exact MVA with marginal
probabilities).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Closed", "mva", "mva_shared_cores", "two_class_mva", "saturation_workers"]


@dataclass(frozen=True, slots=True)
class Closed:
    """A solved closed network: throughput X (updates per second), residence at the master
    R (queueing + service), mean number at the master Q, mean number computing N, the
    master's utilisation U and its effective service time S (stretched by shared cores)."""

    x: float
    r: float
    q: float
    n_computing: float
    u: float
    s: float
    q_seen: float  # mean number at the master an arriving update finds (arrival theorem)


def _residence(service: float, q_seen: float, u_seen: float) -> float:
    """An arriving update's time at the master: its own service, a full service for each
    one waiting, and for the one in service what is left of it. Exact MVA takes that to be
    a full service too (exponential times); a master's service hardly varies, so half of
    one is left on average (the residual of a deterministic time). Below the knee this is
    what keeps the model from queueing more than the master really does."""
    return service * (1.0 + q_seen - 0.5 * u_seen)


def mva(workers: int, think: float, service: float) -> Closed:
    """MVA of `workers` customers between a delay `think` and one FIFO queue `service`."""
    q = q_prev = u = 0.0
    x = r = 0.0
    for n in range(1, workers + 1):
        q_prev = q
        r = _residence(service, q, u)
        x = n / (think + r)
        if x * service > 1.0:  # the residual's shortcut cannot serve faster than 1 / S
            x, r = 1.0 / service, n * service - think
        q, u = x * r, min(1.0, x * service)
    return Closed(x, r, q, x * think, x * service, service, q_prev)


def mva_shared_cores(
    workers: int,
    compute: float,
    delay: float,
    service: float,
    cores: float,
    other_load: float = 0.0,
    other_masters_busy: float = 0.0,
) -> Closed:
    """MVA where the workers' `compute` (CPU seconds per cycle) shares the `cores` with their
    master, with `other_load` runnable ranks of other networks on the node and with other
    masters busy `other_masters_busy` of the time; `delay` is time without the CPU (the
    messages' way). A master's short service bursts are not shared (Linux runs a process
    that slept as soon as it wakes): while it serves it holds a core, and it has an update
    to serve whenever a worker is not computing. With j of the W workers computing, each
    gets min(1, (cores - [j < W] - other masters) / (j + other load)) of a core; with
    `cores` below 1, a master holds those and its service takes 1 / cores as long. Reduces
    to `mva` when every rank has a core of its own."""
    j = np.arange(1, workers + 1, dtype=float)
    master = (j < workers).astype(float)  # the master serves someone unless all compute
    # The masters hold a core each while they serve, as far as the ranks have cores: with
    # less than one (other processes take the rest) a service takes longer by as much, and
    # the workers get what is left; the CPU seconds the masters use are never given twice.
    held = np.minimum(cores, (master + other_masters_busy) * min(1.0, cores))
    free = np.maximum(cores - held, 1e-3)
    service = service / min(1.0, cores)
    per_job = compute / np.minimum(1.0, free / (j + other_load))  # seconds each of j computing takes
    marginal = np.ones(1)  # P(j computing | n - 1 customers), j = 0..n-1
    q = q_prev = x = r_a = r_m = u_seen = 0.0
    for n in range(1, workers + 1):
        r_a = float(np.dot(per_job[:n], marginal))
        q_prev = q
        r_m = _residence(service, q, u_seen)
        x = n / (r_a + r_m + delay)
        if x * service > 1.0:
            x, r_m = 1.0 / service, n * service - r_a - delay
        tail = x * per_job[:n] / j[:n] * marginal
        head = max(0.0, 1.0 - float(tail.sum()))
        marginal = np.concatenate(([head], tail))
        marginal /= marginal.sum()
        q, u_seen = x * r_m, min(1.0, x * service)
    return Closed(x, r_m, q, x * r_a, min(1.0, x * service), service, q_prev)


def two_class_mva(
    counts: tuple[int, int], thinks: tuple[float, float], services: tuple[float, float]
) -> tuple[Closed, Closed]:
    """Approximate (Schweitzer-Bard) MVA of one queue with two classes of customers: the top
    master's own workers and its sub-masters. A class of 0 customers gets a zero result."""
    q = [c / 2.0 for c in counts]
    x = [0.0, 0.0]
    r = [0.0, 0.0]
    for _ in range(500):
        total = sum(q)
        for c in (0, 1):
            if counts[c] == 0:
                r[c], x[c] = 0.0, 0.0
                continue
            others = total - q[c] / counts[c]  # what a customer of class c finds (without itself)
            busy = sum(x[k] * services[k] for k in (0, 1)) * (1.0 - 1.0 / max(1, sum(counts)))
            r[c] = services[c] * (1.0 + others) - 0.5 * services[c] * min(1.0, busy)
            x[c] = counts[c] / (thinks[c] + r[c])
        load = sum(x[c] * services[c] for c in (0, 1))
        if load > 1.0:  # as in mva: no faster than the server
            for c in (0, 1):
                if counts[c]:
                    x[c] /= load
                    r[c] = counts[c] / x[c] - thinks[c]
        new = [x[c] * r[c] for c in (0, 1)]
        if max(abs(a - b) for a, b in zip(new, q, strict=True)) < 1e-9:
            q = new
            break
        q = new
    u = sum(x[c] * services[c] for c in (0, 1))
    return tuple(  # type: ignore[return-value]
        Closed(
            x[c],
            r[c],
            q[c],
            x[c] * thinks[c],
            u,
            services[c],
            sum(q) - (q[c] / counts[c] if counts[c] else 0.0),
        )
        for c in (0, 1)
    )


def saturation_workers(think: float, service: float) -> float:
    """W* = (Z + S) / S: the workers at which the master becomes the bottleneck."""
    return (think + service) / service if service > 0 else float("inf")
