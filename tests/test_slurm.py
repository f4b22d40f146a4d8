"""SLURM, for real: `nbdist slurm-script` (nbdist.cli.main) writes the sbatch scripts, and a real
SLURM on this machine (tests/slurm_cluster.py: munged, slurmctld and two slurmd, the
second node in a network namespace of its own, started by the `slurm` fixture) runs
them: a train over both nodes and a study complete inside their allocations, and SIGUSR1
to the batch shell (what `--signal=B:USR1@S` sends before the time limit) stops every
rank at a step boundary with a final checkpoint that a second job resumes. A notebook's
engines run as SLURM jobs (on one node, and on both with the controller on the veth
address), and a notebook attaches to a cluster started inside `salloc`.

Without Debian's `slurm-wlm` and `munge` the SLURM tests skip (fail with CI=1: .ci/run
installs them), and so do the two-node tests where no network namespace can be made;
the script's own checks need no SLURM.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from conftest import OutputLines
from slurm_cluster import FINISHED, KILL_WAIT, SlurmCluster, slurm_missing, wait_for

from nbdist.cli import main
from nbdist.errors import UserError
from nbdist.metrics import read_log
from nbdist.slurm import BatchScript, time_limit_seconds
from nbdist.store import RunStore

ROOT = Path(__file__).resolve().parent.parent
JOB_TIMEOUT = 240  # a job's whole life, queue included: a hung job fails its test


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    missing = slurm_missing()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"{missing} (.ci/run installs them)")
        pytest.skip(missing)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    yield cluster
    left = cluster.stop()
    assert not left, f"still alive after the SLURM fixture stopped: {left}\n{cluster.logs()}"


def _write_script(path: Path, *options: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`nbdist slurm-script OPTIONS` from the repository, through the command line's own
    entry point (nbdist.cli.main) in this process: a fresh Python would spend seconds on
    importing torch for the model's set-up check, before every job of this module."""
    argv = ["slurm-script", *options]
    out, err = io.StringIO(), io.StringIO()
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        os.chdir(ROOT)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    done = subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())
    assert done.returncode == 0, done.stdout + done.stderr
    return done


# Open MPI's launcher (prterun) sometimes fails this way as it starts, on this 2-core box
# under the load of other test runs (2 of about 60 jobs; not reproduced in 40 jobs on an
# idle machine): a failure before any rank ran, outside nbdist, that costs one resubmission.
PRTERUN_START_FAILURE = "The PMIx server's listener thread failed to start"


def _started(slurm: SlurmCluster, job: str, script: Path, output: Path) -> str:
    """The job once its ranks run (their first line, `nbdist: N ranks: ...`); a job whose
    prterun failed as it started is submitted again, once."""
    said = lambda: output.read_text(errors="replace") if output.exists() else ""  # noqa: E731
    wait_for(
        lambda: re.search(r"^nbdist: \d+ ranks", said(), re.M) or slurm.job(job)["JobState"] in FINISHED,
        JOB_TIMEOUT,
        f"ranks of job {job} started",
        said,
    )
    if PRTERUN_START_FAILURE in said() and slurm.job(job)["JobState"] == "FAILED":
        print(f"job {job}: Open MPI's launcher failed to start; submitting again:\n{said()}")
        job = slurm.sbatch(script)
        wait_for(
            lambda: re.search(r"^nbdist: \d+ ranks", said(), re.M) or slurm.job(job)["JobState"] in FINISHED,
            JOB_TIMEOUT,
            f"ranks of job {job} started",
            said,
        )
    return job


def _finished(slurm: SlurmCluster, job: str, output: Path) -> str:
    """Wait for `job`; its output, after checking that it completed with status 0."""
    fields = slurm.wait_job(job, JOB_TIMEOUT)
    text = output.read_text(errors="replace") if output.exists() else "(no output file)"
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), f"{fields}\n{text}\n{slurm.logs()}"
    assert "Traceback" not in text, text
    return text


