"""The run store on a real PostgreSQL server (Debian's `postgresql`, started here): what
the SQLite store does, schema versions and migrations for both, URLs that are wrong, no
password ever shown, trials claimed once, and a study shared by two concurrent mpiexec
jobs (one of them killed mid-way) that the dashboard's sources follow."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import postgres_server
import pytest
from conftest import ROOT
from postgres_server import PASSWORD

from nbdist.hpo.inprocess import optimize
from nbdist.launch import mpi_env
from nbdist.store import SCHEMA_VERSION, RunStore, StoreError, mask_url
from nbdist.store.dialects import PostgresDialect, SQLiteDialect
from nbdist.store.schema import _MIGRATIONS

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def postgres():
    server = postgres_server.start()
    pid = server.pid()
    try:
        yield server
    finally:
        server.stop()
    assert pid is not None and not postgres_server._alive(pid), "the PostgreSQL server outlived its tests"
    assert not server.root.exists()


_databases = iter(range(1_000_000))


@pytest.fixture
def database(postgres, monkeypatch):
    """A fresh, empty database on the server: its URL, without the password, which libpq
    finds in PGPASSWORD, as nbdist asks of its users (a --store URL with one is refused)."""
    monkeypatch.setenv("PGPASSWORD", PASSWORD)
    return postgres.create_database(f"t{next(_databases)}").replace(f":{PASSWORD}@", "@")


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


def test_a_run_written_to_postgres_reads_back(database):
    with RunStore(database) as store:
        assert PASSWORD not in store.label and store.label.endswith(f"/{database.rsplit('/', 1)[1]}")
        store.begin_run("r1", run_dir="/runs/r1", options={"epochs": 2, "store": database}, layout={"workers": 2})
        assert store.add_records([_record("r1", 0, i) for i in range(3)]) == 3
        assert store.add_records([_record("r1", 0, i) for i in range(4)]) == 1  # a log read twice
        first, last = store.records("r1")
        assert [r["seq"] for r in first] == [0, 1, 2, 3] and first[0]["values"] == {"loss": 1.0}
        store.add_records([_record("r1", 1, 0, kind="update", staleness=2)])
        new, last2 = store.records("r1", after=last)
        assert [(r["rank"], r["kind"], r["values"]["staleness"]) for r in new] == [(1, "update", 2)]
        assert store.records("r1", after=last2) == ([], last2)
        assert [r["kind"] for r in store.records("r1", kinds=["update"])[0]] == ["update"]
        store.add_checkpoint("r1", "epoch-1", "/runs/r1/checkpoints/epoch-1", 5.0)
        store.add_checkpoint("r1", "epoch-1", "/elsewhere", 6.0)  # kept once
        store.end_run("r1", "completed", "completed 2 epochs", {"val_acc": 0.9})
        store.begin_study(
            "s",
            searcher="random",
            space={"x": "real(0,1)"},
            options={"train": {"store": database}},
            objective="fom",
            direction="minimize",
        )
        store.record_trial("s", 0, params={"x": 0.5}, state="running", owner="job-a")
        store.record_trial("s", 0, params={"x": 0.5}, state="complete", fom=0.25, folds=[0.25])
    with RunStore(database, create=False) as store:  # another connection sees it all
        run = store.run("r1")
        assert (run.status, run.final, run.layout, run.reason) == (
            "completed",
            {"val_acc": 0.9},
            {"workers": 2},
            "completed 2 epochs",
        )
        # The options keep the store, never its password.
        assert run.options == {"epochs": 2, "store": database.replace(f":{PASSWORD}@", ":***@")}
        assert store.study("s")["options"]["train"]["store"] == run.options["store"]
        assert store.checkpoints("r1") == [{"label": "epoch-1", "path": "/runs/r1/checkpoints/epoch-1", "time": 5.0}]
        [trial] = store.trials("s")
        assert (trial.state, trial.fom, trial.folds, trial.owner) == ("complete", 0.25, [0.25], "job-a")
        assert [r.id for r in store.runs(study=None)] == ["r1"]


def _terminate_others(database: str) -> int:
    """pg_terminate_backend() every other connection to the database, as an
    administrator does; returns how many there were."""
    import psycopg

    with psycopg.connect(database, autocommit=True) as admin:
        return len(
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = "
                "current_database() AND pid <> pg_backend_pid()"
            ).fetchall()
        )


def test_a_connection_whose_socket_went_under_it_is_made_again(postgres, database):
    """The socket gone while psycopg still counts the connection open: what a session the
    server ends as a statement goes out can leave (psycopg: "connection socket closed", no
    SQLSTATE). A read and a write each find it and go on, on a new connection."""
    with RunStore(database) as store:
        store.begin_run("r", run_dir=None, options={}, layout={})
        for step, seqs in enumerate(((0, 1), (2, 3))):
            os.close(store._db._conn.fileno())
            assert not store._db._conn.closed  # psycopg has not noticed
            assert store.add_records([_record("r", 0, i) for i in seqs]) == 2, step
        os.close(store._db._conn.fileno())
        assert [r["seq"] for r in store.records("r")[0]] == [0, 1, 2, 3]


def test_a_lost_connection_is_made_again_and_a_cut_write_is_reported(postgres, database, monkeypatch):
    from nbdist.dashboard.sources import StoreSource
    from nbdist.store import dialects

    with RunStore(database) as store:
        store.begin_run("r", run_dir=None, options={}, layout={})
        store.add_records([_record("r", 0, i) for i in range(3)])
        source = StoreSource(database, "r")  # the dashboard's reader, on its own connection
        assert len(source.poll()) == 3
        assert _terminate_others(database) == 2
        # Both found their connection gone at their next statement: connected again, went on.
        assert store.add_records([_record("r", 0, i) for i in range(3, 6)]) == 3
        assert [r["seq"] for r in source.poll()] == [3, 4, 5]
        # Cut in the middle of a write transaction: reported, not replayed; the next one works.
        with pytest.raises(StoreError) as caught:
            with store.coordinate("s"):
                store.add_records([_record("r", 0, 6)])
                _terminate_others(database)
                store.add_records([_record("r", 0, 7)])
        message = str(caught.value)
        assert (
            message.startswith(
                f"the connection to the run store {database.replace(PASSWORD, '***')} was lost during a write ("
            )
            and "the write was not repeated" in message
        ), message
        assert [r["seq"] for r in store.records("r")[0]] == [0, 1, 2, 3, 4, 5]  # nothing of it was written
        assert store.add_records([_record("r", 0, i) for i in (6, 7)]) == 2
        # The server restarts: a reader waits for it (within RECONNECT_SECONDS), or says so.
        monkeypatch.setattr(dialects, "RECONNECT_SECONDS", 1.0)
        postgres.halt()
        try:
            with pytest.raises(StoreError) as caught:
                source.poll()
            assert "was lost (" in str(caught.value) and "could not be made again in 1 s: " in str(caught.value)
        finally:
            postgres.start()
        assert [r["seq"] for r in source.poll()] == [6, 7] and store.run("r").status == "running"
        source.close()


def test_a_run_recorder_cut_in_the_middle_of_a_write_sends_its_records_again(tmp_path, database, capfd):
    """The batch run leader's recorder: its connection is ended while its INSERT waits
    on a lock (so, inside the write): it says so, and the records go with its next pass."""
    import json

    import psycopg

    from nbdist.store import RunRecorder

    log = tmp_path / "run" / "metrics" / "rank-00000.jsonl"
    log.parent.mkdir(parents=True)

    def append(seqs):
        with open(log, "a") as fh:
            fh.writelines(json.dumps(_record("run", 0, i)) + "\n" for i in seqs)

    recorder = RunRecorder(database, "run", tmp_path / "run", options={}, layout={}, every=0.1)
    with RunStore(database) as store, psycopg.connect(database, autocommit=True) as admin:
        append(range(3))
        deadline = time.monotonic() + 30
        while len(store.records("run")[0]) < 3:
            assert time.monotonic() < deadline, "the recorder never wrote"
            time.sleep(0.05)
        with admin.transaction():  # inserts wait until it ends
            admin.execute("LOCK TABLE records IN EXCLUSIVE MODE")
            append(range(3, 6))
            waiting = []
            while not waiting:
                assert time.monotonic() < deadline, "the recorder's write never waited on the lock"
                waiting = admin.execute(
                    "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()"
                ).fetchall()
                time.sleep(0.05)
            admin.execute("SELECT pg_terminate_backend(%s)", waiting[0])
        recorder.finish("completed")
        assert [r["seq"] for r in store.records("run")[0]] == list(range(6))
        assert store.run("run").status == "completed"
    assert "was lost during a write" in capfd.readouterr().err


def test_credentials_from_libpq_environment_and_never_shown(postgres, database, monkeypatch):
    bare = database
    with RunStore(bare) as store:  # the password from libpq's environment
        assert store.label == bare
    monkeypatch.setenv("PGPASSWORD", "wrong")
    with pytest.raises(StoreError) as caught:
        RunStore(bare)
    assert str(caught.value).startswith(f"cannot connect to the run store {bare}: ")
    assert "password authentication failed" in str(caught.value)
    wrong = database.replace("@", ":not-this-one@", 1)
    with pytest.raises(StoreError) as caught:
        RunStore(wrong)
    assert "not-this-one" not in str(caught.value) and ":***@" in str(caught.value)


def test_a_postgres_store_that_is_not_there_or_not_a_store(postgres, database):
    closed = f"postgresql://nbdist:{PASSWORD}@127.0.0.1:{postgres_server._free_port()}/nbdist"
    with pytest.raises(StoreError) as caught:
        RunStore(closed)
    message = str(caught.value)
    assert message.startswith(f"cannot connect to the run store {closed.replace(PASSWORD, '***')}: ")
    assert PASSWORD not in message
    with pytest.raises(StoreError) as caught:
        RunStore(database, create=False)  # an empty database is not a store yet
    assert str(caught.value) == f"no run store at {database.replace(PASSWORD, '***')} (it has no nbdist tables yet)"


@pytest.mark.parametrize(
    "url, problem",
    [
        ("mysql://me@db:3306/nbdist", "unknown scheme 'mysql'"),
        ("postgresql://me:pw@db:port/nbdist", "Port could not be cast to integer value as 'port'"),
        ("postgresql://me:pw@db:5432", "no database name"),
        ("postgresql://me:pw@db:5432/", "no database name"),
        ("sqlite://runs/nbdist.db", "a SQLite URL is sqlite:///PATH"),
    ],
)
def test_bad_store_urls_name_the_problem_and_the_forms(url, problem):
    with pytest.raises(StoreError) as caught:
        RunStore(url)
    message = str(caught.value)
    assert problem in message and "pw" not in message.replace("postgresql://USER", ""), message
    assert "\n" not in message
    if "database name" in problem:
        assert "postgresql://USER@HOST:PORT/DATABASE" in message
    elif "SQLite URL" not in problem:
        assert "a SQLite file path, sqlite:///PATH, or postgresql://USER@HOST:PORT/DATABASE" in message


def test_a_password_is_masked_wherever_a_url_carries_it():
    assert mask_url("postgresql://me:p%40ss@db:5432/nbdist") == "postgresql://me:***@db:5432/nbdist"
    assert (
        mask_url("postgresql://me@db/nbdist?password=zz&sslmode=require")
        == "postgresql://me@db/nbdist?password=***&sslmode=require"
    )
    assert mask_url("postgresql://me@db/nbdist") == "postgresql://me@db/nbdist"
    assert mask_url("runs/nbdist.db") == "runs/nbdist.db"


def test_the_command_line_says_what_is_wrong_with_a_store_in_one_line(tmp_path, pyrun, database):
    bad = pyrun(["-m", "nbdist", "store", "import", str(tmp_path), "--store", "mysql://me:pw@db/nbdist"])
    assert bad.returncode != 0 and "Traceback" not in bad.output
    [line] = [line for line in bad.output.splitlines() if line.strip()]
    assert "--store mysql://me:***@db/nbdist: unknown scheme 'mysql'" in line and "postgresql://USER@HOST" in line
    # An empty database is no store: the dashboard says so (and not the password).
    for how in (["--export", str(tmp_path / "x.html")], ["--port", "0"]):  # exported, or served
        empty = pyrun(["-m", "nbdist", "dashboard", "--store", database, *how])
        assert empty.returncode != 0 and "Traceback" not in empty.output and PASSWORD not in empty.output
        assert f"no run store at {database.replace(PASSWORD, '***')} (it has no nbdist tables yet)" in empty.output


def test_a_sqlite_url_is_the_file(tmp_path):
    with RunStore(f"sqlite:///{tmp_path}/s.db") as store:
        store.begin_run("r", run_dir=None, options={}, layout={})
    with RunStore(tmp_path / "s.db", create=False) as store:
        assert store.run("r").status == "running"


def _schema_1_store(path) -> None:
    """A store as nbdist wrote it before schema 2 (version in user_version only)."""
    with sqlite3.connect(path) as conn:
        for statement in _MIGRATIONS[0]:
            conn.execute(statement.format(**SQLiteDialect.types))
        conn.execute("INSERT INTO runs (id, status, options, started) VALUES ('old', 'completed', '{}', 1.0)")
        conn.execute(
            "INSERT INTO records (run, rank, seq, kind, time, \"values\") VALUES ('old', 0, 0, 'train', 1.0, "
            "'{\"loss\": 2.0}')"
        )
        conn.execute("INSERT INTO trials (study, number, params, state) VALUES ('s', 0, '{\"x\": 1}', 'running')")
        conn.execute("PRAGMA user_version = 1")


def test_a_schema_1_sqlite_store_is_migrated_and_keeps_its_runs(tmp_path):
    path = tmp_path / "old.db"
    _schema_1_store(path)
    with RunStore(path) as store:
        assert store.run("old").status == "completed"
        assert [r["values"] for r in store.records("old")[0]] == [{"loss": 2.0}]
        [trial] = store.trials("s")
        assert (trial.number, trial.owner) == (0, None)  # a trial of no job: the next coordinator adopts it
        assert store.claim_trial("s", 0, "job-b", None) and not store.claim_trial("s", 0, "job-c", None)
    with sqlite3.connect(path) as conn:
        assert conn.execute("SELECT version FROM schema_version").fetchall() == [(SCHEMA_VERSION,)]
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_a_store_of_a_newer_schema_is_refused_in_either_database(tmp_path, database):
    path = tmp_path / "new.db"
    RunStore(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    with pytest.raises(StoreError) as caught:
        RunStore(path)
    assert str(caught.value) == (
        f"the run store {path} was written by a newer nbdist (schema {SCHEMA_VERSION + 1}; this nbdist reads "
        f"up to {SCHEMA_VERSION}): upgrade nbdist, or give another --store"
    )
    RunStore(database).close()
    db = PostgresDialect(database, create=False)
    db.execute("UPDATE schema_version SET version = ?", (SCHEMA_VERSION + 1,))
    db.close()
    with pytest.raises(StoreError) as caught:
        RunStore(database)
    assert str(caught.value) == (
        f"the run store {database.replace(PASSWORD, '***')} was written by a newer nbdist (schema "
        f"{SCHEMA_VERSION + 1}; this nbdist reads up to {SCHEMA_VERSION}): upgrade nbdist, or give another --store"
    )


def test_an_orphaned_trial_is_claimed_by_one_job_only(database):
    with RunStore(database) as one, RunStore(database) as two:
        one.begin_study("s", searcher="random", space={}, options={}, objective="fom", direction="minimize")
        one.record_trial("s", 3, params={"x": 1}, state="running", owner="gone")
        assert one.claim_trial("s", 3, "job-1", "gone")
        assert not two.claim_trial("s", 3, "job-2", "gone")  # it is job-1's now
        assert [t.owner for t in two.trials("s")] == ["job-1"]


def test_jobs_that_choose_the_same_run_name_at_once_get_different_ones(tmp_path, database):
    """Four leaders with runs directories of their own name runs "r" at the same moment
    in one store: each gets its own name, and the store a row for each."""
    from nbdist.train.run_dir import fresh_dir

    start, chosen = threading.Barrier(4), {}

    def leader(i):
        start.wait(30)
        chosen[fresh_dir(tmp_path / f"job{i}", "r", database).name] = i

    threads = [threading.Thread(target=leader, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(chosen) == ["r", "r-2", "r-3", "r-4"]
    with RunStore(database) as store:
        assert sorted(store.run_ids()) == ["r", "r-2", "r-3", "r-4"]
        store.begin_run("r-3", run_dir=None, options={"epochs": 1}, layout={"workers": 1}, study="s", trial=2)
        run = store.run("r-3")  # the reserved row, now the run's
    where = (tmp_path / f"job{chosen['r-3']}" / "r-3").resolve()
    assert where.is_dir() and (run.run_dir, run.options, run.study, run.trial) == (str(where), {"epochs": 1}, "s", 2)


def _two_coordinators(database: str, objective, joined: threading.Event | None = None, **options) -> dict:
    """Two studies' coordinators (threads here, each with its own connection) on one
    study "shared": the first starts it, the second joins it with --resume-study once it
    is in the store (then `joined` is set). Returns their StudyResults by name."""
    results, errors = {}, []

    def run(name, **kwargs):
        try:
            results[name] = optimize(
                objective,
                space="x=real(0,1)",
                searcher="random",
                store=database,
                say=lambda line: None,
                **options,
                **kwargs,
            )
        except Exception as exc:  # reported below
            errors.append(exc)

    first = threading.Thread(target=run, args=("first",), kwargs={"study_name": "shared"})
    first.start()
    deadline = time.monotonic() + 60
    with RunStore(database) as store:
        while not store.studies():
            assert time.monotonic() < deadline and first.is_alive(), errors
            time.sleep(0.01)
        second = threading.Thread(target=run, args=("second",), kwargs={"resume_study": "shared"})
        second.start()
        while joined is not None and len(store.live_jobs("shared")) < 2:
            assert time.monotonic() < deadline and second.is_alive(), errors
            time.sleep(0.01)
    if joined is not None:
        joined.set()
    for thread in (first, second):
        thread.join(120)
        assert not thread.is_alive()
    assert not errors, errors
    return results


def test_a_study_is_resumable_from_the_moment_it_appears_in_the_store(tmp_path, monkeypatch):
    """A job that joins with --resume-study as soon as the study is listed (as
    _two_coordinators does) must find the searcher's state there: the first job wrote the
    study's row and its state in two steps once, and a joiner in between failed with
    "has no saved searcher state" (seen in a whole-suite run)."""
    database = str(tmp_path / "s.db")
    seen: list = []
    join = RunStore.join_study

    def join_and_look(store, study, job):  # the creator's first write after its INSERT
        with RunStore(database) as other:
            seen.append(other.study(study).get("searcher_state"))
        return join(store, study, job)

    monkeypatch.setattr(RunStore, "join_study", join_and_look)
    optimize(
        lambda params: params["x"] ** 2,
        space="x=real(0,1)",
        searcher="random",
        trials=2,
        store=database,
        study_name="s",
        say=lambda line: None,
    )
    assert seen and "searcher" in seen[0], seen
    monkeypatch.setattr(RunStore, "join_study", join)
    resumed = optimize(
        lambda params: params["x"] ** 2,
        space="x=real(0,1)",
        searcher="random",
        trials=3,
        store=database,
        resume_study="s",
        say=lambda line: None,
    )
    assert len(resumed.trials) == 3


@pytest.mark.parametrize("kind", [pytest.param("postgresql", marks=pytest.mark.postgres), "sqlite"])
def test_two_coordinators_share_one_study_and_run_every_trial_once(kind, request, tmp_path):
    """Every trial number once, every point told once, both did trials."""
    database = request.getfixturevalue("database") if kind == "postgresql" else str(tmp_path / "s.db")
    told: list[float] = []

    def objective(params):
        told.append(params["x"])
        time.sleep(0.05)  # long enough for the other coordinator to get a turn
        return (params["x"] - 0.3) ** 2

    results = _two_coordinators(database, objective, trials=30)
    with RunStore(database) as store:
        trials = store.trials("shared")
        state = store.study("shared")["searcher_state"]["searcher"]
        assert store.study("shared")["status"] == "completed"
    assert [t.number for t in trials] == list(range(30)) and {t.state for t in trials} == {"complete"}
    assert len(told) == 30 and len(set(told)) == 30  # each point evaluated once
    assert len(state["told"]) == 30 and state["pending"] == []
    assert len({t.owner for t in trials}) == 2  # both coordinators trained some
    # Each reports the study as it stood when it ended; the one that ended last, all of it.
    last = max(results.values(), key=lambda r: len(r.trials))
    assert len(last.trials) == 30 and last.best_fom == min(t.fom for t in trials)
    # Neither ended while the other still trained: each watched the study to its end.
    assert {r.reason for r in results.values()} == {"30 trials done"}


def test_a_goal_reached_in_one_job_stops_every_job_of_the_study(tmp_path):
    """--goal on a shared study: the job whose trial reaches it and the other one stop."""
    joined = threading.Event()

    def objective(params):
        joined.wait(60)  # no trial ends before both jobs run the study
        time.sleep(0.02)
        return (params["x"] - 0.3) ** 2

    database = str(tmp_path / "s.db")
    results = _two_coordinators(database, objective, joined, trials=200, goal="fom < 0.0004")
    with RunStore(database) as store:
        trials = store.trials("shared")
    reached = [t for t in trials if t.goal_reached]
    assert reached and all(t.fom < 0.0004 for t in reached) and len(trials) < 200
    assert {r.reason for r in results.values()} == {"goal fom < 0.0004 reached"}
    assert len({t.owner for t in trials}) == 2  # both jobs trained before the goal stopped them


# ------------------------------------------------------------------ two mpiexec jobs
SPACE = "lr=log(3e-3,0.5) hidden=int(8,64)"


def _job(tmp_path, name: str, database: str, *study: str) -> subprocess.Popen:
    """`python -m nbdist launch -n 3 study ...` (1 coordinator, 1 master, 1 worker),
    its output in tmp_path/NAME.log and its runs in tmp_path/NAME. A trial trains 60
    epochs of the digits MLP, over a second on an idle machine: long enough to be killed
    in the middle of one (at 20 epochs, 0.4 s, one ended between the look and the kill)."""
    argv = [
        sys.executable,
        "-m",
        "nbdist",
        "launch",
        "-n",
        "3",
        "study",
        "--model",
        "examples/digits_mlp.py",
        "--searcher",
        "random",
        "--workers",
        "1",
        "--epochs",
        "60",
        "--seed",
        "1",
        "--store",
        database,
        "--runs-dir",
        str(tmp_path / name),
        *study,
    ]
    with open(tmp_path / f"{name}.log", "w") as log:
        return subprocess.Popen(
            argv, cwd=ROOT, env=mpi_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def _log(tmp_path, name: str) -> str:
    return (tmp_path / f"{name}.log").read_text()


def test_two_concurrent_mpiexec_jobs_share_a_study_one_killed(tmp_path, postgres, database):
    from nbdist.dashboard.sources import StoreSource, run_choices
    from nbdist.dashboard.study import StudyPage

    # Enough trials for job a to start a few after job b's first one ended, each a chance
    # to be caught a moment after its start; b trains whatever is left after the kill alone.
    trials = 10
    a = _job(tmp_path, "a", database, "--space", SPACE, "--trials", str(trials), "--study-name", "shared")
    jobs = [a]
    seen_live = 0  # trials the dashboard's study view picked up while the jobs ran
    try:
        with RunStore(database) as store:
            deadline = time.monotonic() + 120
            while not store.studies():
                assert a.poll() is None and time.monotonic() < deadline, _log(tmp_path, "a")[-3000:]
                time.sleep(0.2)
            # The second job joins the study that the first one runs.
            b = _job(tmp_path, "b", database, "--resume-study", "shared")
            jobs.append(b)
            plots = StudyPage(store, "shared")
            seen_live += len(plots.data.finished)  # those it showed when opened
            while True:  # both jobs train; then the first is killed in the middle of a trial
                assert time.monotonic() < deadline + 120, "the two jobs never both trained"
                assert a.poll() is None, _log(tmp_path, "a")[-3000:]
                assert b.poll() is None, _log(tmp_path, "b")[-3000:]
                seen_live += plots.update()
                rows = store.trials("shared")
                job_a = _coordinator(store, a)
                # A trial a asked for a moment ago: its fold run is still starting when a dies.
                cut = [
                    t.number
                    for t in rows
                    if t.state == "running" and t.owner == job_a and time.time() - t.started < 0.3
                ]
                if len({t.owner for t in rows if t.state == "complete"}) == 2 and cut:
                    break
                time.sleep(0.2)
            _kill_tree(a)  # no handler runs: job a just vanishes, its ranks too
            # What it was really cut off in (a trial can finish between the look and the kill).
            cut = [t.number for t in store.trials("shared") if t.number in cut and t.state == "running"]
            while b.poll() is None:
                assert time.monotonic() < deadline + 300, _log(tmp_path, "b")[-3000:]
                seen_live += plots.update()
                time.sleep(0.2)
            assert b.returncode == 0, _log(tmp_path, "b")[-4000:]
            job_b = next(t.owner for t in store.trials("shared") if t.owner not in (job_a, None))
            seen_live += plots.update()
            again = plots.update()  # nothing is shown twice
    finally:
        for job in jobs:
            _kill_tree(job)
    out_b = _log(tmp_path, "b")
    assert "resuming study shared: 0 trials finished" in out_b and "1 other job(s) run it too" in out_b, out_b
    assert (
        "of a job that is gone: taken over here" in out_b and f"nbdist: study shared: {trials} trials done" in out_b
    ), out_b[-3000:]
    for name in ("a", "b"):
        assert PASSWORD not in _log(tmp_path, name)
    with RunStore(database) as store:
        rows = store.trials("shared")
        assert [t.number for t in rows] == list(range(trials)) and {t.state for t in rows} == {"complete"}, rows
        assert store.study("shared")["status"] == "completed"
        runs: dict[int, list] = {}
        for run in store.runs(study="shared"):
            runs.setdefault(run.trial, []).append(run)
        for t in rows:
            completed = [r for r in runs[t.number] if r.status == "completed"]
            assert len(completed) == 1, (t.number, [(r.id, r.status) for r in runs[t.number]])  # trained once
        # The trial the killed job was training was taken over by the job that survived
        # it, without a --resume-study, and job a had finished others before it died.
        assert cut and all(rows[n].owner == job_b for n in cut), (cut, job_a, job_b, rows)
        assert any(t.owner == job_a for t in rows)
        # The dashboard's sources read it all from PostgreSQL: every trial, every job's runs.
        assert seen_live == trials and again == 0
        choices = run_choices(store)
        all_runs = [r for rs in runs.values() for r in rs]
        assert len(choices) == len(all_runs) and {Path(r.run_dir).parent.name for r in all_runs} >= {"a", "b"}
        for job in ("a", "b"):
            run = next(r for r in all_runs if Path(r.run_dir).parent.name == job and r.status == "completed")
            source = StoreSource(database, run.id)
            info = source.info()
            assert info.status == "completed" and info.options["store"] == database.replace(PASSWORD, "***")
            records = source.poll()
            assert {r["kind"] for r in records} >= {"epoch"} and source.poll() == []
            source.close()


def _kill_tree(job: subprocess.Popen) -> None:
    """SIGKILL the launcher and every process under it (prterun leaves the launcher's
    process group, so killpg alone would leave the ranks running), and wait them out."""
    import psutil

    if job.poll() is not None:  # ended by itself (its ranks before it), and reaped
        return
    try:
        tree = [psutil.Process(job.pid), *psutil.Process(job.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for process in tree:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    job.wait(60)
    gone, alive = psutil.wait_procs(tree, timeout=60)
    assert not alive, f"processes of the killed job outlived it: {alive}"


def _coordinator(store: RunStore, job: subprocess.Popen) -> str | None:
    """The study job name of an mpiexec job's coordinator (rank 0): host:PID:..."""
    import psutil

    try:
        pids = {p.pid for p in psutil.Process(job.pid).children(recursive=True)}
    except psutil.NoSuchProcess:
        return None
    rows = store._db.execute("SELECT job, pid FROM study_jobs WHERE study = ?", ("shared",)).fetchall()
    return next((name for name, pid in rows if pid in pids), None)
