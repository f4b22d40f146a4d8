"""How a rank waits: polling between sleeps, or without sleeping where the node's ranks
fit its cores (--busy-poll), and always within its deadline."""

from __future__ import annotations

import os

import pytest

from nbdist.transport import waiting
from nbdist.transport.node import ranks_fit_cores


@pytest.fixture
def sleeps(monkeypatch):
    """The sleeps the waits of this test take."""
    taken: list[float] = []
    monkeypatch.setattr(waiting.time, "sleep", taken.append)
    yield taken
    waiting.poll_without_sleeping(False)


def test_a_wait_sleeps_between_polls_by_default_and_never_when_told_to_poll(sleeps):
    with pytest.raises(waiting.WaitTimeout):
        waiting.wait_for(lambda: False, timeout=0.05)
    assert sleeps and max(sleeps) <= waiting.LONGEST_SLEEP
    sleeps.clear()
    waiting.poll_without_sleeping(True)
    with pytest.raises(waiting.WaitTimeout):  # polling still ends at the deadline
        waiting.wait_for(lambda: False, timeout=0.05)
    assert sleeps == []
    waiting.poll_without_sleeping(False)
    with pytest.raises(waiting.WaitTimeout):
        waiting.wait_for(lambda: False, timeout=0.05)
    assert sleeps


@pytest.mark.parametrize(("ranks", "threads", "fit"), [("1", 1, True), ("CORES", 1, True), ("MORE", 1, False),
                                                       ("CORES", 2, False), (None, 1, False), ("", 1, False)])
def test_ranks_fit_cores_counts_the_launchers_ranks_on_the_node_against_the_usable_cores(
        monkeypatch, ranks, threads, fit):
    cores = len(os.sched_getaffinity(0))
    value = {"CORES": str(cores), "MORE": str(cores + 1)}.get(ranks, ranks)
    if value is None:
        monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_SIZE", raising=False)
    else:
        monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", value)
    assert ranks_fit_cores(threads) is fit
