"""Rank failures under a real `python -m nbdist launch` (mpiexec with MPI fault tolerance on):
the run goes on without a dead or frozen asynchronous worker, an allreduce run restarts on
the survivors from its checkpoint, and SIGTERM stops a 10M-parameter run with a final
checkpoint that a resume continues from.

Failures are injected from outside, as a user or the batch system would: SIGKILL, SIGSTOP
and SIGTERM to the processes of the job, found by their MPI rank in their environment.
Every wait has a deadline; a run that hangs fails its test through it.

An allreduce run (MPI's own reductions) restarting on its survivors is tested with its
resume on the original size, in tests/test_resume_anywhere_mpi.py: one run for both.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from nbdist.launch import mpi_env
from nbdist.metrics import read_log

pytestmark = pytest.mark.mpi

ROOT = Path(__file__).resolve().parent.parent
MLP = str(ROOT / "examples" / "digits_mlp.py")
BIG_MLP = str(ROOT / "tests" / "models" / "big_mlp.py")


class Launched:
    """`python -m nbdist launch -n N train ...` in the background, its output in a file."""

    def __init__(self, tmp_path: Path, ranks: int, *args: str):
        self.log_path = tmp_path / "output.txt"
        self.log = open(self.log_path, "w+")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nbdist", "launch", "-n", str(ranks), "train", *args],
            cwd=ROOT,
            # A rank that dies of a crash (SIGSEGV, SIGABRT) says where, on its stderr.
            env={**mpi_env(), "PYTHONFAULTHANDLER": "1"},
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    @property
    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def rank(self, rank: int) -> psutil.Process:
        """The process of MPI rank `rank` (its environment says which it is). Looked for
        again for a few seconds: on a loaded machine one pass over the process tree once
        missed a rank of a job that was training, cause not established (a pass skips any
        process it cannot read at that moment)."""
        deadline = time.monotonic() + 10
        while True:
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                try:
                    if child.environ().get("OMPI_COMM_WORLD_RANK") == str(rank) and "nbdist" in " ".join(
                        child.cmdline()
                    ):
                        return child
                except psutil.Error:
                    continue
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"no process of rank {rank}:\n{self.output}")
            time.sleep(0.2)

    def processes(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return []

    def watch_ranks(self, ranks: int) -> RankWatch:
        """From now until the job ends: when each of its `ranks` processes went, and how."""
        return RankWatch({rank: self.rank(rank) for rank in range(ranks)}, self.proc)

    def wait_for(self, condition, what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.proc.poll() is None, f"the job ended before {what}:\n{self.output}"
            assert time.monotonic() < deadline, f"no {what} within {timeout} s:\n{self.output}"
            time.sleep(0.1)

    def finish(self, timeout: float = 180) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for child in self.processes():
                child.kill()
            self.proc.kill()
            pytest.fail(f"the job hung for {timeout} s:\n{self.output}")
        finally:
            self.log.close()


class RankWatch:
    """Looks at a job's rank processes every few milliseconds, from a thread, until the
    job ends: when each one went and, when it was seen as a zombie before mpiexec reaped
    it, its exit status; for the report of a test that lost more ranks than it killed."""

    def __init__(self, processes: dict[int, psutil.Process], job: subprocess.Popen):
        self.pids = {rank: process.pid for rank, process in processes.items()}
        self.started = time.monotonic()
        self.marks: dict[int, str] = {}
        self.went: dict[int, str] = {}
        self._job = job
        self._thread = threading.Thread(target=self._watch, name="rank-watch", daemon=True)
        self._thread.start()

    def mark(self, rank: int, what: str) -> None:
        """What the test did to `rank` (said in the report)."""
        self.marks[rank] = f"{what} at {time.monotonic() - self.started:.2f} s"

    def _watch(self) -> None:
        while True:
            ended = self._job.poll() is not None
            for rank, pid in self.pids.items():
                if rank not in self.went:
                    fate = _fate(pid)
                    if fate is not None:
                        self.went[rank] = f"{fate} at {time.monotonic() - self.started:.2f} s"
            if ended or len(self.went) == len(self.pids):
                return
            time.sleep(0.01)

    def report(self, output: str, run_dir: Path) -> str:
        """Every rank's fate, the output's lines about ranks and failures, and what the
        run log and failure.json say of them."""
        self._thread.join(timeout=5)
        lines = ["the ranks (times from the start of the watch):"]
        for rank, pid in self.pids.items():
            fate = self.went.get(rank, "alive when the job ended")
            did = f"; {self.marks[rank]}" if rank in self.marks else ""
            lines.append(f"  rank {rank} pid {pid}: {fate}{did}")
        lines.append("the output's lines about ranks and failures:")
        telling = re.compile(r"rank \d|died|did not|frozen|killed|dropped|lost|error|restart|Traceback|signal")
        lines += [f"  {line}" for line in output.splitlines() if telling.search(line)]
        lines.append("the run log's run, fault and restart records (rank in the attempt's communicator):")
        for record in read_log(run_dir):
            if record["kind"] in ("run", "fault", "restart"):
                lines.append(f"  rank {record['rank']} {record['role']} {record['kind']}: {record['values']}")
        failure = run_dir / "failure.json"
        lines.append(f"failure.json: {failure.read_text() if failure.exists() else 'none'}")
        return "\n".join(lines)


def _fate(pid: int) -> str | None:
    """None while process `pid` runs; else how it ended, as far as /proc still tells: its
    exit status while it is a zombie (field 52 of its stat), nothing once it is reaped."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
    except OSError:
        return "gone (reaped before its exit status was seen)"
    if fields[0] not in (b"Z", b"X"):
        return None
    status = int(fields[49]) if len(fields) > 49 else -1
    if status < 0:
        return "exited (status unknown)"
    if status & 0x7F:
        number = status & 0x7F
        return f"killed by {signal.Signals(number).name if number in signal.valid_signals() else number}"
    return f"exited with status {status >> 8}"


