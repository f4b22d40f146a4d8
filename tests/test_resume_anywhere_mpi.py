"""Resume anywhere, on real MPI ranks: a checkpoint resumes on more or fewer ranks
(master/worker, sub-masters, allreduce, pipelines), a restart after lost ranks takes a
layout that fits the survivors and the run then resumes on its original size, every
asynchronous run's last checkpoint is its last epoch, and a resume that cannot use the
newest checkpoint says why and takes the one before.

Starting 6 ranks of Python, torch and MPI costs far more than a digits run, so the runs
and their resumes on other sizes go through ONE job each (tests/mpi_scripts/resize_runs.py
runs each on the first N ranks of the job). Lost ranks are lost for real: SIGKILL to a
process of a `python -m nbdist launch` job (as tests/test_faults_mpi.py does).
"""

from __future__ import annotations

import json
import re
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import BatchedRuns
from test_faults_mpi import Launched, _epochs_logged

from nbdist.launch import mpi_env, mpiexec_command
from nbdist.metrics import read_log

pytestmark = pytest.mark.mpi

ROOT = Path(__file__).resolve().parent.parent
RESIZE_RUNS = str(ROOT / "tests" / "mpi_scripts" / "resize_runs.py")
MLP = str(ROOT / "examples" / "digits_mlp.py")
PIPELINE = str(ROOT / "examples" / "digits_pipeline.py")
JOB_RANKS = 6
# Runs of each asynchronous kind that must end at their last epoch; bench/faults.py
# --only last-epochs does 20 of each (issue 25): too long for the test suite.
REPEATS = 3
PIPE = ["--worker-parallel", "pipeline", "--procs-per-worker", "2"]

# name -> the first run [ranks, argv], then its resumes [ranks, epochs]: 3 epochs, then 2
# more on each size.
CHAINS = {
    "workers": ([3, ["--model", MLP]], [5, 2]),
    "sub-masters": ([6, ["--model", MLP, "--masters", "2", "--trace-updates"]], [5, 4, 6]),
    "allreduce": ([2, ["--model", MLP, "--topology", "allreduce"]], [4, 3]),
    "pipeline": ([5, ["--model", PIPELINE, *PIPE, "--algorithm", "easgd"]], [3, 5]),
    "pipeline-replicas": ([4, ["--model", PIPELINE, *PIPE, "--topology", "allreduce"]], [6, 2]),
}
FIRST_EPOCHS, MORE_EPOCHS = 3, 2

# A model of another size: its resume fails at loading the weights, on every rank.
WIDER_MLP = """
    from torch import nn

    import nbdist.datasets

    def build_model():
        return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 10))

    loss = nn.CrossEntropyLoss()

    def load_data():
        return nbdist.datasets.digits()
"""


class Resized(BatchedRuns):
    """BatchedRuns, and what each run printed: `parts[i]` (run i's part of the output)."""

    parts: list[str]
    names: list[str]  # of run i
    spoilt: Path


def _parts(output: str, count: int) -> list[str]:
    """One stream cut at the runs' markers: run i's part runs from the marker of run i - 1
    to the marker of run i."""
    starts = [0] + [output.find(f"nbdist-test: run {i} rc=") for i in range(count - 1)]
    ends = [output.rfind(f"nbdist-test: run {i} rc=") for i in range(count)]
    return [output[a:b] if b >= 0 else output[a:] for a, b in zip(starts, ends, strict=True)]


