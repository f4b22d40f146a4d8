"""The notebook layer for real: an IPython shell, %distnn magics, a local cluster of 4
ipyparallel engines that are the ranks of one mpiexec job."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import fields
from itertools import pairwise

import pytest

pytest.importorskip("ipyparallel")
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

import nbdist
from nbdist.errors import UserError
from nbdist.job import JobError, wait_interruptibly
from nbdist.options import TrainOptions, flag

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]

MODEL_CELL = """
import torch.nn as nn
model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
"""


@pytest.fixture(scope="module")
def shell():
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "nbdist")
    yield ip
    ip.run_line_magic("distnn", "cluster stop")


@pytest.fixture(scope="module")
def cluster(shell):
    return shell.run_line_magic("distnn", "cluster start -n 4")


@pytest.fixture(autouse=True)
def _each_test_leaves_the_cluster_whole(request):
    """A test that leaves dead engines behind fails (at its teardown) and the cluster is
    healed, so the module's later tests still test what they say, not that one death."""
    yield
    if "cluster" not in request.fixturenames:
        return
    cluster = request.getfixturevalue("cluster")
    if cluster.running and cluster.broken():
        dead = "; ".join(str(d) for d in cluster.dead_engines()) or "its controller exited"
        cluster.heal()
        pytest.fail(f"the test left the cluster with dead engines ({dead}); healed for the next test")


def _opts(tmp_path, extra: str = "") -> str:
    return f"--quiet --runs-dir {tmp_path} {extra}"


