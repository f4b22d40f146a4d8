"""Resuming on another layout, without MPI: the layout that fits a size, which share each
rank of the new layout loads, the note that says what changed, and the checkpoints that no
layout can resume (train/relayout.py). The runs themselves: tests/test_resume_anywhere_mpi.py."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nbdist.layout import Layout, LayoutError
from nbdist.train.checkpoint import CheckpointError, Checkpoints
from nbdist.train.relayout import Share, centre_share, change_note, check_resumable, plan_shares

MW = "master-worker"


@pytest.mark.parametrize(
    "size, masters, expect",
    [
        (6, 2, "6 ranks: 2 masters x (1 + 2 workers)"),
        (5, 2, "5 ranks: 1 master + 4 workers"),  # a sub-master lost: 2 masters do not fit
        (4, 2, "4 ranks: 2 masters x (1 + 1 worker)"),
        (7, 3, "7 ranks: 1 master + 6 workers"),
        (8, 3, "8 ranks: 2 masters x (1 + 3 workers)"),
        (3, 1, "3 ranks: 1 master + 2 workers"),
    ],
)
def test_a_layout_anew_takes_the_most_masters_that_fit(size, masters, expect):
    assert Layout.fitting(size, masters=masters).describe() == expect


def test_no_layout_fits_is_the_error_for_the_masters_asked_for():
    with pytest.raises(LayoutError, match=r"^3 ranks cannot be laid out as W workers of 2 processes"):
        Layout.fitting(3, masters=1, topology="allreduce", procs_per_worker=2)
    with pytest.raises(
        LayoutError, match=r"^4 ranks cannot be laid out as 2 masters x \(1 \+ W workers of 2 processes\)"
    ):
        Layout.fitting(4, masters=2, procs_per_worker=2)


def _mw(size: int, masters: int = 1, **kw) -> Layout:
    return Layout.for_world(size, masters=masters, **kw)


def test_more_workers_the_new_ones_start_from_the_centre():
    old, new = _mw(3), _mw(5)
    plans = plan_shares(old, new)
    assert plans == [Share(0), Share(1), Share(2), Share(None), Share(None)]
    assert change_note(old, new, plans, 5, restart=False) == (
        "resuming a checkpoint of 3 ranks (1 master + 2 workers) on 5 ranks (1 master + 4 workers): "
        "the workers on ranks 3-4 start from their master's centre; every worker starts epoch 6 from its first batch"
    )


def test_fewer_workers_the_others_state_is_dropped():
    old, new = _mw(5), _mw(3)
    plans = plan_shares(old, new)
    assert plans == [Share(0), Share(1), Share(2)]
    note = change_note(old, new, plans, 0, restart=False)
    assert "the checkpoint's workers on ranks 3-4 are not resumed (their own state is dropped)" in note


def test_workers_are_counted_over_all_masters():
    """2 masters x (1 + 2 workers) -> 1 master + 4 workers: worker k keeps worker k's share,
    the sub-master's share is dropped; and back: a new sub-master from the top's centre."""
    two, one = _mw(6, 2), _mw(5)
    assert plan_shares(two, one) == [Share(0), Share(1), Share(2), Share(4), Share(5)]
    note = change_note(two, one, plan_shares(two, one), 3, restart=False)
    assert "the updates of sub-master 1 not yet pushed to the top master are dropped" in note
    back = plan_shares(one, two)
    assert back == [Share(0), Share(1), Share(2), Share(None), Share(3), Share(4)]
    assert "sub-master 1 starts from the top master's centre" in change_note(one, two, back, 3, restart=False)
    assert centre_share(one, 1) == 0 and centre_share(two, 1) == 3


def test_a_restart_keeps_each_surviving_process_its_own_share():
    """The sub-master (world rank 3) died: its workers, now workers of the top master, keep
    their own shares; a note says what the restart dropped."""
    old, new = _mw(6, 2), Layout.fitting(5, masters=2)
    plans = plan_shares(old, new, ([0, 1, 2, 3, 4, 5], [0, 1, 2, 4, 5]))
    assert plans == [Share(0), Share(1), Share(2), Share(4), Share(5)]
    # A worker died (world rank 1): the survivors keep theirs, not the dead one's.
    plans = plan_shares(_mw(4), _mw(3), ([0, 1, 2, 3], [0, 2, 3]))
    assert plans == [Share(0), Share(2), Share(3)]
    note = change_note(_mw(4), _mw(3), plans, 2, restart=True)
    assert note.startswith("restarting from a checkpoint of 4 ranks (1 master + 3 workers) on 3 ranks")
    assert "the checkpoint's workers on rank 1 are not resumed" in note
    # A worker died under 2 masters: the sub-master (world rank 3) becomes a worker; the
    # share at its place is rank 2's, which rank 2 keeps: it starts from the centre.
    plans = plan_shares(_mw(6, 2), _mw(5), ([0, 1, 2, 3, 4, 5], [0, 2, 3, 4, 5]))
    assert plans == [Share(0), Share(2), Share(None), Share(4), Share(5)]
    # The master died: a worker becomes the master, which loads the master's share.
    assert plan_shares(_mw(3), _mw(2), ([0, 1, 2], [1, 2]))[0] == Share(0)


def test_new_allreduce_replicas_take_replica_0s_weights_and_optimiser():
    old, new = Layout.for_world(2, topology="allreduce"), Layout.for_world(4, topology="allreduce")
    plans = plan_shares(old, new)
    assert plans == [Share(0), Share(1), Share(0, partial=True), Share(0, partial=True)]
    assert "ranks 2-3 start from replica 0's weights and optimiser state" in change_note(old, new, plans, 1, False)
    assert plan_shares(new, old) == [Share(0), Share(1)]


def test_pipeline_stages_keep_their_stage():
    kw = dict(topology="allreduce", procs_per_worker=2)
    old, new = Layout.for_world(4, **kw), Layout.for_world(6, **kw)  # 2 then 3 replicas of 2 stages
    plans = plan_shares(old, new, pipeline=True)
    assert plans[:4] == [Share(0), Share(1), Share(2), Share(3)]
    assert plans[4:] == [Share(0, partial=True), Share(1, partial=True)]  # replica 0's stage 0, stage 1
    # Master-worker pipelines: a new worker's stages start from the master's centre.
    plans = plan_shares(_mw(3, procs_per_worker=2), _mw(5, procs_per_worker=2), pipeline=True)
    assert plans == [Share(0), Share(1), Share(2), Share(None), Share(None)]
    with pytest.raises(
        CheckpointError, match="pipelines have 2 stages, this run's 3: resume with --procs-per-worker 2"
    ):
        plan_shares(_mw(5, procs_per_worker=2), _mw(7, procs_per_worker=3), pipeline=True)


def test_a_worker_of_more_processes_gives_its_new_ones_its_leaders_weights():
    plans = plan_shares(_mw(3), _mw(5, procs_per_worker=2))
    assert plans == [Share(0), Share(1), Share(1, partial=True), Share(2), Share(2, partial=True)]


def test_another_topology_is_refused():
    with pytest.raises(CheckpointError, match="written by a master-worker run, this run is allreduce"):
        plan_shares(_mw(3), Layout.for_world(3, topology="allreduce"))


def _checkpoint(run, label: str, layout: Layout, ranks: list[int]) -> Checkpoints:
    ckpt = Checkpoints(run)
    for rank in ranks:
        arrays = {"model": {"params": np.full(4, rank, np.float32)}}
        ckpt.write_rank(label, rank, arrays, {"rank": rank, "next_epoch": int(label[-1])})
    ckpt.commit(label, {"label": label, "layout": layout.to_dict()})
    return ckpt


def test_a_checkpoint_without_a_sub_masters_share_is_passed_over_with_one_line(tmp_path):
    """What an asynchronous --masters 2 run used to end with: the top master committed its
    last checkpoint without the sub-master's share. A resume says so and takes the one before."""
    two = _mw(6, 2)
    _checkpoint(tmp_path, "epoch-0001", two, list(range(6)))
    ckpt = _checkpoint(tmp_path, "epoch-0002", two, [0, 1, 2, 4, 5])
    last = tmp_path / "checkpoints" / "epoch-0002"
    assert Checkpoints.damage(last) is None  # every file it lists is intact
    assert check_resumable(last) == "it holds no state for sub-master 1 (rank 3)"
    path, problems = ckpt.latest_intact(check_resumable)
    assert path == tmp_path / "checkpoints" / "epoch-0001"
    assert problems == [f"checkpoint {last} cannot be resumed: it holds no state for sub-master 1 (rank 3)"]
    meta = json.loads((last / "meta.json").read_text())
    assert "rank-00003.json" not in meta["files"]


def test_an_allreduce_checkpoint_needs_replica_0(tmp_path):
    layout = Layout.for_world(3, topology="allreduce")
    _checkpoint(tmp_path, "epoch-0001", layout, [1, 2])
    assert (
        check_resumable(tmp_path / "checkpoints" / "epoch-0001")
        == "it holds no state for replica 0, process 0 (rank 0)"
    )


def test_a_restart_uses_as_many_ranks_as_whole_workers_fit():
    assert Layout.within(5, masters=2).describe() == "5 ranks: 1 master + 4 workers"
    assert Layout.within(4, procs_per_worker=2).describe() == "3 ranks: 1 master + 1 worker of 2 processes"
    pipelines = Layout.within(3, topology="allreduce", procs_per_worker=2)
    assert pipelines.describe() == "2 ranks: 1 worker of 2 processes"
    with pytest.raises(LayoutError, match="^1 rank cannot be laid out as W workers of 2 processes"):
        Layout.within(1, topology="allreduce", procs_per_worker=2)