def _run_job(runs: list, runs_dir: Path, timeout: float) -> Resized:
    """One job of JOB_RANKS ranks; runs[i] = (name, ranks, argv)."""
    spec = runs_dir / "runs.json"
    spec.write_text(json.dumps([[ranks, [*argv, "--runs-dir", str(runs_dir)]] for _, ranks, argv in runs]))
    try:
        done = subprocess.run(
            mpiexec_command(JOB_RANKS, [RESIZE_RUNS, str(spec)]),
            cwd=ROOT,
            env=mpi_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the job of {len(runs)} runs hung for {timeout} s:\n{exc.stdout}\n{exc.stderr}")
    found = re.findall(r"nbdist-test: run (\d+) rc=(-?\d+)", done.stdout)
    codes: dict = {}
    for i, rc in found:
        codes.setdefault(runs[int(i)][0], []).append(int(rc))
    job = Resized(done.stdout + done.stderr, done.returncode, runs_dir, {n: max(c) for n, c in codes.items()})
    # Cut rank 0's stdout alone (the notes and "resumed from" lines are on it): mpiexec
    # forwards each stream of each rank in order, but not the two streams in step, so a
    # marker's copy on stderr can come several runs late in a merged stream.
    job.parts = _parts(done.stdout, len(runs))
    job.names = [name for name, _, _ in runs]
    return job


@pytest.fixture(scope="module")
def resized(tmp_path_factory):
    runs_dir = tmp_path_factory.mktemp("resized")
    runs = []
    for name, ((ranks, argv), sizes) in CHAINS.items():
        runs.append((name, ranks, [*argv, "--epochs", str(FIRST_EPOCHS), "--run-name", name, "--quiet"]))
        for k, size in enumerate(sizes):
            epochs = FIRST_EPOCHS + MORE_EPOCHS * (k + 1)
            runs.append((name, size, ["--resume", str(runs_dir / name), "--epochs", str(epochs), "--no-quiet"]))
    # For the tests of a resume that cannot use the newest checkpoint (they spoil it first).
    # Synchronous: a checkpoint at every epoch's end.
    for name in ("spoilt", "spoilt-all"):
        argv = ["--model", MLP, "--masters", "2", "--synchronous", "--epochs", "2", "--run-name", name, "--quiet"]
        runs.append((name, 6, argv))
    return _run_job(runs, runs_dir, timeout=600)


def _history(job: BatchedRuns, name: str) -> list[dict]:
    return job.summary(name)["history"]


# ---------------------------------------------------------------- more and fewer ranks
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(CHAINS))
def test_a_run_resumes_on_more_and_fewer_ranks_and_learns_on(resized, name):
    (first_ranks, _), sizes = CHAINS[name]
    history = _history(resized, name)
    total = FIRST_EPOCHS + MORE_EPOCHS * len(sizes)
    assert [h["epoch"] for h in history] == list(range(1, total + 1)), history
    # Every resume goes on from the checkpoint's weights: its first epoch is far from the
    # first epoch of the run (from scratch), and not worse than the epoch before it.
    for k in range(len(sizes)):
        before, after = history[FIRST_EPOCHS + MORE_EPOCHS * k - 1], history[FIRST_EPOCHS + MORE_EPOCHS * k]
        assert after["train_loss"] < 0.6 * history[0]["train_loss"], (k, history)
        assert after["val_loss"] < 1.25 * before["val_loss"], (k, history)
    assert history[-1]["val_acc"] >= 0.85, history[-1]
    # The run's last checkpoint was written by the last size, at its last epoch.
    run = resized.run(name)
    latest = json.loads((run / "checkpoints" / "LATEST.json").read_text())["label"]
    assert latest == f"epoch-{total:04d}"
    meta = json.loads((run / "checkpoints" / latest / "meta.json").read_text())
    assert meta["layout"]["n_ranks"] == sizes[-1]
    # Each resume on another size said in one line what changed, and where it starts.
    resumes = [part for n, part in zip(resized.names, resized.parts, strict=True) if n == name][1:]
    for k, (size, part) in enumerate(zip(sizes, resumes, strict=True)):
        notes = [line for line in part.splitlines() if line.startswith("nbdist: note: resuming a checkpoint of ")]
        assert len(notes) == 1, (name, size, part)
        assert f" on {size} ranks (" in notes[0], notes
        assert notes[0].endswith(f"every worker starts epoch {FIRST_EPOCHS + MORE_EPOCHS * k + 1} from its first batch")
        assert f"resumed from {run}/checkpoints/epoch-{FIRST_EPOCHS + MORE_EPOCHS * k:04d} at epoch " in part, part


