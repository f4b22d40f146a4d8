"""Metric logs and the store's recorder after crashes, without MPI: a torn last line is cut
before a resumed run appends, every reader skips a line that is not a record and says so,
and the recorder outlives a store locked by another writer (a real second SQLite
connection holding the write lock past the recorder's wait) and records the run's end."""

from __future__ import annotations

import json
import sqlite3
import threading
import time

import pytest

from nbdist.metrics import RunLog, read_log
from nbdist.metrics.log import repair_torn_tail
from nbdist.store import RunStore, ingest
from nbdist.store.ingest import LogFollower, RunRecorder


def _log_with_records(run_dir, rank: int, n: int) -> RunLog:
    log = RunLog(run_dir, "run", rank, "worker")
    for step in range(n):
        log.emit("train", {"loss": 1.0 / (step + 1)}, step=step)
    log.flush()
    return log


def test_a_torn_last_line_is_cut_before_a_resumed_run_appends(tmp_path, capfd):
    _log_with_records(tmp_path, 1, 5).close()
    path = tmp_path / "metrics" / "rank-00001.jsonl"
    whole = path.read_bytes()
    # A rank killed half-way through its last record: cut inside that line.
    last_start = whole.rstrip(b"\n").rfind(b"\n") + 1
    torn_at = last_start + 17
    path.write_bytes(whole[:torn_at])

    resumed = _log_with_records(tmp_path, 1, 3)
    resumed.close()
    err = capfd.readouterr().err
    assert f"{path} ended in a torn record (17 bytes with no newline" in err, err
    lines = path.read_text().splitlines()
    records = [json.loads(line) for line in lines]  # every line is a whole record
    assert len(records) == 4 + 3
    # Its records go on counting after the four whole ones.
    assert [r["seq"] for r in records] == list(range(7))


def test_repair_leaves_a_whole_log_alone(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_bytes(b'{"a": 1}\n{"b": 2}\n')
    assert repair_torn_tail(path) == 0
    assert path.read_bytes() == b'{"a": 1}\n{"b": 2}\n'
    assert repair_torn_tail(tmp_path / "missing.jsonl") == 0
    path.write_bytes(b"no newline at all")
    assert repair_torn_tail(path) == len(b"no newline at all")
    assert path.read_bytes() == b""


def test_readers_skip_a_damaged_line_and_say_so(tmp_path, capfd):
    _log_with_records(tmp_path, 0, 3).close()
    path = tmp_path / "metrics" / "rank-00000.jsonl"
    lines = path.read_text().splitlines()
    # What an nbdist before the repair left: a torn record with the next one glued on.
    lines.insert(1, lines[1][:20] + lines[2])
    lines.append("[1, 2, 3]")  # valid JSON, but no record
    path.write_text("\n".join(lines) + "\n")

    assert [r["step"] for r in read_log(tmp_path, "train")] == [0, 1, 2]
    err = capfd.readouterr().err
    assert f"{path}: skipped 2 lines (the first: line 2) that are not a whole record" in err, err

    follower = LogFollower(tmp_path)
    assert [r["step"] for r in follower.poll()] == [0, 1, 2]
    assert "skipped 2 lines (the first: line 2)" in capfd.readouterr().err
    with open(path, "a") as fh:
        fh.write("garbage\n" + lines[0] + "\n")
    assert [r["step"] for r in follower.poll()] == [0]  # the same record again: the store keeps it once
    assert f"{path}: skipped line 6 that is not a whole record" in capfd.readouterr().err


@pytest.mark.timeout(120)
def test_the_recorder_outlives_a_locked_store_and_records_the_end(tmp_path, capfd, monkeypatch):
    # A shorter wait for the lock than a run's, to keep the test cheap; tests/test_store.py
    # runs a real batch run against the real one.
    monkeypatch.setattr(ingest, "RECORDER_LOCK_WAIT", 0.5)
    run_dir = tmp_path / "run"
    db = tmp_path / "nbdist.db"
    log = _log_with_records(run_dir, 0, 4)
    recorder = RunRecorder(db, "run", run_dir, options={}, layout={}, every=0.05)
    with RunStore(db) as store:
        deadline = time.monotonic() + 30
        while len(store.records("run")[0]) < 4:
            assert time.monotonic() < deadline, "the recorder stored nothing"
            time.sleep(0.05)

    # Another writer takes the write lock and keeps it past the recorder's wait.
    blocker = sqlite3.connect(db, isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    for step in range(4, 10):
        log.emit("train", {"loss": 0.1}, step=step)
    log.flush()
    deadline = time.monotonic() + ingest.RECORDER_LOCK_WAIT + 30
    err = ""
    while "cannot take this run's records now" not in err:
        assert time.monotonic() < deadline, "the recorder said nothing of the locked store"
        time.sleep(0.1)
        err += capfd.readouterr().err
    assert "database is locked" in err, err
    assert recorder._thread.is_alive()
    # Still locked a while longer: the recorder keeps trying (and says nothing more).
    time.sleep(1.0)
    blocker.execute("COMMIT")
    blocker.close()

    log.emit("run", {"status": "completed"}, step=10)
    log.close()
    ending = threading.Thread(target=recorder.finish, args=("completed", "completed 1 epochs", {"val_acc": 0.9}))
    ending.start()
    ending.join(timeout=60)
    assert not ending.is_alive(), "the run's end was not recorded within 60 s"
    err += capfd.readouterr().err
    assert err.count("cannot take this run's records now") == 1, err
    with RunStore(db) as store:
        row = store.run("run")
        assert row.status == "completed" and row.final == {"val_acc": 0.9}, row
        assert sorted(r["step"] for r in store.records("run")[0] if r["kind"] == "train") == list(range(10))