def _epochs_logged(run_dir: Path) -> int:
    path = run_dir / "metrics" / "rank-00000.jsonl"
    if not path.exists():
        return 0
    return path.read_text(errors="replace").count('"kind":"epoch"')


def _asynchronous_job(tmp_path: Path, ranks: int, epochs: int, peer_timeout: int, *extra: str) -> Launched:
    """EASGD on digits, 1 master + ranks - 1 workers, into tmp_path/run."""
    return Launched(
        tmp_path,
        ranks,
        *("--model", MLP, "--algorithm", "easgd", "--epochs", str(epochs), "--batch-size", "16"),
        *("--peer-timeout", str(peer_timeout), "--runs-dir", str(tmp_path), "--run-name", "run", "--quiet"),
        *extra,
    )


@pytest.mark.timeout(400)
def test_a_dead_and_a_frozen_asynchronous_worker_are_dropped_and_the_run_completes(tmp_path):
    """A 2 s peer timeout drops both some dozens of epochs after the fifth, the faster the
    epochs the later (on a fast box, an epoch of this job takes a few hundredths of a
    second): `epochs` leaves the run many more after the drops (a loaded box slows the
    epochs, not the timeout)."""
    run = tmp_path / "run"
    epochs = 200
    job = _asynchronous_job(tmp_path, 5, epochs, 2)
    job.wait_for(lambda: _epochs_logged(run) >= 5, "fifth epoch")
    dead, frozen = job.rank(2), job.rank(3)
    dead.kill()
    frozen.suspend()
    try:
        job.wait_for(lambda: "rank 3 (worker 2, host" in job.output, "message about the frozen worker")
    finally:
        frozen.resume()  # it wakes up into a run that went on without it
    assert job.finish() == 0, job.output
    out = job.output
    assert "rank 2 (worker 1, host" in out and "died; the run goes on with" in out, out
    assert "the run goes on with 2 workers" in out, out
    assert "Traceback" not in out and "NBC_Progress" not in out, out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == f"completed {epochs} epochs"
    assert sorted(d["rank"] for d in summary["dropped"]) == [2, 3], summary["dropped"]
    ended = [r["values"] for r in read_log(run, "run")]
    master_end = next(v for v in ended if "dropped" in v)
    assert sorted(d["rank"] for d in master_end["dropped"]) == [2, 3], master_end
    # The frozen worker, once awake, was told it had been dropped, and left.
    assert {r["rank"]: r["values"]["status"] for r in read_log(run, "run")}[3] == "dropped"
    # From the epoch after the drops, the two workers left share the whole training set.
    history = summary["history"]
    assert history[-1]["samples"] == 1437 and history[-1]["workers"] == 2, history[-1]
    # Every epoch's samples that never came: a late share counts in a later epoch.
    lost = sum(1437 - h["samples"] for h in history)
    assert lost == master_end["samples_lost"] == summary["samples_lost"] > 0, (lost, master_end)
    assert not job.processes(), "a process of the job was left behind"