def test_new_workers_start_from_the_centre_and_dropped_ones_are_named(resized):
    out = resized.output
    assert (
        "nbdist: note: resuming a checkpoint of 3 ranks (1 master + 2 workers) on 5 ranks (1 master + 4 workers): "
        "the workers on ranks 3-4 start from their master's centre; every worker starts epoch 4 from its first batch"
    ) in out, out[-6000:]
    assert (
        "nbdist: note: resuming a checkpoint of 5 ranks (1 master + 4 workers) on 2 ranks (1 master + 1 worker): "
        "the checkpoint's workers on ranks 2-4 are not resumed (their own state is dropped); every worker starts "
        "epoch 6 from its first batch"
    ) in out, out[-6000:]
    # 2 masters do not fit 5 ranks: the resume takes 1 master + 4 workers, then 2 masters again.
    assert "(2 masters x (1 + 2 workers)) on 5 ranks (1 master + 4 workers): the updates of sub-master 1" in out
    assert (
        "on 6 ranks (2 masters x (1 + 2 workers)): the workers on ranks 4-5 start from their master's centre; " in out
    )
    assert "sub-master 1 starts from the top master's centre" in out
    assert "on 4 ranks (4 workers): ranks 2-3 start from replica 0's weights and optimiser state" in out


def test_the_sub_master_of_a_resume_on_more_ranks_serves_its_workers(resized):
    run = resized.run("sub-masters")
    ends = [r["values"] for r in read_log(run, "run") if r["rank"] == 3]  # a sub-master on 6 ranks, a worker on 5
    assert ends and ends[-1]["status"] == "completed", ends
    updates = list(read_log(run, "update"))
    # Rank 3 served workers 4 and 5 as a sub-master on 6 ranks (on 5 and 4 ranks it is a
    # worker); rank 2 served rank 3 as the sub-master of 2 masters x (1 + 1 worker).
    assert {r["values"]["source_rank"] for r in updates if r["rank"] == 3} == {4, 5}
    assert 3 in {r["values"]["source_rank"] for r in updates if r["rank"] == 2}


# ------------------------------------------------ asynchronous runs end at their last epoch
@pytest.fixture(scope="module")
def last_epochs(resized, restarted, tmp_path_factory):
    """REPEATS asynchronous EASGD runs on 5 ranks and REPEATS --masters 2 runs on 6, each
    resumed for one more epoch; the resumes of the runs whose checkpoints the tests spoil;
    and those of the runs restarted on fewer ranks, on their original sizes."""
    runs_dir = tmp_path_factory.mktemp("last-epochs")
    runs = []
    for kind, ranks, argv in (
        ("easgd", 5, ["--algorithm", "easgd"]),
        ("masters", 6, ["--masters", "2"]),
    ):
        for i in range(REPEATS):
            name = f"{kind}-{i}"
            runs.append((name, ranks, ["--model", MLP, *argv, "--epochs", "2", "--run-name", name, "--quiet"]))
            runs.append((name, ranks, ["--resume", str(runs_dir / name), "--epochs", "3", "--no-quiet"]))
    spoilt, spoilt_all = resized.run("spoilt"), resized.run("spoilt-all")
    _without_sub_master(spoilt / "checkpoints" / "epoch-0002")
    for label in ("epoch-0001", "epoch-0002"):
        _without_sub_master(spoilt_all / "checkpoints" / label)
    wider = runs_dir / "wider_mlp.py"
    wider.write_text(textwrap.dedent(WIDER_MLP))
    runs.append(("spoilt", 6, ["--resume", str(spoilt), "--epochs", "3", "--no-quiet"]))
    runs.append(("spoilt-all", 6, ["--resume", str(spoilt_all), "--epochs", "3"]))
    runs.append(("wider", 6, ["--resume", str(spoilt), "--model", str(wider), "--epochs", "4"]))
    for name, (ranks, _, _, epochs) in RESTARTS.items():
        if isinstance(restarted[name], Restarted):  # else its test fails with what went wrong
            resume = ["--resume", str(restarted[name].run), "--epochs", str(epochs), "--no-quiet"]
            runs.append((f"restart-{name}", ranks, resume))
    job = _run_job(runs, runs_dir, timeout=600)
    job.spoilt = spoilt  # a run directory of the first job
    return job