def _wait_for_records(job, count: int = 1, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while len(job.records) < count:
        assert not job.done, f"the job ended before streaming {count} records: {job!r}"
        assert time.monotonic() < deadline, f"no records streamed within {timeout} s"
        time.sleep(0.1)


def test_engines_are_mapped_to_ranks(cluster, shell, capsys):
    assert sorted(i.rank for i in cluster.info) == [0, 1, 2, 3]
    for rank in range(4):
        assert cluster.rank_of(cluster.engine_of(rank)) == rank
    # The view the jobs run on lists the engines in rank order.
    from nbdist.engine import describe_engine

    assert [r["rank"] for r in cluster.view.apply_sync(describe_engine)] == [0, 1, 2, 3]
    shell.run_line_magic("distnn", "cluster status")
    out = capsys.readouterr().out
    assert "4 MPI engines" in out and "master 0  rank 0" in out and "worker 2  rank 3" in out
    # Starting again reuses the running cluster.
    assert shell.run_line_magic("distnn", "cluster start -n 4") is cluster


@pytest.mark.parametrize(
    "options, threshold",
    [
        ("--topology master-worker --algorithm gem --workers 3 --epochs 4", 0.85),
        ("--topology master-worker --algorithm easgd --workers 3 --epochs 4 --synchronous", 0.85),
        ("--topology allreduce --epochs 6", 0.85),
    ],
)
def test_train_each_topology_from_a_cell(cluster, shell, tmp_path, options, threshold):
    job = shell.run_cell_magic("distnn", f"train {options} --block {_opts(tmp_path)}", MODEL_CELL)
    assert job.status == "completed", job
    assert job.result.final["val_acc"] >= threshold, job.epochs
    assert job.result.weights_path.exists()
    history = job.history
    # Records from every rank reached the client, and the per-epoch ones of the run.
    assert set(history["rank"]) == {0, 1, 2, 3}
    epochs = int(options.split("--epochs ")[1].split()[0])
    assert list(job.epochs["epoch"]) == list(range(1, epochs + 1))
    # Every record every rank wrote to its log reached the notebook, once.
    from nbdist.metrics import read_log

    logged = sorted((r["rank"], r["time"], r["kind"]) for r in read_log(job.result.run_dir))
    assert sorted((r["rank"], r["time"], r["kind"]) for r in job.records) == logged
    # The notebook recorded the run in the store: all of it, once, and how it ended.
    from nbdist.store import RunStore

    with RunStore(tmp_path / "nbdist.db") as store:
        run = store.run(job.run_id)
        assert (run.status, run.reason, run.final) == ("completed", f"completed {epochs} epochs", job.result.final)
        stored, _ = store.records(job.run_id)
        assert sorted((r["rank"], r["time"], r["kind"]) for r in stored) == logged
    if "master-worker" in options:
        # The master's update summaries: every worker served, and every update counted.
        staleness = job.staleness
        assert list(staleness["rank"]) == [1, 2, 3] and (staleness["updates"] > 0).all(), staleness
        summaries = history[history["kind"] == "updates"]
        per_version = 3 if "--synchronous" in options else 1  # a synchronous round: one version
        assert staleness["updates"].sum() == summaries["updates"].sum() == per_version * summaries["version"].max()
    assert shell.run_line_magic("distnn", "last") is job


def test_python_api_trains_on_the_cluster(cluster, shell, tmp_path):
    # Functions defined in a notebook (the shell's __main__) travel to the engines by value.
    shell.run_cell(
        "def build_model():\n"
        "    import torch.nn as nn\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))\n"
        "def load_data():\n"
        "    from nbdist.datasets import digits\n"
        "    return digits(val_fraction=0.25)\n"
    )
    build_model, load_data = shell.user_ns["build_model"], shell.user_ns["load_data"]
    job = nbdist.train(
        build_model,
        data=load_data,
        cluster=cluster,
        topology="allreduce",
        epochs=3,
        block=True,
        quiet=True,
        runs_dir=str(tmp_path),
    )
    assert job.status == "completed" and job.result.final["val_acc"] > 0.8
    with pytest.raises(UserError, match="function that loads it"):
        nbdist.train(build_model, data=load_data(), cluster=cluster, runs_dir=str(tmp_path))


def test_stop_ends_every_rank_and_the_next_cell_trains(cluster, shell, tmp_path):
    job = shell.run_cell_magic("distnn", f"train --epochs 5000 --checkpoint-every 1000 {_opts(tmp_path)}", MODEL_CELL)
    assert not job.done
    _wait_for_records(job)
    job.stop(timeout=5)  # raises TimeoutError if any rank is still training after 5 s
    assert job.status == "stopped", job
    assert job.result.stop_reason == "stopped by SIGUSR1"
    # The stop was taken at a step boundary and checkpointed, for a resume.
    assert any(p.name.startswith("stopped") for p in (job.result.run_dir / "checkpoints").iterdir())

    # The next cell resumes it, on the same cluster, to the end of the epoch it stopped in.
    epochs_done = len(job.epochs)
    again = shell.run_cell_magic(
        "distnn", f"train --resume {job.result.run_dir} --epochs {epochs_done + 1} --block --quiet", MODEL_CELL
    )
    assert again.status == "completed", again
    assert again.result.run_dir == job.result.run_dir
    assert [h["epoch"] for h in again.result.history][-1] == epochs_done + 1


@pytest.fixture
def ctrl_c_raises():
    """Python's own SIGINT handler, as in a kernel: a shell that started the suite in the
    background (`pytest &`) hands it SIGINT ignored, and then no interrupt arrives at all."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("ctrl_c_raises")
def test_kernel_interrupt_during_block_stops_the_job(cluster, shell, tmp_path, capsys):
    magics = shell.magics_manager.registry["DistnnMagics"]
    interrupted_at: list[float] = []

    def interrupt_once_training() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            job = magics.last_job
            if job is not None and job.options.epochs == 4000 and job.records:
                interrupted_at.append(time.time())
                os.kill(os.getpid(), signal.SIGINT)  # what Jupyter's interrupt button sends
                return
            time.sleep(0.1)

    threading.Thread(target=interrupt_once_training, daemon=True).start()
    job = shell.run_cell_magic("distnn", f"train --epochs 4000 --block {_opts(tmp_path)}", MODEL_CELL)
    assert interrupted_at, "the training never streamed a record"
    assert job.done and job.status == "stopped", job
    assert job.ended - interrupted_at[0] < 5.0
    assert "interrupted; the job stopped" in capsys.readouterr().out
    assert (
        shell.run_cell_magic("distnn", f"train --epochs 1 --block {_opts(tmp_path)}", MODEL_CELL).status == "completed"
    )


@pytest.mark.usefixtures("ctrl_c_raises")
@pytest.mark.parametrize("timeout", [None, 30.0])
def test_a_ctrl_c_the_kernel_gives_another_thread_still_interrupts_a_blocked_wait(timeout):
    # A SIGINT taken by another thread than the main one leaves a main thread asleep on a
    # lock with no timeout until the lock is released (nbdist/job.py).
    done = threading.Event()

    def ctrl_c_to_this_thread() -> None:
        time.sleep(0.3)
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)
        time.sleep(10.0)
        done.set()  # the end of the job, had the interrupt been missed

    threading.Thread(target=ctrl_c_to_this_thread, daemon=True).start()
    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        wait_interruptibly(done, timeout)
    assert time.monotonic() - start < 2.0 and not done.is_set()


def test_history_grows_while_training(cluster, shell, tmp_path):
    job = shell.run_cell_magic("distnn", f"train --topology allreduce --epochs 5000 {_opts(tmp_path)}", MODEL_CELL)
    try:
        _wait_for_records(job)
        counts = [len(job.records)]
        for _ in range(4):  # 3 s of training, looked at every 0.75 s (records flush every 0.25 s)
            time.sleep(0.75)
            counts.append(len(job.records))
        assert not job.done
        growth = [b - a for a, b in pairwise(counts)]
        assert all(g > 0 for g in growth), counts
    finally:
        job.stop(timeout=30)


def test_the_jobs_dashboard_fills_while_it_trains(cluster, shell, tmp_path, capsys):
    from nbdist.dashboard import Dashboard

    job = shell.run_cell_magic("distnn", f"train --epochs 5000 --dashboard {_opts(tmp_path)}", MODEL_CELL)
    try:
        assert "Column" in capsys.readouterr().out  # displayed under the cell (here: as text)
        board = Dashboard(job=job)
        _wait_for_records(job)
        board.tick()  # the first records name the run: its plots are built
        plots = board.view.plots
        seen = []
        for _ in range(3):
            time.sleep(1.0)
            board.tick()
            seen.append(sum(len(s.data["t"]) for s in plots.throughput.sources.values()))
        # Every poll appended the job's newest points, from every worker.
        assert seen[0] > 0 and seen[0] < seen[1] < seen[2], seen
        assert all(len(s.data["t"]) for s in plots.throughput.sources.values())
        assert len(plots.timeline.data["x0"]) > 0 and len(plots.staleness_counts.data["staleness"]) > 0
        assert board.view.info.id == job.run_id and "running" in board.view.header.object
    finally:
        job.stop(timeout=30)


STUDY_CELL = """
import torch.nn as nn

def build_model(params):
    hidden = params["hidden"]
    return nn.Sequential(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))