# ------------------------------------------------------------------ the script, no SLURM
def test_the_script_execs_the_launcher_with_mpiexec_settings_and_the_signal():
    script = BatchScript(
        ntasks=8,
        launched=("train", "--model", "my model.py", "--epochs", "5"),
        nodes=2,
        interface="ib0",
        partition="gpu",
        time="1-12:00",
        account="phys",
        job_name="jets run",
        output="logs/%x-%j.out",
        signal_seconds=600,
        workdir="/scratch/me",
        python="/opt/venv/bin/python",
    )
    text = script.text()
    assert text.startswith("#!/bin/bash\n")
    sbatch = [line.removeprefix("#SBATCH ") for line in text.splitlines() if line.startswith("#SBATCH ")]
    assert sbatch == [line.removeprefix("#SBATCH ") for line in script.sbatch_options()]
    assert sbatch == [
        '--job-name="jets run"',
        "--ntasks=8",
        "--nodes=2",
        "--partition=gpu",
        "--time=1-12:00",
        "--account=phys",
        "--output=logs/%x-%j.out",
        "--chdir=/scratch/me",
        "--signal=B:USR1@600",
    ]
    # exec: the launcher replaces the batch shell, which is what B: signals.
    assert text.splitlines()[-1] == (
        'exec /opt/venv/bin/python -m nbdist launch -n "$SLURM_NTASKS" --interface ib0 '
        "train --model 'my model.py' --epochs 5"
    )
    assert time_limit_seconds("1-12:00") == 36 * 3600 and time_limit_seconds("90") == 5400
    assert time_limit_seconds("01:30:00") == 5400 and time_limit_seconds("2:30") == 150