def _without_sub_master(checkpoint: Path) -> None:
    """What an asynchronous --masters 2 run used to end with: a committed checkpoint with
    no share of the sub-master (rank 3), not even in its list of files."""
    meta = json.loads((checkpoint / "meta.json").read_text())
    for ext in ("json", "safetensors"):
        (checkpoint / f"rank-00003.{ext}").unlink()
        meta["files"].pop(f"rank-00003.{ext}")
    (checkpoint / "meta.json").write_text(json.dumps(meta))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("kind", ["easgd", "masters"])
def test_every_asynchronous_run_resumes_exactly_at_its_last_epoch(last_epochs, kind):
    for i in range(REPEATS):
        run = last_epochs.run(f"{kind}-{i}")
        assert f"resumed from {run}/checkpoints/epoch-0002 at epoch 3," in last_epochs.output, (kind, i)
        # 2 epochs, then 1 more: no epoch trained twice.
        assert [r["epoch"] for r in read_log(run, "epoch")] == [1, 2, 3], (kind, i)
        assert [h["epoch"] for h in last_epochs.summary(f"{kind}-{i}")["history"]] == [1, 2, 3]
        latest = json.loads((run / "checkpoints" / "LATEST.json").read_text())["label"]
        assert latest == "epoch-0003", (kind, i)
        if kind == "masters":  # the sub-master's share is in every checkpoint
            for checkpoint in (run / "checkpoints").glob("epoch-*"):
                assert (checkpoint / "rank-00003.safetensors").exists(), checkpoint


# -------------------------------------------------------------- a resume that cannot
def test_a_checkpoint_without_a_sub_masters_state_is_passed_over_with_one_line(last_epochs):
    assert last_epochs.codes["spoilt"] == 0, last_epochs.output[-6000:]
    run = last_epochs.spoilt
    out = last_epochs.output
    warning = (
        f"nbdist: warning: checkpoint {run}/checkpoints/epoch-0002 cannot be resumed: it holds no state for "
        f"sub-master 1 (rank 3); resuming from epoch-0001"
    )
    assert out.count(warning) == 1, out[-6000:]
    assert f"resumed from {run}/checkpoints/epoch-0001 at epoch 2," in out
    assert [h["epoch"] for h in json.loads((run / "summary.json").read_text())["history"]] == [1, 2, 3]


def test_a_resume_with_nothing_to_resume_from_says_why_in_one_line(last_epochs):
    assert last_epochs.codes["spoilt-all"] == 2, last_epochs.output[-6000:]
    errors = [line for line in last_epochs.output.splitlines() if line.startswith("nbdist: error: --resume ")]
    assert len(errors) == 1, errors
    assert "spoilt-all: no intact checkpoint is left (checkpoint " in errors[0], errors
    assert "cannot be resumed: it holds no state for sub-master 1 (rank 3)" in errors[0], errors


def test_a_resume_whose_weights_do_not_fit_the_model_says_why_in_one_line(last_epochs):
    assert last_epochs.codes["wider"] == 2, last_epochs.output[-6000:]
    errors = [line for line in last_epochs.output.splitlines() if "resume with the same model" in line]
    assert len(errors) == 1, last_epochs.output[-6000:]
    assert errors[0].startswith("nbdist: error: checkpoint "), errors
    assert "Traceback" not in last_epochs.output


