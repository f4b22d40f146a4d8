"""The dashboard's data side, without a browser: records in, new rows per view out."""

from __future__ import annotations

import pytest

pytest.importorskip("pandas")

from nbdist.dashboard.frames import RunFrames, phase_parts


def _rec(kind, rank, t, role="worker", **values):
    return {
        "run": "r",
        "trial": None,
        "rank": rank,
        "role": role,
        "kind": kind,
        "step": 0,
        "epoch": 0,
        "time": t,
        "values": values,
        "seq": 0,
    }


def test_phase_parts_put_each_timed_part_in_its_phase():
    assert phase_parts({"compute_s": 0.3, "send_s": 0.1, "wait_s": 0.2}, "worker") == {
        "compute": 0.3,
        "communicate": 0.1,
        "wait": 0.2,
    }
    # An allreduce rank's wait is its wait for the reduction: communication.
    assert phase_parts({"compute_s": 0.3, "update_s": 0.05, "wait_s": 0.2}, "allreduce") == {
        "compute": 0.35,
        "communicate": 0.2,
        "wait": 0.0,
    }
    assert phase_parts({"wait": 1.0, "update": 0.5, "reply": 0.25, "validate": 0.25}, "master") == {
        "compute": 0.75,
        "communicate": 0.25,
        "wait": 1.0,
    }


def test_throughput_total_and_samples_seen_accumulate_across_batches():
    frames = RunFrames("master-worker", t0=100.0)
    first = frames.ingest(
        [
            _rec("train", 1, 101.0, samples=64, samples_per_s=100.0, loss=2.0, acc=0.1),
            _rec("train", 2, 101.5, samples=32, samples_per_s=50.0, loss=1.0, acc=0.2),
        ]
    )
    assert first.throughput[1].values.tolist() == [[1.0, 100.0]]
    assert first.total_throughput["samples_per_s"].tolist() == [100.0, 150.0]
    assert first.train_loss[["samples_seen", "loss", "metric"]].values.tolist() == [[64, 2.0, 0.1], [96, 1.0, 0.2]]
    assert first.bytes_sent == {}  # records from before --compression carry no bytes
    second = frames.ingest([_rec("train", 1, 102.0, samples=64, samples_per_s=80.0, loss=0.5, acc=0.5)])
    # Only the new point; the total uses rank 2's latest rate.
    assert second.throughput == {1: second.throughput[1]} and len(second.throughput[1]) == 1
    assert second.total_throughput["samples_per_s"].tolist() == [130.0]
    assert second.train_loss["samples_seen"].tolist() == [160]


def test_bytes_sent_add_up_per_rank():
    frames = RunFrames("allreduce", t0=0.0)
    first = frames.ingest(
        [
            _rec("train", 0, 1.0, samples=32, samples_per_s=10.0, bytes_sent=2_000_000),
            _rec("train", 1, 1.0, samples=32, samples_per_s=10.0, bytes_sent=500_000),
        ]
    )
    second = frames.ingest([_rec("train", 0, 2.0, samples=32, samples_per_s=10.0, bytes_sent=1_000_000)])
    assert first.bytes_sent[0].values.tolist() == [[1.0, 2.0]] and first.bytes_sent[1].values.tolist() == [[1.0, 0.5]]
    assert second.bytes_sent[0].values.tolist() == [[2.0, 3.0]] and list(second.bytes_sent) == [0]
    assert frames.metric_name is None  # bytes_sent is not mistaken for the model's metric


