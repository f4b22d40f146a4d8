"""The run store: its schema and version guard, records kept once, killed runs, trials;
and real batch runs under mpiexec landing in it complete."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sqlite3
import subprocess
import time
from collections import Counter

import pytest
from conftest import ROOT

from nbdist.launch import mpi_env, mpiexec_command
from nbdist.metrics import read_log
from nbdist.store import SCHEMA_VERSION, RunStore, StoreError, import_run


def _record(run: str, rank: int, seq: int, kind: str = "train", **values) -> dict:
    return {
        "run": run,
        "trial": None,
        "rank": rank,
        "role": "worker",
        "kind": kind,
        "step": seq,
        "epoch": 0,
        "time": 1000.0 + seq,
        "values": values or {"loss": 1.0 / (seq + 1)},
        "seq": seq,
    }


def test_records_are_kept_once_and_polled_in_order(tmp_path):
    with RunStore(tmp_path / "s.db") as store:
        store.begin_run("r1", run_dir=tmp_path, options={"epochs": 2}, layout={"workers": 2})
        assert store.add_records([_record("r1", 0, i) for i in range(3)]) == 3
        # The same records again (a log read twice), plus one new: only the new one lands.
        assert store.add_records([_record("r1", 0, i) for i in range(4)]) == 1
        first, last = store.records("r1")
        assert [r["seq"] for r in first] == [0, 1, 2, 3] and first[0]["values"] == {"loss": 1.0}
        store.add_records([_record("r1", 1, 0, kind="update", staleness=2)])
        new, last2 = store.records("r1", after=last)
        assert [(r["rank"], r["kind"], r["values"]["staleness"]) for r in new] == [(1, "update", 2)]
        assert store.records("r1", after=last2) == ([], last2)
        assert [r["kind"] for r in store.records("r1", kinds=["update"])[0]] == ["update"]
        store.end_run("r1", "completed", "completed 2 epochs", {"val_acc": 0.9})
        run = store.run("r1")
        assert (run.status, run.final, run.options, run.layout) == (
            "completed",
            {"val_acc": 0.9},
            {"epochs": 2},
            {"workers": 2},
        )


def test_a_store_from_a_newer_nbdist_is_refused(tmp_path):
    path = tmp_path / "new.db"
    RunStore(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(StoreError) as caught:
        RunStore(path)
    assert str(caught.value) == (
        f"the run store {path} was written by a newer nbdist (schema {SCHEMA_VERSION + 1}; this nbdist reads "
        f"up to {SCHEMA_VERSION}): upgrade nbdist, or give another --store"
    )


def test_a_file_that_is_not_a_store_is_refused(tmp_path):
    path = tmp_path / "notes.db"
    path.write_text("these are my notes, not a database\n" * 100)
    with pytest.raises(StoreError, match="is not an nbdist run store"):
        RunStore(path)
    with pytest.raises(StoreError, match="no run store at"):
        RunStore(tmp_path / "missing.db", create=False)


def _open_store_when_told(path, go, answers):
    go.wait(30)
    try:
        RunStore(path).close()
        answers.put("opened")
    except StoreError as exc:
        answers.put(str(exc))


def test_processes_opening_one_new_store_at_the_same_moment_all_open_it(tmp_path):
    """Two coordinators of one study start together: switching a new SQLite file to WAL
    takes its exclusive lock, and SQLite refuses the loser at once rather than waiting."""
    fork = multiprocessing.get_context("fork")
    for attempt in range(25):
        path = str(tmp_path / f"s{attempt}.db")
        go, answers = fork.Event(), fork.Queue()
        procs = [fork.Process(target=_open_store_when_told, args=(path, go, answers)) for _ in range(3)]
        for proc in procs:
            proc.start()
        go.set()
        said = [answers.get(timeout=60) for _ in procs]
        for proc in procs:
            proc.join(30)
        assert said == ["opened"] * 3, f"attempt {attempt}: {said}"


def test_runs_whose_writer_vanished_are_marked_killed(tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    with RunStore(tmp_path / "s.db") as store:
        store.begin_run("alive", run_dir=None, options={}, layout={})
        store.begin_run("gone", run_dir=None, options={}, layout={})
        store.begin_run("silent", run_dir=None, options={}, layout={})
        store._db.execute("UPDATE runs SET pid = ? WHERE id = 'gone'", (gone.pid,))
        store._db.execute("UPDATE runs SET host = 'node17', heartbeat = ? WHERE id = 'silent'", (time.time() - 3600,))
        states = {r.id: r.status for r in store.runs()}
        assert states == {"alive": "running", "gone": "killed", "silent": "killed"}
        assert "killed" in store.run("gone").reason
        # A writer that was only paused comes back to life with its next heartbeat.
        store.heartbeat("silent")
        assert store.run("silent").status == "running"


def test_trials_and_studies_round_trip(tmp_path):
    with RunStore(tmp_path / "s.db") as store:
        store.begin_study(
            "st",
            searcher="evolution",
            space={"lr": "log(1e-4,1e-1)"},
            options={"trials": 4},
            objective="val_loss",
            direction="minimize",
        )
        store.record_trial("st", 0, params={"lr": 0.01}, state="running", generation=0, group=1, started=5.0)
        store.record_trial(
            "st",
            0,
            params={"lr": 0.01},
            state="complete",
            fom=0.3,
            fom_std=0.02,
            folds=[0.28, 0.32],
            generation=0,
            group=1,
            ended=9.0,
        )
        store.record_trial("st", 1, params={"lr": 0.1}, state="failed", error="NaN loss")
        store.save_searcher_state("st", {"generation": 1})
        trials = store.trials("st")
        assert [(t.number, t.state, t.fom, t.folds, t.started, t.ended) for t in trials] == [
            (0, "complete", 0.3, [0.28, 0.32], 5.0, 9.0),
            (1, "failed", None, [], None, None),
        ]
        assert trials[1].error == "NaN loss"
        assert store.study("st")["searcher_state"] == {"generation": 1}


def test_a_studys_digest_changes_with_its_rows_and_events_are_read_from_a_time(tmp_path):
    with RunStore(tmp_path / "s.db") as store:
        store.begin_study("st", searcher="random", space={}, options={}, objective="val_loss", direction="minimize")
        digests = [store.study_digest("st")]
        store.record_trial("st", 0, params={"lr": 0.01}, state="paused", fom=0.5, epochs=1)
        digests.append(store.study_digest("st"))
        store.record_trial("st", 0, params={"lr": 0.01}, state="pruned", fom=0.5, epochs=1)  # the state alone
        digests.append(store.study_digest("st"))
        # The parameters alone (their text's length: PBT, which changes a running trial's
        # parameters, writes an exploit event with them, which the digest counts too).
        store.record_trial("st", 0, params={"lr": 0.0125}, state="pruned", fom=0.5, epochs=1)
        digests.append(store.study_digest("st"))
        store.record_trial_events("st", [(0, "value", 1, {"value": 0.5})])
        digests.append(store.study_digest("st"))
        first = store.trial_events("st")[0]["time"]
        time.sleep(0.01)
        store.record_trial_events("st", [(0, "value", 1, {"value": 0.4}), (0, "pruned", 1, {})])  # one written again
        digests.append(store.study_digest("st"))
        store.end_study("st", "completed")
        digests.append(store.study_digest("st"))
        assert len(set(digests)) == len(digests), digests  # each change shows
        assert store.study_digest("st") == digests[-1]  # and nothing else does
        again = store.trial_events("st", after=first)
        assert [(e["kind"], e["data"]) for e in again] == [("pruned", {}), ("value", {"value": 0.4})]
        assert store.trial_events("st", after=max(e["time"] for e in again)) == []


def _start_batch(tmp_path, *extra: str, n: int = 2) -> subprocess.Popen:
    """`mpiexec -n n python -m nbdist train` on the digits MLP (two ranks: a master and a
    worker, or two allreduce workers, are enough for records of several ranks)."""
    cmd = mpiexec_command(
        n,
        ["-m", "nbdist", "train", "--model", "examples/digits_mlp.py", "--runs-dir", str(tmp_path), "--quiet", *extra],
    )
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=mpi_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _store_rows(tmp_path) -> list[tuple]:
    with sqlite3.connect(tmp_path / "nbdist.db") as conn:
        return conn.execute("SELECT run, rank, seq, kind, time FROM records").fetchall()


def _rows_so_far(tmp_path) -> list[tuple]:
    """The store's records while a job may still be creating it (no file, or a file
    without its tables yet, or locked while they are made: none so far)."""
    try:
        return _store_rows(tmp_path) if (tmp_path / "nbdist.db").exists() else []
    except sqlite3.OperationalError:
        return []


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_a_batch_run_lands_complete_in_the_store(tmp_path):
    job = _start_batch(tmp_path, "--epochs", "3", "--checkpoint-every", "1", "--topology", "master-worker")
    out, _ = job.communicate(timeout=240)
    assert job.returncode == 0, out
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    rows = _store_rows(tmp_path)
    logged = [(r["run"], r["rank"], r["seq"], r["kind"], r["time"]) for r in read_log(run_dir)]
    # Every record of every rank, each once.
    assert sorted(rows) == sorted(logged)
    assert len(set((r[1], r[2]) for r in rows)) == len(rows)
    assert {r[1] for r in rows} == {0, 1}
    assert Counter(r[3] for r in rows)["epoch"] == 3
    with RunStore(tmp_path / "nbdist.db") as store:
        run = store.run(run_dir.name)
        assert run.status == "completed" and run.reason == "completed 3 epochs"
        summary = json.loads((run_dir / "summary.json").read_text())
        assert run.final == summary["final"]
        assert run.layout["options"]["workers"] == 1 and run.options["epochs"] == 3
        assert [c["label"] for c in store.checkpoints(run.id)] == ["epoch-0001", "epoch-0002", "epoch-0003"]

    # Resumed for two more epochs: the same run, running again, its records still each once.
    job = _start_batch(tmp_path, "--resume", str(run_dir), "--epochs", "5")
    out, _ = job.communicate(timeout=240)
    assert job.returncode == 0, out
    rows = _store_rows(tmp_path)
    assert sorted(rows) == sorted((r["run"], r["rank"], r["seq"], r["kind"], r["time"]) for r in read_log(run_dir))
    with RunStore(tmp_path / "nbdist.db") as store:
        assert [r.status for r in store.runs()] == ["completed"]
        assert Counter(r["kind"] for r in store.records(run_dir.name)[0])["epoch"] == 5

    # Importing the run directory again adds nothing: it is all there.
    with RunStore(tmp_path / "nbdist.db") as store:
        assert import_run(store, run_dir) == (run_dir.name, 0)
        assert store.run(run_dir.name).status == "completed"


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_a_killed_batch_run_is_marked_killed(tmp_path):
    job = _start_batch(tmp_path, "--epochs", "100000", "--topology", "allreduce")
    try:
        deadline = time.monotonic() + 180
        while not any(r[3] == "train" for r in _rows_so_far(tmp_path)):
            assert job.poll() is None, job.communicate()[0]
            assert time.monotonic() < deadline, "the run never reached the store"
            time.sleep(0.2)
        with RunStore(tmp_path / "nbdist.db") as store:
            assert [r.status for r in store.runs()] == ["running"]
    finally:
        os.killpg(job.pid, signal.SIGKILL)  # no handler runs: the job just vanishes
        job.communicate(timeout=60)
    deadline = time.monotonic() + 60
    with RunStore(tmp_path / "nbdist.db") as store:
        while store.runs()[0].status == "running":  # until the ranks themselves are gone
            assert time.monotonic() < deadline, "the killed run was never marked killed"
            time.sleep(0.2)
        run = store.runs()[0]
        assert run.status == "killed" and "killed" in run.reason
        assert store.records(run.id, kinds=["train"])[0], "the records up to the kill are kept"


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_the_recorder_of_a_batch_run_outlives_a_locked_store_and_records_its_end(tmp_path):
    """Another writer holds the store's write lock (a second SQLite connection, for real)
    longer than the recorder waits: its pass fails with "database is locked", it says once
    that the records are delayed, tries again, and the run ends recorded `completed` with
    every record once."""
    runs = tmp_path / "runs"
    output = tmp_path / "output.txt"
    with open(output, "w") as out:
        job = subprocess.Popen(
            mpiexec_command(
                2,
                # Paced: it still trains when the lock is taken, however fast the machine.
                ["-m", "nbdist", "train", "--model", "tests/models/digits_mlp_paced.py", "--epochs", "12"]
                + ["--runs-dir", str(runs), "--run-name", "locked", "--quiet"],
            ),
            cwd=ROOT,
            env=mpi_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 180
        while not any(r[3] == "train" for r in _rows_so_far(runs)):
            assert job.poll() is None, output.read_text()
            assert time.monotonic() < deadline, "the run never reached the store"
            time.sleep(0.1)
        blocker = sqlite3.connect(runs / "nbdist.db", isolation_level=None)
        blocker.execute("BEGIN EXCLUSIVE")
        try:
            while "cannot take this run's records now" not in output.read_text():
                assert job.poll() is None and time.monotonic() < deadline, (
                    "the recorder said nothing of the locked store:\n" + output.read_text()
                )
                time.sleep(0.1)
            time.sleep(1.0)  # locked a while longer: it keeps trying, and says nothing more
        finally:
            blocker.execute("COMMIT")
            blocker.close()
        assert job.wait(timeout=200) == 0, output.read_text()
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    text = output.read_text()
    assert text.count("cannot take this run's records now (OperationalError: database is locked)") == 1, text
    assert "Traceback" not in text, text
    run_dir = runs / "locked"
    with RunStore(runs / "nbdist.db") as store:
        run = store.run("locked")
        assert run.status == "completed" and run.reason == "completed 12 epochs", run
    rows = _store_rows(runs)
    assert sorted(rows) == sorted((r["run"], r["rank"], r["seq"], r["kind"], r["time"]) for r in read_log(run_dir))
