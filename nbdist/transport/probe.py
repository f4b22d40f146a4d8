"""Timing MPI itself, for the scaling study's calibration (nbdist/scaling/calibrate.py), and
letting ranks with nothing to do wait without taking a core.

Each timing goes through the same calls the runs make: flat float32 buffers with the
upper-case methods, nonblocking and polled (waiting.py), so that what is measured is
what a run pays: a message's way from one rank to another, an allreduce of a bucket, and
a master's look at its clients' posted receives once per pass (`test_each`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from nbdist.transport.waiting import WaitTimeout, test_all, test_each, wait_all

__all__ = [
    "split",
    "idle_barrier",
    "ping_pong",
    "allreduce_seconds",
    "step_and_reduce_seconds",
    "posted_test_seconds",
    "IDLE_POLL",
]

# How often a rank with nothing to do looks whether the others are done: it should take
# no core from the ranks that are measured, and a few milliseconds late costs nothing.
IDLE_POLL = 0.005
_TAG = 31_717


def split(comm: Any, member: bool, key: int = 0) -> Any:
    """Collective over `comm`: a communicator of the members (COMM_NULL elsewhere)."""
    return comm.Split(0 if member else MPI.UNDEFINED, key)


def free(comm: Any) -> None:
    if comm != MPI.COMM_NULL:
        comm.Free()


def idle_barrier(comm: Any, timeout: float) -> None:
    """A barrier over `comm` that waits between long sleeps (IDLE_POLL): where a rank sits
    out a measurement, and the measured ranks join once done. WaitTimeout past `timeout`."""
    request = comm.Ibarrier()
    deadline = time.monotonic() + timeout
    while not test_all([request]):
        if time.monotonic() > deadline:
            raise WaitTimeout(timeout)
        time.sleep(IDLE_POLL)


def ping_pong(comm: Any, peer: int, nbytes: int, repeats: int, timeout: float) -> float:
    """Seconds for one message of `nbytes` from this rank to `peer` (half a round trip,
    the mean of `repeats`), both ranks calling; the first round trip is not counted."""
    buffer = np.zeros(max(1, nbytes // 4), np.float32)
    first = comm.Get_rank() < peer
    started = 0.0
    for i in range(repeats + 1):
        if i == 1:
            started = time.perf_counter()
        if first:
            wait_all([comm.Isend(buffer, dest=peer, tag=_TAG)], timeout=timeout)
            wait_all([comm.Irecv(buffer, source=peer, tag=_TAG)], timeout=timeout)
        else:
            wait_all([comm.Irecv(buffer, source=peer, tag=_TAG)], timeout=timeout)
            wait_all([comm.Isend(buffer, dest=peer, tag=_TAG)], timeout=timeout)
    return (time.perf_counter() - started) / repeats / 2.0


def allreduce_seconds(comm: Any, nbytes: int, repeats: int, timeout: float) -> float:
    """Seconds of one in-place `Iallreduce` of `nbytes` over `comm` (mean of `repeats`
    after a first one), as the allreduce topology reduces a bucket."""
    buffer = np.ones(max(1, nbytes // 4), np.float32)
    started = 0.0
    for i in range(repeats + 1):
        if i == 1:
            started = time.perf_counter()
        wait_all([comm.Iallreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)], timeout=timeout)
    return (time.perf_counter() - started) / repeats


def step_and_reduce_seconds(comm: Any, step: Callable[[], object], nbytes: int, repeats: int, timeout: float) -> float:
    """Seconds of one synchronous step as the allreduce topology takes it: `step()` (the
    model's forward and backward), then an in-place `Iallreduce` of `nbytes`, waited for as
    a run waits (mean of `repeats` after two)."""
    buffer = np.ones(max(1, nbytes // 4), np.float32)
    started = 0.0
    for i in range(repeats + 2):
        if i == 2:
            started = time.perf_counter()
        step()
        wait_all([comm.Iallreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)], timeout=timeout)
    return (time.perf_counter() - started) / repeats


def posted_test_seconds(comm: Any, clients: int, repeats: int) -> float:
    """Seconds a master spends per client looking at one posted header receive that has not
    completed (its loop's `test_each` over every client, once per pass)."""
    buffers = [np.zeros(16, np.float32) for _ in range(clients)]
    requests = [comm.Irecv(b, source=comm.Get_rank(), tag=_TAG + 1) for b in buffers]
    try:
        started = time.perf_counter()
        for _ in range(repeats):
            test_each(requests)
        return (time.perf_counter() - started) / repeats / clients
    finally:
        for request in requests:
            request.Cancel()
        MPI.Request.Waitall(requests)