def test_option_strings_are_quoted_never_run(tmp_path, capsys):
    marker = tmp_path / "ran"
    assert (
        main(
            [
                "slurm-script",
                "-n",
                "2",
                "--chdir",
                str(tmp_path),
                "--write",
                str(tmp_path / "job.sh"),
                "--no-setup-check",  # m.py is not there: the quoting is what is tried
                "--",
                "train",
                "--model",
                f"m.py; touch {marker}",
                "--run-name",
                "$(touch x)",
            ]
        )
        == 0
    )
    text = (tmp_path / "job.sh").read_text()
    assert f"--model 'm.py; touch {marker}' --run-name '$(touch x)'" in text
    # bash -n parses it: one command, its arguments whole.
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sh")]).returncode == 0
    assert not marker.exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["-n", "4", "--", "trian", "--model", "m.py"],
            "slurm-script runs one of: train, study, scale, datasets (got 'trian')",
        ),
        (["-n", "4"], "slurm-script runs one of: train, study, scale, datasets, after --"),
        (["-n", "4", "--", "train", "--bogus"], "in the nbdist command after --: unrecognized arguments: --bogus"),
        (["-n", "4", "--", "train", "--epochs", "x"], "in the nbdist command after --: argument --epochs"),
        (["-n", "0", "--", "train"], "--ntasks must be at least 1, got 0"),
        (["-n", "2", "--nodes", "3", "--", "train"], "--nodes must be between 1 and --ntasks (2), got 3"),
        (["-n", "4", "--time", "1:2:3:4", "--", "train"], "--time '1:2:3:4' is not a SLURM time limit"),
        (
            ["-n", "4", "--time", "6", "--", "train"],
            "--time 6 (360 s) leaves no time to train before the stop signal 300 s "
            "before its end (SLURM may send it up to 60 s earlier still)",
        ),
        (["-n", "4", "--signal-seconds", "0", "--", "train"], "--signal-seconds must be between 1 and 65535"),
        (["-n", "4", "--job-name", 'a"b', "--", "train"], "--job-name 'a\"b': an #SBATCH value cannot"),
        (["-n", "4", "--partition", "", "--", "train"], "--partition '': an #SBATCH value cannot be empty"),
    ],
)
def test_bad_input_is_one_line_naming_it(argv, message, capsys):
    assert main(["slurm-script", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith(f"nbdist: error: {message}") and err.count("\n") == 1, err


def test_engines_template_runs_one_mpiexec_in_the_allocation():
    from nbdist.slurm import engines_batch_template

    template = engines_batch_template(
        ["/opt/venv/bin/mpiexec", "--with-ft", "ulfm"], partition="gpu", time="01:00:00", account="a{b}", nodes=2
    )
    text = template.format(
        n=8, cluster_id="c1", output_file="/tmp/e.log", program_and_args="python -m ipyparallel.engine"
    )
    assert "#SBATCH --ntasks=8" in text and "#SBATCH --job-name=nbdist-engines-c1" in text
    assert "#SBATCH --nodes=2" in text
    assert "#SBATCH --partition=gpu" in text and "#SBATCH --time=01:00:00" in text and "#SBATCH --account=a{b}" in text
    assert text.splitlines()[-1] == (
        'exec /opt/venv/bin/mpiexec --with-ft ulfm -n "$SLURM_NTASKS" --bind-to none python -m ipyparallel.engine'
    )


def test_slurm_options_without_slurm_engines_say_so():
    pytest.importorskip("ipyparallel")
    from nbdist.cluster import Cluster, ClusterError

    with pytest.raises(ClusterError, match=r"partition, time belong to engines submitted to SLURM: add --slurm"):
        Cluster(n=2, partition="gpu", time="10")
    with pytest.raises(UserError, match="--time 'soon' is not a SLURM time limit"):
        Cluster(n=2, engines="slurm", time="soon").start()


# ------------------------------------------------------------------ on a real SLURM
def _need_two_nodes(slurm: SlurmCluster) -> None:
    if not slurm.two_nodes:
        if os.environ.get("CI"):
            pytest.fail(f"no second SLURM node: {slurm.one_node_why}")
        pytest.skip(f"no second SLURM node on this machine: {slurm.one_node_why}")


@pytest.mark.mpi
@pytest.mark.timeout(400)
def test_an_sbatch_train_on_two_nodes_completes_with_ranks_on_both(slurm, tmp_path):
    _need_two_nodes(slurm)
    script, output = tmp_path / "train.sh", tmp_path / "train.out"
    _write_script(
        script,
        "-n",
        "2",
        "--nodes",
        "2",
        "--interface",
        slurm.interface,
        "--partition",
        slurm.two_node_partition,
        "--time",
        "10",
        "--job-name",
        "digits",
        "--output",
        str(output),
        "--write",
        str(script),
        "--",
        "train",
        "--model",
        "examples/digits_cnn.py",
        "--topology",
        "allreduce",
        "--epochs",
        "5",
        "--runs-dir",
        str(tmp_path),
        "--run-name",
        "cnn",
    )
    between = psutil.net_io_counters(pernic=True)[slurm.interface]
    job = _started(slurm, slurm.sbatch(script), script, output)
    text = _finished(slurm, job, output)
    after = psutil.net_io_counters(pernic=True)[slurm.interface]
    fields = slurm.job(job)
    assert (fields["JobName"], fields["NumNodes"], fields["NumTasks"]) == ("digits", "2", "2"), fields
    summary = json.loads((tmp_path / "cnn" / "summary.json").read_text())
    assert summary["stop_reason"] == "completed 5 epochs", summary["stop_reason"]
    assert summary["final"]["val_acc"] > 0.9, summary["final"]
    # Two ranks of one allreduce run, one on each of the allocation's two nodes, started by
    # one mpiexec (its daemon on the second through srun): all their gradients cross the
    # veth pair.
    assert "nbdist: 2 ranks: 2 workers, allreduce" in text, text
    hosts = {r["rank"]: r["values"]["host"] for r in read_log(tmp_path / "cnn", "run")}
    assert sorted(hosts) == [0, 1] and set(hosts.values()) == set(slurm.nodes), hosts
    # SLURM's own part of a job (srun hostname) sends about 9 kB: a megabyte is the run's.
    sent, received = after.bytes_sent - between.bytes_sent, after.bytes_recv - between.bytes_recv
    assert sent > 1e6 and received > 1e6, (sent, received)
    assert f"nbdist: results in {tmp_path / 'cnn'}" in text, text


@pytest.mark.mpi
@pytest.mark.timeout(400)
def test_a_submitted_study_runs_its_trials(slurm, tmp_path):
    output = tmp_path / "study.out"
    done = _write_script(
        tmp_path / "study.sh",
        "-n",
        "3",
        "--time",
        "00:15:00",
        "--output",
        str(output),
        "--submit",
        "--write",
        str(tmp_path / "study.sh"),
        "--",
        "study",
        "--model",
        "examples/digits_mlp.py",
        "--space",
        "lr=log(3e-3,0.5) hidden=int(8,64)",
        "--searcher",
        "random",
        "--trials",
        "4",
        "--groups",
        "2",
        "--workers",
        "1",
        "--topology",
        "allreduce",
        "--epochs",
        "2",
        "--seed",
        "1",
        "--runs-dir",
        str(tmp_path),
        "--study-name",
        "batch",
        env=slurm.env,
    )
    assert done.stdout.splitlines()[-1].startswith("nbdist: submitted batch job "), done.stdout
    job = _started(slurm, done.stdout.split()[-1], tmp_path / "study.sh", output)
    text = _finished(slurm, job, output)
    assert "nbdist: study batch: 4 trials done" in text, text
    with RunStore(tmp_path / "nbdist.db") as store:
        assert store.study("batch")["status"] == "completed"
        trials = store.trials("batch")
        assert [t.number for t in trials] == [0, 1, 2, 3] and {t.state for t in trials} == {"complete"}
        assert {t.group for t in trials} == {0, 1}


def _epochs_logged(run_dir: Path) -> int:
    path = run_dir / "metrics" / "rank-00000.jsonl"
    return path.read_text(errors="replace").count('"kind":"epoch"') if path.exists() else 0


# Far more epochs than the signal lets the job train: 500 of digits took 12 s once
# checkpoints were written off the training loop, and a whole-suite run's job completed
# them before the signal reached it.
EPOCHS_UNTIL_STOPPED = 20000


@pytest.mark.mpi
@pytest.mark.timeout(400)
def test_the_signal_before_the_time_limit_stops_at_a_checkpoint_that_resumes(slurm, tmp_path):
    run = tmp_path / "run"
    script, output = tmp_path / "long.sh", tmp_path / "long.out"
    _write_script(
        script,
        "-n",
        "2",
        "--time",
        "10",
        "--signal-seconds",
        "120",
        "--output",
        str(output),
        "--write",
        str(script),
        "--",
        "train",
        "--model",
        "examples/digits_mlp.py",
        "--algorithm",
        "easgd",
        "--epochs",
        str(EPOCHS_UNTIL_STOPPED),
        "--runs-dir",
        str(tmp_path),
        "--run-name",
        "run",
    )
    job = _started(slurm, slurm.sbatch(script), script, output)
    wait_for(lambda: _epochs_logged(run) >= 1 or slurm.job(job)["JobState"] != "RUNNING", JOB_TIMEOUT, "first epoch")
    # What slurmctld sends at --signal=B:USR1@120: SIGUSR1 to the batch shell only.
    slurm.command("scancel", "--batch", "--signal=USR1", job)
    text = _finished(slurm, job, output)
    assert "nbdist: SIGUSR1: every rank stops at its next step" in text, text
    summary = json.loads((run / "summary.json").read_text())
    stopped_at = summary["epochs_run"]
    assert summary["stop_reason"].startswith("stopped") and 1 <= stopped_at < EPOCHS_UNTIL_STOPPED, summary[
        "stop_reason"
    ]
    latest = json.loads((run / "checkpoints" / "LATEST.json").read_text())["label"]
    assert latest.startswith("stopped-"), latest
    assert sorted(p.name for p in (run / "checkpoints" / latest).glob("rank-*.safetensors")) == [
        "rank-00000.safetensors",
        "rank-00001.safetensors",
    ]
    assert read_log(run, "run") and {r["values"].get("status") for r in read_log(run, "run") if r["rank"] == 0} == {
        "stopped"
    }

    # A second job goes on from the stop checkpoint.
    script, output = tmp_path / "resume.sh", tmp_path / "resume.out"
    _write_script(
        script,
        "-n",
        "2",
        "--time",
        "10",
        "--output",
        str(output),
        "--write",
        str(script),
        "--",
        "train",
        "--resume",
        str(run),
        "--epochs",
        str(stopped_at + 1),
    )
    text = _finished(slurm, _started(slurm, slurm.sbatch(script), script, output), output)
    assert f"resumed from {run / 'checkpoints' / latest} at epoch" in text, text
    resumed = json.loads((run / "summary.json").read_text())
    assert resumed["stop_reason"] == f"completed {stopped_at + 1} epochs", resumed["stop_reason"]
    assert [h["epoch"] for h in resumed["history"]] == list(range(1, stopped_at + 2))


# ------------------------------------------------------------------ a notebook's engines as a SLURM job
MODEL_CELL = """
import torch.nn as nn
model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
"""


@pytest.mark.mpi
@pytest.mark.timeout(400)
def test_notebook_engines_submitted_to_slurm_train_stop_and_leave_with_the_cluster(
    slurm, tmp_path, monkeypatch, capsys
):
    pytest.importorskip("ipyparallel")
    from IPython.core.interactiveshell import InteractiveShell

    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))  # the notebook's sbatch and squeue find this cluster
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbdist")
    cluster = shell.run_line_magic("distnn", f"cluster start -n 2 --slurm --partition {slurm.partition} --time 10")
    try:
        out = capsys.readouterr().out
        job_id = re.search(r"nbdist: engines job (\d+): ", out).group(1)
        assert "nbdist: starting 2 MPI engines as a SLURM job ..." in out, out
        assert f"engines job {job_id}: running on {slurm.node}" in out, out
        fields = slurm.job(job_id)
        assert (fields["JobState"], fields["NumTasks"], fields["Partition"], fields["TimeLimit"]) == (
            "RUNNING",
            "2",
            slurm.partition,
            "00:10:00",
        ), fields
        # One MPI job of 2 ranks inside the allocation.
        assert sorted(i.rank for i in cluster.info) == [0, 1] and {i.size for i in cluster.info} == {2}
        engines = [psutil.Process(i.pid) for i in cluster.info]
        assert all(p.environ().get("SLURM_JOB_ID") == job_id for p in engines)
        # The job's script is kept with the engines' log, not in the notebook's directory.
        assert fields["Command"].endswith(f"/log/nbdist-engines-{cluster.id}.sbatch"), fields["Command"]
        assert not (Path.cwd() / "slurm_engine.sbatch").exists()

        job = shell.run_cell_magic(
            "distnn", f"train --topology allreduce --epochs 3 --block --quiet --runs-dir {tmp_path}", MODEL_CELL
        )
        assert job.status == "completed" and job.result.final["val_acc"] > 0.8, job

        # job.stop(): SIGUSR1 through scancel --batch to mpiexec, forwarded to every engine.
        job = shell.run_cell_magic(
            "distnn", f"train --epochs 5000 --checkpoint-every 1000 --quiet --runs-dir {tmp_path}", MODEL_CELL
        )
        wait_for(lambda: job.records or job.done, 120, "records from the long job")
        job.stop()
        job.wait(timeout=120)
        assert job.status == "stopped", job
        assert slurm.job(job_id)["JobState"] == "RUNNING"  # the engines live on for the next cell
    finally:
        shell.run_line_magic("distnn", "cluster stop")
    assert slurm.wait_job(job_id, 60)["JobState"] == "CANCELLED"
    # SIGTERM from scancel ends them; one that hangs on its way out (in MPI_Finalize after a
    # stopped job, seen under load) gets SLURM's SIGKILL KillWait seconds later.
    gone, alive = psutil.wait_procs(engines, timeout=KILL_WAIT + 60)
    assert not alive, alive

    # A job SLURM refuses is one error with SLURM's reason, and nothing is left running.
    from nbdist.cluster import Cluster, ClusterError

    with pytest.raises(ClusterError, match="SLURM refused the engines job: invalid partition specified: nowhere"):
        Cluster(n=2, engines="slurm", partition="nowhere").start()
    gone, alive = psutil.wait_procs(engines, timeout=60)
    assert not alive, alive