def test_staleness_points_per_worker_and_the_distribution():
    frames = RunFrames("master-worker", t0=0.0)
    updates = [_rec("update", 0, 1.0 + i / 10, role="master", source_rank=1 + i % 2, staleness=i % 3) for i in range(6)]
    out = frames.ingest(updates)
    # One point per worker per second of the run: the mean and the max of its staleness.
    assert out.staleness[1][["staleness", "max"]].values.tolist() == [[(0 + 2 + 1) / 3, 2]]
    assert out.staleness[2][["staleness", "max"]].values.tolist() == [[(1 + 0 + 2) / 3, 2]]
    counts = {(r, s): c for r, s, c in out.staleness_counts.values.tolist()}
    assert counts == {(1, 0): 1, (1, 1): 1, (1, 2): 1, (2, 0): 1, (2, 1): 1, (2, 2): 1}
    more = frames.ingest([_rec("update", 0, 2.0, role="master", source_rank=1, staleness=2)])
    assert {(r, s): c for r, s, c in more.staleness_counts.values.tolist()}[(1, 2)] == 2


def test_a_runs_updates_read_at_once_draw_a_line_per_worker_not_a_point():
    """A finished run's page and an export read every record in one batch: the points are
    per second of the run (they were per batch read: one point per worker, no line)."""
    from nbdist.dashboard.frames import STALENESS_POINT_SECONDS

    assert STALENESS_POINT_SECONDS == 1.0
    times = [0.2, 0.7, 1.3, 2.1, 2.4, 2.9]
    updates = [_rec("update", 0, t, role="master", source_rank=1, staleness=i) for i, t in enumerate(times)]
    out = RunFrames("master-worker", t0=0.0).ingest(updates)
    assert out.staleness[1].values.tolist() == [[0.7, 0.5, 1], [1.3, 2.0, 2], [2.9, 4.0, 5]]
    assert out.staleness_mean.values.tolist() == [[0.7, 0.5], [1.3, 2.0], [2.9, 4.0]]


def test_a_masters_update_summaries_draw_what_its_single_updates_draw():
    """The 'updates' record a master sends per interval (UpdateSummary) gives the dashboard
    the same per-worker points and distribution as one 'update' record per update."""
    from nbdist.metrics import UpdateSummary

    applied = [(1 + i % 3, (i * 7) % 4) for i in range(30)]  # (source rank, staleness)
    singles = [_rec("update", 0, 1.0, role="master", source_rank=r, staleness=s) for r, s in applied]
    summary = UpdateSummary()
    for version, (rank, staleness) in enumerate(applied, start=1):
        summary.add(rank, staleness, version)
    values = summary.take(len(applied))
    assert (values["updates"], values["first_version"], values["version"]) == (30, 1, 30)
    assert values["staleness_max"] == 3 and summary.take(31) is None  # taken: a fresh interval
    from_singles = RunFrames("master-worker", t0=0.0).ingest(singles)
    from_summary = RunFrames("master-worker", t0=0.0).ingest([_rec("updates", 0, 1.0, role="master", **values)])
    for rank in (1, 2, 3):
        assert from_summary.staleness[rank].values.ravel().tolist() == pytest.approx(
            from_singles.staleness[rank].values.ravel().tolist()
        )
    assert from_summary.staleness_counts.values.tolist() == from_singles.staleness_counts.values.tolist()
    assert from_summary.staleness_mean.values.ravel().tolist() == pytest.approx(
        from_singles.staleness_mean.values.ravel().tolist()
    )
    assert from_summary.staleness_mean["staleness"].iloc[0] == pytest.approx(values["staleness_mean"])
    # With --trace-updates a run has both; its traced records are counted by the summary, once.
    traced = [{**r, "values": {**r["values"], "traced": True}} for r in singles]
    from_both = RunFrames("master-worker", t0=0.0).ingest(traced + [_rec("updates", 0, 1.0, role="master", **values)])
    assert from_both.staleness_counts.values.tolist() == from_singles.staleness_counts.values.tolist()


