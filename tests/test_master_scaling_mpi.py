"""A master with many workers stays bounded: the records a run writes per second do not
grow with its update rate (one 'updates' summary per interval, not one record per update)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from nbdist.metrics import read_log

ROOT = Path(__file__).resolve().parent.parent
MLP = str(ROOT / "examples" / "digits_mlp.py")
WORKERS = 16
# Records that come per interval, per rank (throughput, resources, a master's phases and
# update summaries): at most a few a second each, however fast the master updates.
PER_RANK_PER_SECOND = 4
# Records that follow the data (one per epoch or validation) or the run's events.
PACED_BY_DATA = {"epoch", "val", "run", "fault", "restart"}


@pytest.fixture(scope="module")
def sixteen_workers(tmp_path_factory):
    """16 asynchronous Downpour workers pushing every batch of 8: the master applies
    updates far faster than any per-interval record rate."""
    from conftest import run_mpi

    runs = tmp_path_factory.mktemp("w16")
    done = run_mpi(WORKERS + 1, ["-m", "nbdist", "train", "--model", MLP, "--epochs", "30", "--batch-size", "8",
                                 "--runs-dir", str(runs), "--run-name", "w16", "--store", "off", "--quiet"],
                   timeout=400)
    assert done.returncode == 0, done.output[-4000:]
    return list(read_log(runs / "w16"))


@pytest.mark.timeout(600)
def test_records_per_second_stay_bounded_with_16_workers_pushing_every_batch(sixteen_workers):
    records = sixteen_workers
    kinds = Counter(r["kind"] for r in records)
    assert kinds["update"] == 0, "one record per update without --trace-updates"
    times = [r["time"] for r in records]
    seconds = max(times) - min(times)
    summaries = [r["values"] for r in records if r["kind"] == "updates"]
    applied = sum(v["updates"] for v in summaries)
    # Nothing is lost in the summaries: they count every version of the centre, in order.
    assert [v["first_version"] for v in summaries] == [1] + [v["version"] + 1 for v in summaries[:-1]]
    assert applied == summaries[-1]["version"]
    assert {rank for v in summaries for rank, _, _ in v["histogram"]} == set(range(1, WORKERS + 1))
    bound = PER_RANK_PER_SECOND * (WORKERS + 1)
    interval_records = sum(n for kind, n in kinds.items() if kind not in PACED_BY_DATA)
    assert interval_records / seconds <= bound, (kinds, seconds)
    # The premise: a record per update would have been far beyond the bound.
    assert applied / seconds > 2 * bound, (applied, seconds)