@pytest.mark.mpi
@pytest.mark.timeout(400)
def test_notebook_engines_on_the_other_node_reach_the_controller_encrypted_and_train(
    slurm, tmp_path, monkeypatch, capsys
):
    """The controller listens on the interface between the nodes (CurveZMQ on); the
    engines, spread over both nodes by SLURM, connect to it from the other namespace."""
    pytest.importorskip("ipyparallel")
    _need_two_nodes(slurm)
    from IPython.core.interactiveshell import InteractiveShell

    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "nbdist")
    cluster = shell.run_line_magic(
        "distnn",
        f"cluster start -n 2 --slurm --nodes 2 --partition "
        f"{slurm.two_node_partition} --interface {slurm.interface} --time 10",
    )
    try:
        out = capsys.readouterr().out
        job_id = re.search(r"nbdist: engines job (\d+): ", out).group(1)
        assert f"controller on {slurm.addresses[slurm.node]} (CurveZMQ)" in out, out
        assert {i.host for i in cluster.info} == set(slurm.nodes), cluster.status()
        assert slurm.job(job_id)["NumNodes"] == "2"
        job = shell.run_cell_magic(
            "distnn", f"train --topology allreduce --epochs 3 --block --quiet --runs-dir {tmp_path}", MODEL_CELL
        )
        assert job.status == "completed" and job.result.final["val_acc"] > 0.8, job
    finally:
        shell.run_line_magic("distnn", "cluster stop")
    assert slurm.wait_job(job_id, 60)["JobState"] == "CANCELLED"