"""


def test_a_study_from_a_cell_trains_its_trials_on_two_groups_at_once(cluster, shell, tmp_path):
    # The options go on over the cell's first lines, continued with a backslash as in a shell.
    result = shell.run_cell(
        f'%%distnn study --space "lr=log(3e-3,0.5) hidden=int(8,64)" --searcher random \\\n'
        f"    --trials 4 --groups 2 --workers 1 --epochs 2 \\\n"
        f"    --block {_opts(tmp_path)}\n{STUDY_CELL}"
    )
    assert result.error_in_exec is None, result.error_in_exec
    study = result.result
    assert study.status == "completed", study
    trials = study.trials
    assert list(trials["trial"]) == [0, 1, 2, 3] and set(trials["state"]) == {"complete"}
    best = trials.loc[trials["fom"].idxmin()]
    assert study.best_params == {"lr": best["lr"], "hidden": best["hidden"]} and study.best_fom == best["fom"]
    assert shell.run_line_magic("distnn", "last") is study
    from nbdist.store import RunStore

    with RunStore(tmp_path / "nbdist.db") as store:
        assert [t.state for t in store.trials(study.name)] == ["complete"] * 4
        assert {t.group for t in store.trials(study.name)} == {0, 1}
        # The notebook recorded each trial's run, whole, tagged with its trial.
        runs = store.runs(study=study.name)
        assert sorted(r.trial for r in runs) == [0, 1, 2, 3] and {r.status for r in runs} == {"completed"}
        for run in runs:
            assert run.final["val_loss"] == trials.set_index("trial").loc[run.trial, "fom"]
            records, _ = store.records(run.id)
            assert {r["rank"] for r in records} in ({0, 1}, {2, 3}) and {r["trial"] for r in records} == {run.trial}


def test_error_in_the_cell_on_one_rank_is_one_error_naming_it(cluster, shell, tmp_path):
    cell = MODEL_CELL + (
        "from mpi4py import MPI\nif MPI.COMM_WORLD.Get_rank() == 2:\n    raise ValueError('no data on this node')\n"
    )
    with pytest.raises(JobError) as caught:
        shell.run_cell_magic("distnn", f"train --epochs 2 --block {_opts(tmp_path)}", cell)
    message = str(caught.value)
    assert message == "the cell failed: ValueError: no data on this node (cell line 6) (on rank 2)"
    # In a notebook this is all the user sees: one line, no traceback from the engines.
    assert caught.value._render_traceback_() == [f"JobError: {message}"]


FAILING_CELL = """
import pathlib, time
import torch.nn as nn
from mpi4py import MPI