def test_timeline_segments_tile_each_interval_by_phase():
    frames = RunFrames("master-worker", t0=0.0)
    frames.ingest([_rec("train", 1, 1.0, samples=1, samples_per_s=1, compute_s=0.5, send_s=0.1, wait_s=0.2)])
    out = frames.ingest([_rec("train", 1, 2.0, samples=1, samples_per_s=1, compute_s=0.6, send_s=0.2, wait_s=0.2)])
    segments = out.timeline[["x0", "x1", "phase"]].values.tolist()
    assert [p for *_, p in segments] == ["compute", "communicate", "wait"]
    assert segments[0][0] == pytest.approx(1.0) and segments[-1][1] == pytest.approx(2.0)
    assert [round(x1 - x0, 6) for x0, x1, _ in segments] == [0.6, 0.2, 0.2]
    # A master's phase records are running totals: its segments are their increments.
    master = RunFrames("master-worker", t0=0.0)
    master.ingest([_rec("phase", 0, 1.0, role="master", wait=0.5, update=0.3, reply=0.1, validate=0.0)])
    out = master.ingest([_rec("phase", 0, 2.0, role="master", wait=1.0, update=0.6, reply=0.3, validate=0.0)])
    assert {p: round(x1 - x0, 6) for x0, x1, p in out.timeline[["x0", "x1", "phase"]].values.tolist()} == {
        "compute": 0.3,
        "communicate": 0.2,
        "wait": 0.5,
    }


def test_epochs_carry_samples_seen_and_time():
    frames = RunFrames("allreduce", t0=10.0)
    out = frames.ingest(
        [
            _rec("epoch", 0, 12.0, epoch=1, samples=1000, val_loss=0.5, val_acc=0.8),
            _rec("epoch", 0, 14.0, epoch=2, samples=1000, val_loss=0.3, val_acc=0.9),
        ]
    )
    assert out.epochs[["epoch", "t", "samples_seen", "val_acc"]].values.tolist() == [
        [1, 2.0, 1000, 0.8],
        [2, 4.0, 2000, 0.9],
    ]


def test_a_gans_records_feed_its_own_view():
    frames = RunFrames("master-worker", t0=0.0)
    out = frames.ingest(
        [
            _rec(
                "train",
                1,
                1.0,
                samples=32,
                samples_per_s=10.0,
                loss=0.7,
                d_loss=0.7,
                g_loss=1.2,
                d_real=0.6,
                d_fake=0.3,
                mmd=0.2,
            )
        ]
    )
    assert out.gan[["samples_seen", "d_loss", "g_loss", "d_real", "d_fake"]].values.tolist() == [
        [32, 0.7, 1.2, 0.6, 0.3]
    ]
    # A model's metric is what the record has besides the known keys, not a GAN's numbers.
    assert frames.metric_name == "mmd"
    assert RunFrames().ingest([_rec("train", 1, 1.0, samples=1, samples_per_s=1.0, loss=0.1, acc=0.5)]).gan is None


def test_dropped_workers_and_restarts_are_events_and_leave_the_total_throughput():
    frames = RunFrames("master-worker", t0=100.0)
    frames.ingest(
        [
            _rec("train", 1, 101.0, samples=64, samples_per_s=100.0, loss=2.0, acc=0.1),
            _rec("train", 2, 101.5, samples=32, samples_per_s=50.0, loss=1.0, acc=0.2),
        ]
    )
    # The master's record of its worker 1 (rank 2): values name the dropped rank and its role.
    fault = _rec("fault", 0, 103.0, role="master", worker=1, cause="died", workers_left=1, host="node7")
    fault["values"].update(rank=2, role="worker")
    lost = frames.ingest(
        [
            fault,
            _rec("restart", 0, 104.0, attempt=1, ranks=3, layout="3 ranks: 3 workers", checkpoint="epoch-0004"),
            _rec("restart", 1, 104.0, attempt=1, ranks=3, layout="3 ranks: 3 workers", checkpoint="epoch-0004"),
        ]
    )
    assert [text for _, text in lost.events] == [
        "rank 2 (worker 1, host node7) died: dropped, 1 workers go on",
        "restart 1 on 3 ranks (3 ranks: 3 workers), from checkpoint epoch-0004",
    ]
    after = frames.ingest([_rec("train", 1, 105.0, samples=64, samples_per_s=90.0, loss=0.5, acc=0.5)])
    assert after.total_throughput["samples_per_s"].tolist() == [90.0]  # rank 2 no longer counted