# ------------------------------------------------------------ restarts on fewer ranks
# name -> (ranks, the rank killed, the run's argv, the epochs of its resume on `ranks`).
# Each loses its rank for real, in a `launch` job of its own; their resumes on their
# original sizes go through the last_epochs job (one start of 6 ranks, not one per resume).
RESTARTS = {
    "sub-master": (
        6,
        3,
        ["--model", MLP, "--masters", "2", "--algorithm", "gem", "--epochs", "12", "--batch-size", "16"],
        15,
    ),
    "allreduce": (4, 2, ["--model", MLP, "--topology", "allreduce", "--epochs", "10", "--batch-size", "8"], 13),
    "pipeline-replicas": (
        4,
        3,
        ["--model", PIPELINE, *PIPE, "--topology", "allreduce", "--epochs", "6", "--batch-size", "16"],
        8,
    ),
}


@dataclass
class Restarted:
    """A run whose rank was killed: where it is, its job, and what its summary said once
    the restart completed it (its resume later rewrites summary.json)."""

    run: Path
    job: Launched
    returncode: int
    summary: dict
    ranks: str  # every rank's fate, the lines and records about them (RankWatch.report)

    def output(self, left: int) -> str:
        """The job's output, once it is known to have completed with one restart on `left`
        of the ranks; else the failure says what became of every rank."""
        out = self.job.output
        said = re.findall(r"restarting on (?:\d+ of )?the (\d+) ranks left", out)
        assert self.returncode == 0 and said == [str(left)], f"status {self.returncode}\n{out}\n{self.ranks}"
        assert "Traceback" not in out and "cannot be laid out" not in out, out
        return out


def _restarted(tmp_path: Path, ranks: int, kill: int, *args: str) -> Restarted:
    """A `launch -n ranks` run with --max-restarts 1 whose rank `kill` is killed once it has
    logged 3 epochs and committed a checkpoint; the run must then complete."""
    run = tmp_path / "run"
    job = Launched(
        tmp_path,
        ranks,
        *args,
        *("--max-restarts", "1", "--peer-timeout", "5", "--runs-dir", str(tmp_path), "--run-name", "run"),
    )
    job.wait_for(lambda: _epochs_logged(run) >= 3 and (run / "checkpoints" / "LATEST.json").exists(), "a checkpoint")
    watch = job.watch_ranks(ranks)
    job.rank(kill).kill()
    watch.mark(kill, "killed with SIGKILL by the test")
    returncode = job.finish()
    summary = run / "summary.json"
    return Restarted(
        run, job, returncode, json.loads(summary.read_text()) if summary.exists() else {}, watch.report(job.output, run)
    )


@pytest.fixture(scope="module")
def restarted(tmp_path_factory) -> dict[str, Restarted | BaseException]:
    """Each restart of RESTARTS, or what went wrong with it: raised by its own test, not
    by the last_epochs tests that share the job of the resumes."""
    done: dict[str, Restarted | BaseException] = {}
    for name, (ranks, kill, argv, _) in RESTARTS.items():
        try:
            done[name] = _restarted(tmp_path_factory.mktemp(name), ranks, kill, *argv)
        except (AssertionError, pytest.fail.Exception) as exc:
            done[name] = exc
    return done


def _restart(restarted: dict, name: str) -> Restarted:
    done = restarted[name]
    if isinstance(done, BaseException):
        raise done
    return done


def _resumed(last_epochs: Resized, name: str) -> str:
    """What the resume of restart `name` on its original size printed (rank 0's stdout)."""
    label = f"restart-{name}"
    last_epochs.run(label)  # it ended well
    return last_epochs.parts[last_epochs.names.index(label)]


def _restart_layouts(run: Path) -> list[str]:
    return [r["values"]["layout"] for r in read_log(run, "restart") if r["rank"] == 0]


def _epochs_went_on(run: Path, epochs: int, resumed_at: int) -> list[dict]:
    """The history of `run` after its resume at epoch `resumed_at` (counted from 1): every
    epoch once, and the resumed one far from the fresh start."""
    history = json.loads((run / "summary.json").read_text())["history"]
    assert [h["epoch"] for h in history] == list(range(1, epochs + 1))
    assert history[resumed_at - 1]["train_loss"] < 0.3 * history[0]["train_loss"], history
    return history