KERNEL = """
import time
import nbdist
from nbdist.cluster.launchers import controller_processes
cluster = nbdist.Cluster(n=2, engines="slurm", time="10").start()
print("JOB", *[s.job_id for s in cluster._ipp.engines.values()], flush=True)
print("PIDS", *[i.pid for i in cluster.info], flush=True)
print("CONTROLLER", *[p.pid for p in controller_processes(cluster._ipp)], flush=True)
time.sleep(600)
"""


@pytest.mark.mpi
@pytest.mark.timeout(400)
def test_a_killed_kernel_takes_its_slurm_engines_job_with_it(slurm, tmp_path):
    log = open(tmp_path / "kernel.txt", "w+")
    kernel = subprocess.Popen(
        [sys.executable, "-c", KERNEL], cwd=ROOT, env=slurm.env, stdout=log, stderr=subprocess.STDOUT
    )
    try:
        said = lambda: (tmp_path / "kernel.txt").read_text()  # noqa: E731
        wait_for(lambda: "PIDS" in said() or kernel.poll() is not None, 180, "engines started", said)
        assert kernel.poll() is None, said()
        job = re.search(r"^JOB (\d+)$", said(), re.M).group(1)
        engines = [psutil.Process(int(pid)) for pid in re.search(r"^PIDS (.+)$", said(), re.M).group(1).split()]
        wait_for(lambda: "CONTROLLER" in said(), 30, "the controller's processes", said)
        controller = [psutil.Process(int(pid)) for pid in re.search(r"^CONTROLLER(.*)$", said(), re.M).group(1).split()]
        kernel.kill()  # kill -9: no atexit hook runs
        kernel.wait(timeout=30)
        assert slurm.wait_job(job, 60)["JobState"] == "CANCELLED"
        # The engines go with the job, the controller (and its schedulers) with the kernel.
        gone, alive = psutil.wait_procs(engines + controller, timeout=60)
        assert not alive, alive
        # ...and the kernel's watchdogs leave once they have done it.
        watchdogs = [
            p
            for p in psutil.process_iter(["cmdline"])
            if "watchdog.py" in " ".join(p.info["cmdline"] or [])
            and f"--parent {kernel.pid}:" in " ".join(p.info["cmdline"] or [])
        ]
        gone, alive = psutil.wait_procs(watchdogs, timeout=60)
        assert not alive, alive
    finally:
        if kernel.poll() is None:
            kernel.kill()
            kernel.wait(timeout=30)
        log.close()