@pytest.mark.timeout(400)
def test_a_frozen_asynchronous_worker_holds_up_no_epoch_and_a_sigterm_is_named(tmp_path):
    """kill -STOP of one of three workers, with a 5 s peer timeout: the run goes on
    ending epochs, validating and checkpointing while it is frozen (its share of those
    epochs is pending), it is dropped with one line at the timeout, and SIGTERM to the
    launcher (which passes it on as SIGUSR1) is named in the run's summary.

    It is frozen at the worst moment for the checkpoints: told to save its share of a
    snapshot, with the share written and not yet acknowledged (a snapshot waited for it
    until the peer timeout dropped it, and no checkpoint was committed while it was
    frozen). Found by its share in the snapshot's directory, polled with no sleep: a
    window missed is the next snapshot's, five epochs later."""
    run = tmp_path / "run"
    job = _asynchronous_job(tmp_path, 4, 100000, 5, "--checkpoint-every", "5", "--keep-checkpoints", "100000")
    job.wait_for(lambda: _epochs_logged(run) >= 3, "third epoch")
    frozen = job.rank(3)
    deadline = time.monotonic() + 120
    while not list((run / "checkpoints").glob(".tmp-epoch-*/rank-00003.json")):
        assert job.proc.poll() is None and time.monotonic() < deadline, f"no share of rank 3 seen:\n{job.output}"
    frozen.suspend()
    try:
        job.wait_for(lambda: "rank 3 (worker 2, host" in job.output, "message about the frozen worker", timeout=200)
    finally:
        frozen.resume()  # it wakes up into a run that went on without it
    dropped_epochs = _epochs_logged(run)
    job.wait_for(lambda: _epochs_logged(run) >= dropped_epochs + 3, "epochs after the drop")
    job.proc.send_signal(signal.SIGTERM)
    assert job.finish() == 0, job.output
    out = job.output
    # Silent for the peer timeout: it sent nothing, or did not take its last reply.
    dropped = (
        r"rank 3 \(worker 2, host [^)]*\) (sent nothing|did not take its reply) for 5 s .*; the run goes on with 2"
    )
    assert len(re.findall(dropped, out)) == 1, out
    assert "Traceback" not in out, out

    master = [json.loads(line) for line in (run / "metrics" / "rank-00000.jsonl").read_text().splitlines()]
    fault = next(r for r in master if r["kind"] == "fault")
    assert fault["values"]["rank"] == 3 and fault["values"]["workers_left"] == 2, fault
    # The epochs that ended while it was frozen, before it was dropped: each without its
    # share (pending), and each validated.
    while_frozen = [r["values"] for r in master if r["kind"] == "epoch" and r["seq"] < fault["seq"]]
    behind = [v for v in while_frozen if v.get("workers_behind") == 1]
    assert len(behind) >= 5, while_frozen[-3:]
    assert all(v["samples_pending"] > 0 and "val_loss" in v for v in behind), behind[:2]
    assert [v["epoch"] for v in while_frozen] == list(range(1, len(while_frozen) + 1))
    # A checkpoint was committed while it was frozen: without its share.
    committed_while_frozen = [
        c
        for c in (run / "checkpoints").glob("epoch-*")
        if json.loads((c / "meta.json").read_text())["time"] < fault["time"]
        and int(c.name.split("-")[1]) > behind[0]["epoch"]
    ]
    assert committed_while_frozen, sorted(p.name for p in (run / "checkpoints").iterdir())
    assert not list(committed_while_frozen[0].glob("rank-00003.*")), committed_while_frozen[0]
    assert list(committed_while_frozen[0].glob("rank-00002.*"))

    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == "stopped by SIGTERM", summary["stop_reason"]
    assert "stopped by SIGTERM" in out and "SIGUSR1" not in out, out
    assert [d["rank"] for d in summary["dropped"]] == [3], summary["dropped"]
    assert summary["samples_lost"] == sum(1437 - h["samples"] for h in summary["history"]) > 0
    assert not job.processes(), "a process of the job was left behind"