@pytest.mark.timeout(600)
def test_a_sub_masters_death_restarts_on_a_layout_that_fits_then_resumes_on_six(restarted, last_epochs):
    done = _restart(restarted, "sub-master")
    run, out = done.run, done.output(5)
    assert "rank 3 (" in out and "restarting on the 5 ranks left (restart 1 of 1)" in out, out
    assert "nbdist: note: restarting from a checkpoint of 6 ranks (2 masters x (1 + 2 workers)) on 5 ranks " in out
    assert _restart_layouts(run) == ["5 ranks: 1 master + 4 workers"]
    assert done.summary["stop_reason"] == "completed 12 epochs" and done.summary["restarts"] == 1

    again = _resumed(last_epochs, "sub-master")  # the job resubmitted at its original size
    assert (
        "nbdist: note: resuming a checkpoint of 5 ranks (1 master + 4 workers) on 6 ranks "
        "(2 masters x (1 + 2 workers)): sub-master 1 starts from the top master's centre" in again
    ), again
    assert f"resumed from {run}/checkpoints/epoch-0012 at epoch 13," in again, again
    assert _epochs_went_on(run, 15, 13)[-1]["val_acc"] > 0.9
    assert not done.job.processes()


@pytest.mark.timeout(600)
def test_an_allreduce_rank_killed_restarts_on_the_survivors_then_resumes_on_its_original_size(restarted, last_epochs):
    """Was also test_faults_mpi's test of the same 4-rank kill (30 epochs, no resume): its
    assertions are here."""
    done = _restart(restarted, "allreduce")
    run, out = done.run, done.output(3)
    assert "rank 2 (worker 2, host" in out and "restarting on the 3 ranks left (restart 1 of 1)" in out, out
    assert "NBC_Progress" not in out, out
    assert _restart_layouts(run) == ["3 ranks: 3 workers"]
    restarts = [r["values"] for r in read_log(run, "restart") if r["rank"] == 0]
    assert len(restarts) == 1 and restarts[0]["ranks"] == 3, restarts
    assert int(restarts[0]["checkpoint"].split("-")[1]) >= 2, restarts
    summary = done.summary
    assert summary["stop_reason"] == "completed 10 epochs" and summary["restarts"] == 1
    # One run, its history whole: the epochs after the checkpoint were trained again.
    assert [h["epoch"] for h in summary["history"]] == list(range(1, 11))
    assert summary["final"]["val_acc"] > 0.9
    assert not done.job.processes()

    again = _resumed(last_epochs, "allreduce")
    assert "resuming a checkpoint of 3 ranks (3 workers) on 4 ranks (4 workers): rank 3 starts from replica 0's" in (
        again
    ), again
    assert _epochs_went_on(run, 13, 11)[-1]["val_acc"] > 0.9


@pytest.mark.timeout(600)
def test_pipeline_replicas_restart_on_the_ranks_whole_replicas_fit_then_resume_on_four(restarted, last_epochs):
    """2 replicas x 2 stages lose a stage: the 3 ranks left hold one whole replica, which
    goes on (the third rank leaves the job); the run then resumes on 4 ranks."""
    done = _restart(restarted, "pipeline-replicas")
    run, out = done.run, done.output(3)
    assert "restarting on 2 of the 3 ranks left (restart 1 of 1); with 2 processes per worker the layout fits" in out
    assert "on 2 ranks (1 worker of 2 processes): every worker starts epoch " in out, out
    assert _restart_layouts(run) == ["2 ranks: 1 worker of 2 processes"]
    assert done.summary["stop_reason"] == "completed 6 epochs"
    again = _resumed(last_epochs, "pipeline-replicas")
    assert "resuming a checkpoint of 2 ranks (1 worker of 2 processes) on 4 ranks (2 workers of 2 processes): " in (
        again
    )
    _epochs_went_on(run, 8, 7)
    assert not done.job.processes()