SALLOC_KERNEL = """
import os
import sys
import psutil
import nbdist
with nbdist.Cluster(n=2, cluster_id=sys.argv[1]) as cluster:
    print("RANKS", *sorted(i.rank for i in cluster.info), flush=True)
    engines = [psutil.Process(i.pid) for i in cluster.info]
    # Each engine's nanny (ipyparallel's watcher) too: it leaves a few seconds after it.
    print("PIDS", *[p.pid for e in engines for p in [e, *e.children(recursive=True)]], flush=True)
    print("JOBS", *sorted({psutil.Process(i.pid).environ().get("SLURM_JOB_ID") for i in cluster.info}), flush=True)
    print("ATTACH", flush=True)
    sys.stdin.readline()  # another notebook attached, trained and disconnected
    print("ANSWER", *sorted(cluster.view.apply_sync(os.getpid)), flush=True)  # still this one's engines
"""


@pytest.mark.mpi
@pytest.mark.timeout(400)
def test_a_cluster_inside_an_salloc_allocation_serves_an_attached_notebook_and_stops_with_nothing_left(
    slurm, tmp_path, capsys
):
    pytest.importorskip("ipyparallel")
    from IPython.core.interactiveshell import InteractiveShell

    # 2 engines in a 2-task allocation, started from inside it.
    cluster_id = f"salloc-{os.getpid()}"
    owner = subprocess.Popen(
        ["salloc", "-n", "2", "--time", "5", sys.executable, "-c", SALLOC_KERNEL, cluster_id],
        cwd=ROOT,
        env=slurm.env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    said = OutputLines(owner)
    started: list[psutil.Process] = []
    try:
        assert said.wait_for(r"^ATTACH$", JOB_TIMEOUT), said.text
        assert "RANKS 0 1\n" in said.text, said.text
        job = re.search(r"salloc: Granted job allocation (\d+)", said.text).group(1)
        assert f"JOBS {job}\n" in said.text, said.text  # the engines ran in the allocation
        started = [psutil.Process(int(pid)) for pid in re.search(r"^PIDS (.+)$", said.text, re.M).group(1).split()]

        # Another notebook attaches to them, trains a cell and disconnects.
        shell = InteractiveShell.instance()
        shell.run_line_magic("load_ext", "nbdist")
        attached = shell.run_line_magic("distnn", f"cluster attach --cluster-id {cluster_id}")
        assert "(mpi, attached)" in capsys.readouterr().out
        assert not attached.owned and sorted(i.rank for i in attached.info) == [0, 1]
        pids = sorted(i.pid for i in attached.info)
        trained = shell.run_cell_magic(
            "distnn", f"train --topology allreduce --epochs 3 --block --quiet --runs-dir {tmp_path}", MODEL_CELL
        )
        assert trained.status == "completed" and trained.result.final["val_acc"] > 0.8, trained
        shell.run_line_magic("distnn", "cluster stop")
        assert all(psutil.pid_exists(pid) for pid in pids)  # left to their owner...

        owner.stdin.write("go on\n")
        owner.stdin.flush()
        answer = said.wait_for(r"^ANSWER (.+)$", 60)  # ...which still uses them
        assert answer and sorted(map(int, answer.group(1).split())) == pids, said.text
        assert owner.wait(timeout=JOB_TIMEOUT) == 0, said.text
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait(timeout=30)
    # The engines ended with the owner's cluster, their nannies soon after: nothing
    # outlives the allocation (a one-node SLURM's proctrack/linuxproc would not catch
    # orphans either).
    assert len(started) <= 4
    gone, alive = psutil.wait_procs(started, timeout=30)
    assert not alive, alive


# ------------------------------------------------------------------ the controller beyond loopback
def _outside_address() -> str | None:
    for name, addresses in psutil.net_if_addrs().items():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return name
    return None


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_a_controller_listening_beyond_loopback_answers_only_curve_clients():
    """Engines on compute nodes reach the controller on a network interface: there it
    encrypts (CurveZMQ), and a client without its key is not answered."""
    pytest.importorskip("ipyparallel")
    import ipyparallel as ipp

    from nbdist.cluster import Cluster

    interface = _outside_address()
    if interface is None:
        pytest.skip("no network interface beyond loopback on this machine")
    with Cluster(n=2, interface=interface) as cluster:
        assert cluster.encrypted and "(CurveZMQ)" in cluster.status()
        assert sorted(i.rank for i in cluster.info) == [0, 1]  # the engines got in with the key
        security = Path(cluster._ipp.profile_dir) / "security"
        connection = json.loads((security / f"ipcontroller-{cluster.id}-client.json").read_text())
        assert connection["curve_serverkey"] and connection["interface"].endswith(cluster.ip)
        with ipp.Client(connection, timeout=30) as client:
            assert sorted(client[:].apply_sync(os.getpid)) == sorted(i.pid for i in cluster.info)
        assert _keyless_client(connection) in ("no answer", "still sending its request")
    assert not Cluster(n=2).encrypted


# A client of the controller's connection file (read from stdin: it holds the session key)
# without the controller's CurveZMQ key. ipyparallel's Client sends its connection request
# before it starts its timeout, and zmq blocks that send for as long as no peer is
# connected: where the failed handshake has already dropped the connection, it never returns.
KEYLESS_CLIENT = """
import json, sys
import ipyparallel as ipp
connection = {**json.load(sys.stdin), "curve_serverkey": None}
try:
    ipp.Client(connection, timeout=2)
except TimeoutError:
    print("no answer", flush=True)
else:
    print("answered", flush=True)
"""


def _keyless_client(connection: dict) -> str:
    """What a client without the controller's key got within 60 s, in a process of its own."""
    process = subprocess.Popen(
        [sys.executable, "-c", KEYLESS_CLIENT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = process.communicate(json.dumps(connection), timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        return "still sending its request"
    assert process.returncode == 0, err[-2000:]
    return out.strip()