@pytest.mark.timeout(400)
def test_a_rank_killed_in_an_allreduce_on_a_gloo_group_is_named_and_the_survivors_restart(tmp_path):
    """The same on a torch.distributed group (--allreduce-backend gloo): the group's work
    fails when the peer's sockets close, MPI names the dead rank, and the survivors go on
    on a new group of 2 (the old one's works left behind do not hold them up)."""
    run = tmp_path / "run"
    job = Launched(
        tmp_path,
        3,
        "--model",
        MLP,
        "--topology",
        "allreduce",
        "--allreduce-backend",
        "gloo",
        "--epochs",
        "6",
        "--batch-size",
        "8",
        "--max-restarts",
        "1",
        "--peer-timeout",
        "5",
        "--runs-dir",
        str(tmp_path),
        "--run-name",
        "run",
        "--quiet",
    )
    job.wait_for(lambda: _epochs_logged(run) >= 3, "third epoch")
    job.rank(1).kill()
    assert job.finish() == 0, job.output
    out = job.output
    assert "rank 1 (worker 1, host" in out and "restarting on the 2 ranks left (restart 1 of 1)" in out, out
    assert "Traceback" not in out, out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == "completed 6 epochs" and summary["restarts"] == 1
    assert [h["epoch"] for h in summary["history"]] == list(range(1, 7))
    # The 2 survivors ended the run, each having reduced on gloo.
    assert [r["values"]["allreduce"] for r in read_log(run, "run")] == ["gloo", "gloo"]
    assert not job.processes()


@pytest.mark.timeout(400)
def test_sigterm_stops_a_10m_parameter_run_with_a_final_checkpoint_that_resumes(tmp_path):
    run = tmp_path / "run"
    job = Launched(
        tmp_path,
        3,
        "--model",
        BIG_MLP,
        "--algorithm",
        "easgd",
        "--epochs",
        "100",
        "--batch-size",
        "128",
        "--runs-dir",
        str(tmp_path),
        "--run-name",
        "run",
    )
    job.wait_for(lambda: _epochs_logged(run) >= 1, "first epoch")
    job.proc.send_signal(signal.SIGTERM)  # what SLURM and PBS send before the time limit
    assert job.finish() == 0, job.output
    latest = json.loads((run / "checkpoints" / "LATEST.json").read_text())["label"]
    assert latest.startswith("stopped-"), latest
    meta = json.loads((run / "checkpoints" / latest / "meta.json").read_text())
    assert meta["layout"]["n_ranks"] == 3
    sizes = sum(p.stat().st_size for p in (run / "checkpoints" / latest).glob("*.safetensors"))
    assert sizes > 3 * 10_000_000 * 4, sizes  # the centre and both workers' 10.2M weights
    summary = json.loads((run / "summary.json").read_text())
    stopped_at = summary["epochs_run"]
    assert summary["stop_reason"].startswith("stopped") and stopped_at < 100

    again = subprocess.run(
        [
            sys.executable,
            "-m",
            "nbdist",
            "launch",
            "-n",
            "3",
            "train",
            "--resume",
            str(run),
            "--epochs",
            str(stopped_at + 1),
        ],
        cwd=ROOT,
        env=mpi_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"resumed from {run}/checkpoints/{latest}" in again.stdout, again.stdout
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == f"completed {stopped_at + 1} epochs"
    assert [h["epoch"] for h in summary["history"]] == list(range(1, stopped_at + 2))


def test_a_killed_mpiexecs_session_directory_is_removed_before_the_next_mpiexec_starts(tmp_path):
    """prterun keeps its PMIx files in TMPDIR/ompi.<its PID>, and SIGKILL leaves them: a
    later mpiexec given the same PID (PIDs wrap at 32,768 here) failed to start ("The PMIx
    server's listener thread failed to start", 13 tests of one whole-suite run). mpi_env()
    removes the directory of an mpiexec that is gone, never that of one still running."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f"ompi.{gone.pid}"
    (stale / "1" / "0").mkdir(parents=True)
    (stale / "pmix.vm.tool").write_text("")
    running = subprocess.Popen(["bash", "-c", "exec -a prterun sleep 60"])
    alive = tmp_path / f"ompi.{running.pid}"
    alive.mkdir()
    unrelated = tmp_path / "ompi.not-a-pid"
    unrelated.mkdir()
    try:
        deadline = time.monotonic() + 10
        while not Path(f"/proc/{running.pid}/cmdline").read_bytes().startswith(b"prterun"):
            assert time.monotonic() < deadline, "the stand-in prterun did not start"
            time.sleep(0.01)
        mpi_env({"TMPDIR": str(tmp_path)})
        assert not stale.exists()
        assert alive.exists() and unrelated.exists()
    finally:
        running.kill()
        running.wait()
