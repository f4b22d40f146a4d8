"""How a rank waits: polling between sleeps, or without sleeping where the node's ranks
fit its cores (--busy-poll), and always within its deadline."""

from __future__ import annotations

import os

import pytest

from nbdist.transport import waiting
from nbdist.transport.node import polling_suits_node, ranks_fit_cores


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


@pytest.mark.parametrize(
    ("ranks", "threads", "fit"),
    [("1", 1, True), ("CORES", 1, True), ("MORE", 1, False), ("CORES", 2, False), (None, 1, False), ("", 1, False)],
)
def test_ranks_fit_cores_counts_the_launchers_ranks_on_the_node_against_the_usable_cores(
    monkeypatch, ranks, threads, fit
):
    cores = len(os.sched_getaffinity(0))
    value = {"CORES": str(cores), "MORE": str(cores + 1)}.get(ranks, ranks)
    if value is None:
        monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_SIZE", raising=False)
    else:
        monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", value)
    assert ranks_fit_cores(threads) is fit


@pytest.mark.parametrize(("hub", "job", "polls"), [(None, None, True), ("ada", None, False), ("ada", "123", True)])
def test_auto_keeps_a_notebooks_ranks_on_a_shared_login_node_sleeping(monkeypatch, hub, job, polls):
    """Under JupyterHub the node is a login node shared with others, unless the server
    runs inside a batch job (batchspawner), whose allocation is the user's."""
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "1")
    for name, value in (("JUPYTERHUB_USER", hub), ("SLURM_JOB_ID", job), ("PBS_JOBID", None)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert polling_suits_node() is polls