class Failing(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if MPI.COMM_WORLD.Get_rank() == {rank} and self.training and self.calls > 20:
            {failure}
        return self.net(x)

def build_model():
    return Failing()
"""
FLAKY_CELL = FAILING_CELL.format(rank=2, failure='raise RuntimeError("illegal memory access")')


@pytest.mark.parametrize("topology", ["master-worker", "allreduce"])
def test_failure_on_one_rank_while_training_is_one_error(cluster, shell, tmp_path, topology):
    # The others wait for the failed rank's next message; the client makes them give up.
    with pytest.raises(JobError) as caught:
        shell.run_cell_magic("distnn", f"train --topology {topology} --epochs 50 --block {_opts(tmp_path)}", FLAKY_CELL)
    assert str(caught.value).startswith("RuntimeError: illegal memory access (on rank 2)")
    assert "in forward" in caught.value.detail  # the rank's own traceback, kept for the curious
    assert (
        shell.run_cell_magic("distnn", f"train --epochs 1 --block {_opts(tmp_path)}", MODEL_CELL).status == "completed"
    )


def test_bad_input_on_the_engines_is_one_error(cluster, shell, tmp_path):
    with pytest.raises(UserError) as caught:
        shell.run_cell_magic("distnn", f"train --algorithm nosuch --block {_opts(tmp_path)}", MODEL_CELL)
    assert "nosuch" in str(caught.value) and "rank" not in str(caught.value)


def test_bad_optimizer_arguments_are_one_error_in_the_cell_and_the_next_cell_trains(cluster, shell, tmp_path):
    # The workers' optimiser is built on every rank during set-up: the job fails whole, at
    # once, instead of the workers failing alone while the master waits for them.
    job = shell.run_cell_magic(
        "distnn", f'train --algorithm easgd --worker-optimizer "sgd(lr=-1.0)" {_opts(tmp_path)}', MODEL_CELL
    )
    with pytest.raises(UserError) as caught:
        job.wait(timeout=60)
    assert str(caught.value) == (
        "optimizer sgd(lr=-1.0): a learning rate below 0 climbs the loss instead of descending it: give lr above 0, "
        "e.g. sgd(lr=0.01)"
    )
    assert job.status == "failed"
    assert (
        shell.run_cell_magic("distnn", f"train --epochs 1 --block {_opts(tmp_path)}", MODEL_CELL).status == "completed"
    )


def test_bad_magic_options_print_the_usage_error(cluster, shell, capsys):
    for line, expected in [
        ("train --epochs ten", "argument --epochs: invalid int value: 'ten'"),
        ("train --topology ring", "argument --topology: invalid choice: 'ring'"),
        ("train --no-such-flag", "unrecognized arguments: --no-such-flag"),
        ("cluster start -n", "argument -n: expected one argument"),
    ]:
        result = shell.run_cell(f"%%distnn {line}\n{MODEL_CELL}")
        assert isinstance(result.error_in_exec, UsageError), line
        assert expected in str(result.error_in_exec)
        err = capsys.readouterr()
        assert "Traceback" not in err.out + err.err
    # Checked on the client, before any engine is busy.
    result = shell.run_cell(f"%%distnn train --workers 5 --block\n{MODEL_CELL}")
    assert isinstance(result.error_in_exec, UserError)
    assert "--workers" in str(result.error_in_exec)
    result = shell.run_cell("%distnn train --epochs 2")
    assert "needs a cell body" in str(result.error_in_exec)


def test_help_shows_every_option():
    from nbdist.magics import DistnnMagics

    doc = DistnnMagics.distnn.__doc__
    for f in fields(TrainOptions):
        assert flag(f.name) in doc, f.name
    for word in ("cluster", "start", "status", "--block", "last", "stop"):
        assert word in doc


def test_cluster_start_errors_name_the_cause(tmp_path):
    from nbdist.cluster import Cluster, ClusterError

    with pytest.raises(ClusterError, match="does not exist or is not executable"):
        Cluster(n=2, mpiexec=str(tmp_path / "no-mpiexec")).start()
    # Engines that die at start: the error quotes what they printed, and comes at once.
    failing = tmp_path / "mpiexec"
    failing.write_text("#!/bin/sh\necho 'mpiexec: no slots on host node17' >&2\nexit 3\n")
    failing.chmod(0o755)
    with pytest.raises(ClusterError) as caught:
        Cluster(n=2, mpiexec=str(failing), start_timeout=100).start()
    assert "exited while starting" in str(caught.value)
    assert "no slots on host node17" in str(caught.value)
    with pytest.raises(ClusterError, match="at least 1 engine"):
        Cluster(n=0)
    with pytest.raises(ClusterError, match="unknown engine launcher 'pbs'"):
        Cluster(engines="pbs")


def test_attach_to_a_running_cluster(cluster, tmp_path):
    from nbdist import cluster as clusters
    from nbdist.cluster.current import make_current

    # Engines started elsewhere (here: the module's cluster) are used, not owned.
    attached = clusters.Cluster.attach(cluster_id=cluster.id)
    try:
        assert not attached.owned and attached.n == 4
        assert [i.pid for i in attached.info] == [i.pid for i in cluster.info]
        job = nbdist.train(
            "examples/digits_mlp.py", cluster=attached, epochs=1, block=True, quiet=True, runs_dir=str(tmp_path)
        )
        assert job.status == "completed"
    finally:
        attached.stop()
        make_current(cluster)  # stopping the attached one left none in use
    assert cluster.running and len(cluster.client.ids) == 4  # disconnecting left the engines up
    with pytest.raises(clusters.ClusterError, match="no running cluster with id 'nosuch'"):
        clusters.Cluster.attach(cluster_id="nosuch")


def test_the_controller_listens_on_loopback_only(cluster):
    import psutil
    from conftest import listening

    controller = cluster._ipp.controller.process
    sockets = listening([controller, *controller.children(recursive=True)])
    assert sockets and {ip for ip, _ in sockets} == {"127.0.0.1"}, sockets
    # The engines reach it there (and their nannies listen on loopback too).
    ports = {port for _, port in sockets}
    for info in cluster.info:
        engine = psutil.Process(info.pid)
        to_controller = {c.raddr.ip for c in engine.net_connections(kind="inet") if c.raddr and c.raddr.port in ports}
        assert to_controller == {"127.0.0.1"}, (info, to_controller)
        nannies = [p for p in engine.children() if "ipyparallel.engine.nanny" in " ".join(p.cmdline())]
        assert nannies and {ip for ip, _ in listening(nannies)} <= {"127.0.0.1"}


def test_the_controller_listens_where_the_user_says():
    from nbdist.cluster import Cluster, ClusterError
    from nbdist.transport.interfaces import interface_address

    assert interface_address("lo") == "127.0.0.1"
    assert Cluster(n=2, interface="lo").ip == "127.0.0.1" and Cluster(n=2, ip="10.1.2.3").ip == "10.1.2.3"
    with pytest.raises(ClusterError, match=r"no network interface 'ib7' on this host; choose one of: .*\blo\b"):
        Cluster(n=2, interface="ib7")
    with pytest.raises(ClusterError, match="not both"):
        Cluster(n=2, interface="lo", ip="127.0.0.1")


# -- tests that break the cluster (and heal it): keep them last ---------------------------
def test_a_dead_engine_is_survived_with_a_restart_reported_and_start_replaces_it(cluster, shell, tmp_path, capsys):
    from nbdist.cluster import ClusterError

    # Allreduce cannot go on without a rank: with --max-restarts the ranks left restart
    # from the last checkpoint on their own (a job that cannot: test_cluster_faults.py).
    job = shell.run_cell_magic(
        "distnn",
        f"train --topology allreduce --epochs 60 --batch-size 8 --max-restarts 1 "
        f"--peer-timeout 5 --no-progress {_opts(tmp_path)}",
        MODEL_CELL,
    )
    deadline = time.monotonic() + 120
    while sum(r["kind"] == "epoch" for r in job.records) < 2:  # a checkpoint to restart from
        assert not job.done and time.monotonic() < deadline, job
        time.sleep(0.1)
    victim = cluster.info[2]
    os.kill(victim.pid, signal.SIGKILL)
    job.wait(180)
    assert job.status == "completed", job
    # One row per epoch, though the restart may train the epoch after its checkpoint again.
    assert job.result.final["val_acc"] > 0.9 and list(job.epochs["epoch"]) == list(range(1, 61)), job.epochs
    restarts = [r["values"] for r in job.records if r["kind"] == "restart" and r["rank"] == 0]
    assert len(restarts) == 1 and restarts[0]["ranks"] == 3, restarts
    # Said once, led by the rank that died, with its host, and how to heal the cluster.
    assert job.warning.startswith(
        f"rank 2 (engine {victim.engine_id} on {victim.host}, pid {victim.pid}) died: "
        f"its process is gone; the run went on without rank 2 and ended well"
    ), job.warning
    assert job.warning.endswith(
        "heal the cluster with  %distnn cluster start  (in Python: cluster.heal()), which restarts its engines"
    )
    capsys.readouterr()
    shell.run_line_magic("distnn", "cluster status")
    status = capsys.readouterr().out
    assert f"     2  {victim.engine_id:>6}  {victim.host:<20} {victim.pid:<8} dead: its process is gone" in status
    with pytest.raises(
        ClusterError,
        match=rf"rank 2 \(engine {victim.engine_id} on {victim.host}, pid {victim.pid}\): "
        rf"its process is gone.*%distnn cluster start",
    ):
        shell.run_cell_magic("distnn", f"train --epochs 1 --block {_opts(tmp_path)}", MODEL_CELL)
    assert shell.run_line_magic("distnn", "cluster start -n 4") is cluster
    out = capsys.readouterr().out
    assert f"rank 2 (engine {victim.engine_id}) was dead: its process is gone" in out
    assert "; restarted 4 engines" in out and "dead" not in out.split("restarted 4 engines")[1]
    assert (
        shell.run_cell_magic("distnn", f"train --epochs 1 --block {_opts(tmp_path)}", MODEL_CELL).status == "completed"
    )


def test_ranks_that_ignore_a_stop_are_left_behind_and_heal_replaces_them(cluster, shell, tmp_path, capsys):
    import psutil

    from nbdist.cluster import ClusterError

    marker = tmp_path / "rank-1-stuck"
    # Rank 1 hangs inside its forward pass, where neither stop signal gets it out.
    cell = FAILING_CELL.format(rank=1, failure=f"pathlib.Path({str(marker)!r}).touch(); time.sleep(3600)")
    job = shell.run_cell_magic("distnn", f"train --epochs 5000 --no-progress {_opts(tmp_path)}", cell)
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert not job.done, job
        assert time.monotonic() < deadline, "rank 1 never reached its hang"
        time.sleep(0.1)
    stuck = cluster.info[1]
    # stop() ends within its two timeouts, whatever the ranks do, and says what is left.
    with pytest.raises(JobError) as caught:
        job.stop(timeout=2, abandon_timeout=2)
    assert job.done and job.status == "failed"
    assert str(caught.value) == (
        "the ranks did not stop within 2 s of the stop request (SIGUSR1); rank 1 still running 2 s after being "
        "told to give up (SIGUSR2): blocked in MPI or in the model's code; heal the cluster with  "
        "%distnn cluster start  (in Python: cluster.heal()), which restarts its engines"
    )
    capsys.readouterr()
    shell.run_line_magic("distnn", "cluster status")
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.startswith("     ")}
    assert "dead: stuck: still running a job 2 s after being told to give up" in rows["1"]
    assert all(rows[r].rstrip().endswith("alive") for r in ("0", "2", "3")), rows
    # The next job fails at once, naming the engine and the cure.
    with pytest.raises(
        ClusterError,
        match=rf"^1 of 4 engines is dead: rank 1 \(engine {stuck.engine_id} on "
        rf"{stuck.host}, pid {stuck.pid}\): stuck: .*%distnn cluster start",
    ):
        shell.run_cell_magic("distnn", f"train --epochs 1 --block {_opts(tmp_path)}", MODEL_CELL)
    # Healing takes the stuck engine down with its engine set (the test above trains on a
    # healed cluster).
    said = cluster.heal()
    assert said.startswith(f"rank 1 (engine {stuck.engine_id}) was dead: stuck: ") and said.endswith(
        "restarted 4 engines"
    )
    assert not psutil.pid_exists(stuck.pid)
    assert sorted(i.rank for i in cluster.info) == [0, 1, 2, 3] and not cluster.dead_engines()
