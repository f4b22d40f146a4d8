"""Bad input under a real `mpiexec`: one clear error, no traceback, no hang.

Each case runs a training command line on several ranks and checks what the person at
the keyboard sees: a non-zero exit status, ONE `nbdist: error: ...` line that names the
problem (printed once, not once per rank), no Python traceback, and an end within the
timeout (a hang fails the test through run_mpi's timeout).

A few cases run `python -m nbdist train` as its own job (exit status of the job, as a
batch script sees it). The others, which all fail the same way, run one after the other
in ONE job through `nbdist.cli.main` (tests/mpi_scripts/train_many.py), and each test
reads its own run's part of the output and its exit status: starting Python, torch and
MPI costs seconds per rank, a failing run costs nothing. Cases that need sub-masters
(--masters 2) share a second job of four ranks. Commands that fail before any rank would
start call nbdist.cli.main in the test's own process.
"""

from __future__ import annotations

import json
import os
import re
import textwrap
from pathlib import Path

import pytest
from batched_runs import run_many
from conftest import Completed

pytestmark = pytest.mark.mpi

ROOT = Path(__file__).resolve().parent.parent
MLP = str(ROOT / "examples" / "digits_mlp.py")
TIMEOUT = 120


def train(mpirun, n: int, tmp_path: Path, *args: str, model: str = MLP):
    argv = [
        "-m",
        "nbdist",
        "train",
        "--model",
        model,
        "--epochs",
        "3",
        "--runs-dir",
        str(tmp_path / "runs"),
        "--quiet",
        *args,
    ]
    return mpirun(n, argv, timeout=TIMEOUT)


def assert_one_clear_error(done, *needles: str, pattern: str | None = None) -> str:
    """The run failed with exactly one `nbdist: error:` line holding every needle."""
    out = done.output
    assert done.returncode != 0, out
    assert out.count("nbdist: error") == 1, out
    assert "Traceback" not in out, out
    line = next(line for line in out.splitlines() if "nbdist: error" in line)
    assert out.count(line) == 1, out  # said once, not once per rank
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    if pattern is not None:
        assert re.search(pattern, line, re.IGNORECASE), f"{pattern!r} does not match {line!r}"
    return line


def model_file(tmp_path: Path, name: str, source: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


# ------------------------------------------------------------------ own-job cases
def test_wrong_rank_count_says_how_many_are_needed(mpirun, tmp_path):
    done = train(mpirun, 2, tmp_path, "--workers", "5")
    line = assert_one_clear_error(done, "needs 6 ranks")
    assert "2 were started" in line and "start 6 ranks (-n 6)" in line


NAN_AFTER_A_FEW_STEPS = """
    import math

    from torch import nn

    calls = 0

    def build_model():
        return nn.Sequential(nn.Linear(64, 10))

    def loss(output, target):
        # Finite for the set-up probe and 4 batches, NaN from then on.
        global calls
        calls += 1
        value = nn.functional.cross_entropy(output, target)
        return value * math.nan if calls > 5 else value
"""


@pytest.mark.parametrize("topology, n", [("master-worker", 2), ("allreduce", 2)])
def test_nan_loss_from_the_model_file(mpirun, tmp_path, topology, n):
    path = model_file(tmp_path, "nan_loss.py", NAN_AFTER_A_FEW_STEPS)
    done = train(mpirun, n, tmp_path, "--topology", topology, model=path)
    line = assert_one_clear_error(done, "lower the learning rate", pattern=r"loss became nan")
    assert "epoch 1, batch 5" in line
    # The master (or rank 0) names the failure; no result was written as if it had worked.
    runs = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    assert len(runs) == 1 and not (runs[0] / "summary.json").exists()
    # The run store says so too, in the same words.
    from nbdist.store import RunStore

    with RunStore(tmp_path / "runs" / "nbdist.db") as store:
        run = store.run(runs[0].name)
    assert (
        run.status == "failed" and "loss became nan" in run.reason.lower() and "lower the learning rate" in run.reason
    )


def test_resumes_that_fail_leave_the_run_resumable_and_each_says_why(mpirun, tmp_path):
    """A resume with another model is refused before the run directory is touched (its
    options kept the other model, and the --resume the error advised failed too); and a
    failure.json left by an earlier job does not silence this job's error (every rank took
    it for another's record, and the job ended with status 2 and no word)."""
    finite = model_file(tmp_path, "linear.py", NAN_AFTER_A_FEW_STEPS.replace("calls > 5", "calls < 0"))
    nan = model_file(tmp_path, "nan_loss.py", NAN_AFTER_A_FEW_STEPS)  # the same model, a loss that turns NaN
    run = tmp_path / "runs" / "base"
    first = train(mpirun, 2, tmp_path, "--topology", "allreduce", "--epochs", "1", "--run-name", "base", model=finite)
    assert first.returncode == 0, first.output
    other = train(mpirun, 2, tmp_path, "--resume", str(run), model=MLP)
    assert_one_clear_error(other, "holds 650 weights for rank 0", "resume with the same model")
    assert json.loads((run / "options.json").read_text())["model"] == finite
    for attempt in range(2):  # the second finds the first one's failure.json
        failed = train(mpirun, 2, tmp_path, "--resume", str(run), model=nan)
        assert_one_clear_error(failed, "lower the learning rate", pattern=r"loss became nan")
        assert json.loads((run / "failure.json").read_text())["message"].startswith("the loss became nan"), attempt
    resumed = train(mpirun, 2, tmp_path, "--resume", str(run), model=finite)
    assert resumed.returncode == 0, resumed.output
    assert not (run / "failure.json").exists()  # the run it records ended well
    assert "warning" not in resumed.output
    # --epochs is the run's total: the 3 it has trained leave nothing to train.
    again = train(mpirun, 2, tmp_path, "--resume", str(run), model=finite)
    assert (
        again.returncode == 0
        and (
            "nbdist: warning: --epochs 3 is the run's total, and epoch-0003 has trained 3: nothing is left to train "
            "(give --epochs above 3 to train on)"
        )
        in again.output.splitlines()
    ), again.output


RAISES_ON_RANK_1 = """
    import os

    from torch import nn

    class Raises(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer, self.calls = nn.Linear(64, 10), 0

        def forward(self, x):
            self.calls += 1
            if os.environ.get("OMPI_COMM_WORLD_RANK") == "1" and self.calls > 40:
                raise ValueError("a bug in the model's forward")
            return self.layer(x)

    def build_model():
        return Raises()
"""


def test_a_bug_in_the_model_on_one_rank_shows_its_traceback_then_the_line_with_what_to_do(mpirun, tmp_path):
    done = train(
        mpirun, 2, tmp_path, "--topology", "allreduce", model=model_file(tmp_path, "raises.py", RAISES_ON_RANK_1)
    )
    assert done.returncode != 0
    out = done.output
    assert out.count("Traceback") == 1 and "ValueError: a bug in the model's forward" in out, out
    [line] = [line for line in out.splitlines() if line.startswith("nbdist: error:")]
    assert re.match(
        r"nbdist: error: rank 1 \(worker 1, host \S+\) failed: ValueError: a bug in the model's forward; ", line
    )
    run = next(p for p in (tmp_path / "runs").iterdir() if p.is_dir())
    assert line.endswith(f"its last checkpoint is epoch-0001: continue with --resume {run}") or line.endswith(
        f"no checkpoint was committed when it failed: run it again, or continue with --resume {run} if one was "
        f"committed as the run stopped"
    ), line
    assert json.loads((run / "failure.json").read_text())["message"] == line.removeprefix("nbdist: error: ")


# --------------------------------------------------------------- cases in one job
MODEL_FILES = {
    "no_build.py": """
        from torch import nn
        layers = [nn.Linear(64, 10)]
    """,
    # textwrap.dedent keeps the leading newline: the bad `def` is on line 4.
    "broken.py": """
        from torch import nn

        def build_model(:
            return nn.Linear(64, 10)
    """,
    "raises.py": """
        def build_model():
            raise RuntimeError("no GPU on this login node")
    """,
    "wrong_size.py": """
        from torch import nn

        def build_model():
            return nn.Sequential(nn.Linear(50, 10))  # digits have 64 features
    """,
    "one_sample.py": """
        from torch import nn

        import nbdist.datasets
        from nbdist.data.arrays import ArrayData

        def build_model():
            return nn.Sequential(nn.Linear(64, 10))

        def load_data():
            d = nbdist.datasets.digits()
            return ArrayData(d.x_train[:1], d.y_train[:1], d.x_val, d.y_val)
    """,
    "no_val.py": """
        from torch import nn

        import nbdist.datasets
        from nbdist.data.arrays import ArrayData

        def build_model():
            return nn.Sequential(nn.Linear(64, 10))

        def load_data():
            d = nbdist.datasets.digits()
            return ArrayData(d.x_train, d.y_train, d.x_val[:0], d.y_val[:0])
    """,
}
# What the digits runs report, as every metric-name error lists it.
MASTER_WORKER_METRICS = "this run reports val_loss, val_acc, train_loss, train_acc, epoch, samples, seconds"

# name -> (argv, text the one error line must hold, regular expression or None)
CASES = {
    "unknown-algorithm": (["--algorithm", "easgdd"], ["unknown algorithm 'easgdd'", "did you mean 'easgd'?"], None),
    "unknown-optimizer": (
        ["--algorithm", "easgd", "--worker-optimizer", "adamm"],
        ["unknown PyTorch optimizer 'adamm'", "did you mean 'adam'?"],
        None,
    ),
    "unknown-algorithm-parameter": (
        ["--algorithm", "easgd(elastic_forse=0.5)"],
        ["'elastic_forse'", "it takes: elastic_force"],
        None,
    ),
    "easgd-with-allreduce": (
        ["--algorithm", "easgd", "--topology", "allreduce"],
        ["easgd is a master/worker algorithm", "--topology master-worker"],
        None,
    ),
    "model-missing": (["--model", "{tmp}/no_such_model.py"], ["no_such_model.py", "not found"], None),
    "model-without-build-model": (["--model", "{tmp}/no_build.py"], ["no_build.py", "defines no build_model()"], None),
    "model-syntax-error": (["--model", "{tmp}/broken.py"], ["broken.py", "syntax error on line 4"], None),
    "build-model-raises": (
        ["--model", "{tmp}/raises.py"],
        ["raises.py", "build_model() failed", "RuntimeError: no GPU on this login node"],
        None,
    ),
    "model-cannot-take-the-data": (
        ["--model", "{tmp}/wrong_size.py"],
        ["wrong_size.py", "cannot take the data", "(64,)"],
        None,
    ),
    "huge-lr-easgd": (
        ["--algorithm", "easgd", "--worker-optimizer", "sgd(lr=1e30)"],
        ["lower the learning rate"],
        r"loss became nan",
    ),
    "huge-lr-allreduce": (
        ["--topology", "allreduce", "--worker-optimizer", "sgd(lr=1e30)"],
        ["lower the learning rate"],
        r"loss became nan",
    ),
    # Optimisers are built on every rank during set-up, so that the role that steps one
    # (a worker, the master) does not fail alone while the others wait for it.
    "worker-optimizer-negative-lr": (
        ["--algorithm", "easgd", "--worker-optimizer", "sgd(lr=-1.0)"],
        ["optimizer sgd(lr=-1.0): a learning rate below 0 climbs the loss instead of descending it"],
        None,
    ),
    "master-optimizer-negative-lr": (
        ["--master-optimizer", "sgd(lr=-0.1)"],
        ["optimizer sgd(lr=-0.1): a learning rate below 0 climbs the loss instead of descending it: give lr above 0"],
        None,
    ),
    "master-optimizer-string-lr-synchronous": (
        ["--master-optimizer", "sgd(lr='fast')", "--synchronous"],
        ["optimizer sgd(lr='fast'): lr must be a number, got 'fast'"],
        None,
    ),
    "worker-optimizer-bad-betas-synchronous": (
        ["--algorithm", "easgd", "--worker-optimizer", "adam(betas=(1.5, 0.9))", "--synchronous"],
        ["optimizer adam(betas=(1.5, 0.9)): Invalid beta parameter at index 0: 1.5"],
        None,
    ),
    "allreduce-optimizer-negative-lr": (
        ["--topology", "allreduce", "--worker-optimizer", "sgd(lr=-1.0)"],
        ["optimizer sgd(lr=-1.0): a learning rate below 0 climbs the loss instead of descending it: give lr above 0"],
        None,
    ),
    "rule-argument-out-of-range": (
        ["--algorithm", "gem(momentum=1.5)"],
        ["gem: momentum must be in [0, 1), got 1.5"],
        None,
    ),
    "monitor-typo": (
        ["--monitor", "val_lsos", "--early-stopping", "2"],
        ["--monitor val_lsos: ", MASTER_WORKER_METRICS, "(did you mean 'val_loss'?)"],
        None,
    ),
    "target-typo": (
        ["--target", "val_acu > 0.5"],
        ["--target 'val_acu > 0.5': ", MASTER_WORKER_METRICS, "(did you mean 'val_acc'?)"],
        None,
    ),
    "allreduce-reports-no-staleness": (
        ["--topology", "allreduce", "--target", "staleness_mean < 2"],
        ["this run reports val_loss, val_acc, train_loss, train_acc, epoch, samples, seconds, samples_per_s"],
        None,
    ),
    "study-objective-typo": (
        ["study", "--space", "lr=log(1e-3,0.3)", "--trials", "4", "--objective", "val_acu", "--topology", "allreduce"],
        ["--objective val_acu: this run reports val_loss, val_acc, train_loss", "(did you mean 'val_acc'?)"],
        None,
    ),
    "validate-every-samples-below-a-batch": (
        ["--validate-every-samples", "0"],
        ["--validate-every-samples must be at least one batch (--batch-size 32), got 0"],
        None,
    ),
    "resume-missing-directory": (["--resume", "{tmp}/no_such_run"], ["no_such_run: no such directory"], None),
    "resume-not-a-run-directory": (["--resume", "{tmp}"], ["not a run directory (no options.json in it)"], None),
    "runs-dir-under-a-file": (
        ["--runs-dir", "{tmp}/a_file/runs"],
        ["--runs-dir {tmp}/a_file/runs: {tmp}/a_file is a file, not a directory"],
        None,
    ),
    "fewer-samples-than-workers": (
        ["--model", "{tmp}/one_sample.py", "--topology", "allreduce"],
        ["too few training samples for 2 workers: 1 with --batch-size 32", "use at most 1 worker"],
        None,
    ),
    "empty-validation-set": (["--model", "{tmp}/no_val.py"], ["the validation set is empty"], None),
    "unknown-lr-schedule": (
        ["--master-lr-schedule", "steplrr(step_size=2)"],
        [
            "--master-lr-schedule: unknown torch learning-rate schedule (torch.optim.lr_scheduler) "
            "'steplrr' (did you mean 'steplr'?); choose one of: constantlr, cosineannealinglr"
        ],
        None,
    ),
    "lr-schedule-bad-argument": (
        ["--algorithm", "easgd", "--worker-lr-schedule", "cosineannealinglr(tmax=3)"],
        [
            "--worker-lr-schedule: learning-rate schedule 'cosineannealinglr' takes no "
            "parameter 'tmax'; it takes: T_max, eta_min"
        ],
        None,
    ),
    "bad-lr-scaling": (["--lr-scaling", "cubic"], ["--lr-scaling 'cubic': choose one of none, linear, sqrt"], None),
    "gan-sync-batchnorm": (
        ["--gan", "--sync-batchnorm"],
        ["--sync-batchnorm does not apply to --gan: a GAN trains with one process per worker"],
        None,
    ),
    "pipeline-of-one-process": (
        ["--worker-parallel", "pipeline"],
        ["--worker-parallel pipeline needs --procs-per-worker 2 or more"],
        None,
    ),
    "pipeline-sync-batchnorm": (
        ["--worker-parallel", "pipeline", "--procs-per-worker", "2", "--sync-batchnorm"],
        ["--sync-batchnorm does not apply to --worker-parallel pipeline"],
        None,
    ),
    "micro-batches-without-pipeline": (
        ["--micro-batches", "8"],
        ["--micro-batches applies to pipeline workers: add --worker-parallel pipeline"],
        None,
    ),
    "allreduce-backend-typo": (
        ["--topology", "allreduce", "--allreduce-backend", "ncll"],
        ["--allreduce-backend 'ncll': choose one of auto, mpi, nccl, gloo"],
        None,
    ),
    "nccl-without-a-gpu": (
        ["--topology", "allreduce", "--allreduce-backend", "nccl"],
        [
            "--allreduce-backend nccl reduces gradients on GPUs; this model's are on cpu",
            "use --allreduce-backend mpi or gloo",
        ],
        None,
    ),
    "compression-on-gloo": (
        ["--topology", "allreduce", "--allreduce-backend", "gloo", "--compression", "fp16"],
        ["--compression runs on the MPI reducer", "use --allreduce-backend mpi or auto"],
        None,
    ),
    "allreduce-backend-with-master-worker": (
        ["--allreduce-backend", "gloo"],
        ["--allreduce-backend gloo applies to --topology allreduce"],
        None,
    ),
}

# name -> the same, for a job of 4 ranks: a top master, a sub-master, a worker under each.
SUB_MASTER_CASES = {
    "sub-masters-worker-optimizer": (
        ["--masters", "2", "--algorithm", "easgd", "--worker-optimizer", "sgd(lr=-1.0)"],
        ["optimizer sgd(lr=-1.0): a learning rate below 0 climbs the loss instead of descending it"],
        None,
    ),
    "sub-masters-master-optimizer": (
        ["--masters", "2", "--master-optimizer", "adam(betas=(1.5, 0.9))"],
        ["optimizer adam(betas=(1.5, 0.9)): Invalid beta parameter"],
        None,
    ),
}

PIPELINE = str(ROOT / "examples" / "digits_pipeline.py")
# The same job of 4 ranks: a master and one worker of 3 pipeline stages.
PIPELINE_CASES = {
    "pipeline-without-stages": (
        ["--worker-parallel", "pipeline", "--procs-per-worker", "3"],
        ["digits_mlp.py defines no build_stages()", "list of 3 modules"],
        None,
    ),
    "pipeline-stage-count": (
        ["--model", PIPELINE, "--worker-parallel", "pipeline", "--procs-per-worker", "3"],
        ["build_stages() must return a list of 3 modules", "--procs-per-worker 3", "got 2 stages"],
        None,
    ),
}


def _run_batch(tmp: Path, cases: dict, ranks: int) -> dict[str, Completed]:
    """Every run of `cases`, in order, in one `mpiexec -n ranks` job."""
    names = list(cases)
    argvs = []
    for name in names:
        argv = [a.replace("{tmp}", str(tmp)) for a in cases[name][0]]
        if "--model" not in argv:
            argv = [*argv, "--model", MLP]
        if "--runs-dir" not in argv:
            argv += ["--runs-dir", str(tmp / "runs")]
        argvs.append([*argv, "--epochs", "3", "--quiet"])
    parts = run_many(ranks, argvs, tmp / f"runs-{ranks}.json")
    return dict(zip(names, parts, strict=True))


@pytest.fixture(scope="module")
def batch_dir(tmp_path_factory):
    """The model files of every batched case (CASES and issue 25's below)."""
    tmp = tmp_path_factory.mktemp("bad")
    for name, source in {**MODEL_FILES, **I25_MODELS}.items():
        model_file(tmp, name, source)
    (tmp / "a_file").write_text("not a directory")
    os.mkfifo(tmp / "fifo.py")  # nothing ever writes to it: reading it would block for good
    (tmp / "a_dir.py").mkdir()
    return tmp


# Runs that train, in the same job, for the tests that need a finished run to start from.
TRAINED = {"torn": (["--algorithm", "easgd", "--run-name", "torn"], [])}


@pytest.fixture(scope="module")
def batched(batch_dir):
    """Every case of 2 ranks, issue 25's too, in one job: its runs in a run directory (and
    store) of their own, {tmp}/runs25, so that {tmp}/runs holds only CASES' study."""
    i25 = {
        name: (argv if "--runs-dir" in argv else [*argv, "--runs-dir", "{tmp}/runs25"], needles)
        for name, (argv, needles) in {**I25_ERRORS, **I25_WARNINGS, **STORE_CASES}.items()
    }
    assert not set(i25) & set(CASES) and not set(i25) & set(TRAINED)
    return _run_batch(batch_dir, {**CASES, **TRAINED, **i25}, 2)


@pytest.fixture(scope="module")
def batched_sub_masters(batch_dir):
    return _run_batch(batch_dir, {**SUB_MASTER_CASES, **PIPELINE_CASES}, 4)


def _needles(needles: list[str], tmp: Path) -> list[str]:
    return [n.replace("{tmp}", str(tmp)) for n in needles]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(batched, batch_dir, name):
    _, needles, pattern = CASES[name]
    assert_one_clear_error(batched[name], *_needles(needles, batch_dir), pattern=pattern)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(SUB_MASTER_CASES))
def test_bad_input_with_sub_masters(batched_sub_masters, batch_dir, name):
    _, needles, pattern = SUB_MASTER_CASES[name]
    assert_one_clear_error(batched_sub_masters[name], *_needles(needles, batch_dir), pattern=pattern)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(PIPELINE_CASES))
def test_bad_pipeline_stages(batched_sub_masters, batch_dir, name):
    _, needles, pattern = PIPELINE_CASES[name]
    assert_one_clear_error(batched_sub_masters[name], *_needles(needles, batch_dir), pattern=pattern)


def test_a_typo_in_a_studys_objective_ends_it_before_any_trial(batched, batch_dir):
    """One error and no trial lines: the study did not train its trials to mark them failed."""
    part = batched["study-objective-typo"]
    assert "nbdist: trial" not in part.output, part.output
    from nbdist.store import RunStore

    with RunStore(batch_dir / "runs" / "nbdist.db") as store:
        [study] = store.studies()
        assert study["status"] == "failed"
        # The trial that found the typo stays unfinished: the study resumed with the fix trains it.
        assert [t.state for t in store.trials(study["id"])] == ["running"]


# -- crashes and full disks (issue 25): what a resubmitted job finds ------------------------
@pytest.mark.timeout(300)
def test_a_log_torn_by_a_killed_rank_is_cut_when_the_run_resumes(mpirun, batched, batch_dir):
    """A rank killed in the middle of writing its metrics leaves a line without its
    newline: made here by cutting a real log (the worker's, of a run of the batch job)
    inside its last line. The resume cuts it off with a warning, and every line of every
    log is a whole record after it."""
    assert batched["torn"].returncode == 0, batched["torn"].output
    runs = batch_dir / "runs"
    run = runs / "torn"
    log = run / "metrics" / "rank-00001.jsonl"
    data = log.read_bytes()
    last = data.rstrip(b"\n").rfind(b"\n") + 1
    cut = last + (len(data) - last) // 2
    log.write_bytes(data[:cut])

    again = mpirun(2, ["-m", "nbdist", "train", "--resume", str(run), "--epochs", "5", "--quiet"], timeout=TIMEOUT)
    assert again.returncode == 0, again.output
    assert f"{log} ended in a torn record ({cut - last} bytes with no newline" in again.output, again.output
    assert "Traceback" not in again.output and "JSONDecodeError" not in again.output, again.output
    for path in sorted((run / "metrics").glob("rank-*.jsonl")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert json.loads(line)["kind"], f"{path} line {number}: {line!r}"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == "completed 5 epochs"
    from nbdist.store import RunStore

    with RunStore(runs / "nbdist.db") as store:
        assert store.run("torn").status == "completed"


WIDE_MLP = str(ROOT / "tests" / "models" / "wide_mlp.py")


def fill_but(disk: Path, leave: int) -> None:
    """Another job fills the file system at `disk`, all but `leave` bytes (the run writes
    meanwhile: the file is cut back once the disk is full)."""
    import shutil

    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as fh:
        try:
            fh.write(b"\0" * max(0, shutil.disk_usage(disk).free - leave))
        except OSError:
            pass  # full before it was all written
    free = shutil.disk_usage(disk).free
    if free < leave:
        os.truncate(filler, max(0, filler.stat().st_size - (leave - free)))


@pytest.mark.timeout(400)
def test_a_full_disk_is_one_line_naming_the_directory_the_sizes_and_the_checkpoint(tmp_path):
    """A file system of its own (a tmpfs mounted for the test) fills up while the run
    trains, as a shared scratch does when another job writes to it: the next checkpoint
    does not fit. One line says where, how big the checkpoint is, what is free and which
    checkpoint to resume from; every rank ends; the resume it names, once space was
    freed, goes on."""
    import subprocess
    import sys
    import time

    from nbdist.launch import mpi_env

    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", str(disk)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"a full disk needs a small file system of its own; mounting a tmpfs failed: {mounted.stderr}")
    run = disk / "full"
    argv = ["--model", WIDE_MLP, "--algorithm", "easgd", "--batch-size", "64", "--runs-dir", str(disk)]
    output = tmp_path / "output.txt"
    try:
        with open(output, "w") as out:
            job = subprocess.Popen(
                [sys.executable, "-m", "nbdist", "launch", "-n", "3", "train", *argv, "--epochs", "100000"]
                + ["--run-name", "full", "--quiet"],
                cwd=ROOT,
                env=mpi_env(),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
            try:
                deadline = time.monotonic() + 200
                latest = run / "checkpoints" / "LATEST.json"
                while not latest.exists():
                    assert job.poll() is None, output.read_text()
                    assert time.monotonic() < deadline, "no checkpoint within 200 s:\n" + output.read_text()
                    time.sleep(0.1)
                label = json.loads(latest.read_text())["label"]
                files = json.loads((run / "checkpoints" / label / "meta.json").read_text())["files"]
                fill_but(disk, sum(f["bytes"] for f in files.values()) // 4)
                code = job.wait(timeout=200)
            finally:
                if job.poll() is None:
                    job.kill()
        text = output.read_text()
        assert code == 1, text
        assert "Traceback" not in text and "Errno 28" not in text, text
        errors = [line for line in text.splitlines() if "nbdist: error" in line]
        assert len(errors) == 1, text
        line = errors[0]
        free = r"(\d+ B|\d+\.\d [kM]B) is free"  # under a kB ("812 B"), or nothing at all
        if "for checkpoint" in line:  # the checkpoint did not fit
            assert f"no space left on the device of {run / 'checkpoints'} for checkpoint epoch-" in line, line
            assert re.search(rf"about \d+\.\d MB, as the last one; {free}", line), line
        else:
            # The checkpoint took what was left, and a metric log (or the history) found the
            # disk full before the checkpoint's own error was told: which comes first is a race.
            where = rf"no space left on the device of {re.escape(str(run))}\S* \(writing \S+\.jsonl"
            assert re.search(rf"{where}: it needed more, {free}\)", line), line
        resume_from = re.search(r"the last intact checkpoint is (epoch-\d+): free some space there", line)
        assert resume_from and line.endswith(f"then continue with --resume {run}"), line
        assert (run / "checkpoints" / resume_from[1] / "meta.json").exists()

        (disk / "filler").unlink()
        epochs = int(resume_from[1].split("-")[1]) + 1
        again = subprocess.run(
            [sys.executable, "-m", "nbdist", "launch", "-n", "3", "train", "--resume", str(run)]
            + ["--epochs", str(epochs), "--quiet"],
            cwd=ROOT,
            env=mpi_env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert again.returncode == 0, again.stdout + again.stderr
        assert json.loads((run / "summary.json").read_text())["stop_reason"] == f"completed {epochs} epochs"
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True)


# ------------------------------------------------ issue 25: more bad input, one block
# Set-up errors on every rank (labels beyond the model's outputs, an lr of 0, a negative
# --max-restarts, a model path that is not a file), a study parameter nothing reads, and
# the two warnings of a run that trains on (a batch larger than the data, a loss that
# grows by orders of magnitude): in the job of 2 ranks that runs CASES too (`batched`).
# The checks made before any rank starts (launch, dashboard, slurm-script) run in the
# test's own process, through nbdist.cli.main, without mpiexec.
I25_MODELS = {
    "five_outputs.py": """
        from torch import nn

        def build_model():
            return nn.Sequential(nn.Linear(64, 5))  # digits have 10 classes, labels 0-9
    """,
    "label_42.py": """
        from torch import nn

        import nbdist.datasets

        def build_model():
            return nn.Sequential(nn.Linear(64, 10))

        def load_data():
            d = nbdist.datasets.digits()
            d.y_train[7] = 42  # one label of 10 classes
            return d
    """,
}
# name -> (argv, text the one error line must hold)
I25_ERRORS = {
    "labels-beyond-outputs": (
        ["--model", "{tmp}/five_outputs.py"],
        ["five_outputs.py: the labels run from 0 to 9, but the model scores 5 classes", "give 10 outputs"],
    ),
    "label-beyond-classes": (
        ["--model", "{tmp}/label_42.py", "--topology", "allreduce"],
        ["label_42.py: the labels of its data run from 0 to 42, outside the data's 10 classes", "fix the labels"],
    ),
    "zero-lr": (
        ["--algorithm", "easgd", "--worker-optimizer", "sgd(lr=0)"],
        ["optimizer sgd(lr=0): a learning rate of 0 never changes the weights: give lr above 0"],
    ),
    "negative-max-restarts": (["--max-restarts", "-1"], ["--max-restarts must be 0 or more, got -1"]),
    "model-is-a-fifo": (
        ["--model", "{tmp}/fifo.py"],
        ["model file '{tmp}/fifo.py' is a named pipe (FIFO), not a file: give the path of a Python file"],
    ),
    "model-is-a-directory": (
        ["--model", "{tmp}/a_dir.py"],
        ["model file '{tmp}/a_dir.py' is a directory, not a file: give the path of a Python file"],
    ),
    "study-parameter-nothing-reads": (
        ["study", "--space", "lr=log(1e-3,0.3) momentom=real(0,1)", "--trials", "2", "--topology", "allreduce"],
        [
            "--space: the parameter 'momentom' is read by no part of the run (did you mean 'momentum'?); "
            "those read are: lr.",
            "goes to build_model(params)",
        ],
    ),
}
# name -> (argv, text the one warning line must hold); these runs train to the end.
I25_WARNINGS = {
    "batch-larger-than-data": (
        ["--batch-size", "5000", "--topology", "allreduce"],
        [
            "--batch-size 5000 is larger than a worker's share of the training data (718 of 1437 samples over "
            "2 workers)",
            "give --batch-size 718 or less",
        ],
    ),
    # lr 100 with momentum: the loss of digits' MLP jumps from about 2.3 to 1e5 and more.
    "loss-grows": (
        ["--topology", "allreduce", "--worker-optimizer", "sgd(lr=100, momentum=0.9)"],
        ["the training loss grew to", "at epoch 1 (from", "before training", "lower the learning rate"],
    ),
}
# --store: refused on every rank before a run or a store is made (each with its own
# --runs-dir, which must stay empty); a password never shows.
STORE_CASES = {
    "store-in-a-missing-directory": (
        ["--store", "{tmp}/nonexistent/dir/nb.db", "--runs-dir", "{tmp}/runs-store-in-a-missing-directory"],
        ["--store {tmp}/nonexistent/dir/nb.db: the directory {tmp}/nonexistent/dir does not exist", "create it"],
    ),
    "store-typo-of-off": (
        ["--store", "of", "--runs-dir", "{tmp}/runs-store-typo-of-off"],
        ["--store 'of' is not a run store", "'off' (record nothing)", "(did you mean 'off'?)"],
    ),
    "store-with-a-password": (
        ["--store", "postgresql://me:hunter2@db.example/nbdist", "--runs-dir", "{tmp}/runs-store-with-a-password"],
        ["--store postgresql://me:***@db.example/nbdist holds a password", "PGPASSWORD, ~/.pgpass"],
    ),
}


@pytest.fixture(scope="module")
def i25_dir(batch_dir):
    return batch_dir  # I25_MODELS, the FIFO and the directory are written there


@pytest.fixture(scope="module")
def i25_batched(batched):
    return batched  # the job of 2 ranks runs these cases too


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(I25_ERRORS))
def test_bad_input_found_at_set_up(i25_batched, i25_dir, name):
    part = i25_batched[name]
    assert_one_clear_error(part, *_needles(I25_ERRORS[name][1], i25_dir))
    assert part.returncode == 2, part.output
    assert "nbdist: epoch" not in part.output and "completed" not in part.output  # before any training


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(I25_WARNINGS))
def test_a_warning_once_and_the_run_trains_on(i25_batched, name):
    part = i25_batched[name]
    assert part.returncode == 0, part.output
    assert "nbdist: error" not in part.output and "Traceback" not in part.output, part.output
    warnings = [line for line in part.output.splitlines() if line.startswith("nbdist: warning:")]
    assert len(warnings) == 1, part.output  # once per run, not per rank or per epoch
    for needle in I25_WARNINGS[name][1]:
        assert needle in warnings[0], f"{needle!r} not in {warnings[0]!r}"
    assert "completed 3 epochs" in part.stdout, part.output


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(STORE_CASES))
def test_a_bad_store_is_one_line_and_no_new_store(i25_batched, i25_dir, name):
    part = i25_batched[name]
    line = assert_one_clear_error(part, *_needles(STORE_CASES[name][1], i25_dir))
    assert part.returncode == 2 and "hunter2" not in part.output, line
    assert not (i25_dir / "nonexistent").exists() and not (ROOT / "of").exists()
    runs = i25_dir / f"runs-{name}"
    assert not runs.exists() or not any(runs.iterdir()), list(runs.iterdir())  # no run, no store


# name -> (argv of `python -m nbdist`, text the one error line must hold). Each fails
# before any rank would start: no mpiexec is needed to see it.
I25_COMMANDS = {
    "launch-negative-stop-grace": (
        ["launch", "-n", "2", "--stop-grace", "-1", "train", "--model", MLP],
        ["--stop-grace must be a number of seconds above 0", "got -1"],
    ),
    "launch-interface-typo": (
        ["launch", "-n", "2", "--interface", "nosuch0", "train", "--model", MLP],
        ["--interface 'nosuch0': this node has no such network interface; choose one of: ", "lo"],
    ),
    "dashboard-port-out-of-range": (
        ["dashboard", "--port", "99999", "--store", "{tmp}/dashboard.db", "--create"],
        ["--port 99999: a port is a number from 1 to 65535, or 0 for any free port"],
    ),
    "slurm-script-negative-worker-lr": (
        ["slurm-script", "-n", "3", "--", "train", "--model", MLP, "--algorithm", "easgd"]
        + ["--worker-optimizer", "sgd(lr=-1.0)"],
        ["the job would fail before training", "optimizer sgd(lr=-1.0): a learning rate below 0 climbs the loss"],
    ),
    "slurm-script-target-typo": (
        ["slurm-script", "-n", "3", "--", "train", "--model", MLP, "--target", "val_acu > 0.5"],
        ["the job would fail before training", "--target 'val_acu > 0.5': ", "(did you mean 'val_acc'?)"],
    ),
    "slurm-script-model-missing": (
        ["slurm-script", "-n", "3", "--", "train", "--model", "{tmp}/no_such_model.py"],
        ["the job would fail before training", "model file '{tmp}/no_such_model.py' not found"],
    ),
    "slurm-script-ranks-cannot-hold-workers": (
        ["slurm-script", "-n", "4", "--", "train", "--model", MLP, "--workers", "5"],
        ["the job would fail before training", "this layout needs 6 ranks", "use --workers 3 to fit 4 ranks"],
    ),
    "slurm-script-malformed-space": (
        ["slurm-script", "-n", "3", "--", "study", "--model", MLP, "--space", "lr=log(1e-3"],
        ["the job would fail before training", "'lr=log(1e-3': missing ')'"],
    ),
    "slurm-script-study-parameter-nothing-reads": (
        ["slurm-script", "-n", "3", "--", "study", "--model", MLP, "--space", "lr=log(1e-3,0.3) momentom=real(0,1)"],
        ["the job would fail before training", "the parameter 'momentom' is read by no part of the run"],
    ),
    # A scaling study's job checks what `launch ... scale` checks before it calibrates.
    "slurm-script-scale-model-missing": (
        ["slurm-script", "-n", "4", "--", "scale", "--model", "{tmp}/no_such_model.py", "--quick"],
        ["the job would fail before training", "model file '{tmp}/no_such_model.py' not found"],
    ),
    "slurm-script-scale-unknown-setup": (
        ["slurm-script", "-n", "4", "--", "scale", "--model", MLP, "--setups", "allreduce foo"],
        ["the job would fail before training", "unknown set-up 'foo'; choose one of: adag, allreduce"],
    ),
    "slurm-script-scale-more-ranks-than-the-job": (
        ["slurm-script", "-n", "4", "--", "scale", "--model", MLP, "--ranks", "1-8"],
        ["the job would fail before training", "--ranks 1-8: 5, 6, 7, 8 are more than the 4 MPI ranks of this job"],
    ),
    "slurm-script-write-into-a-missing-directory": (
        ["slurm-script", "-n", "3", "--write", "{tmp}/no_such_dir/job.sh", "--", "train", "--model", MLP],
        ["--write {tmp}/no_such_dir/job.sh: the directory {tmp}/no_such_dir does not exist"],
    ),
}


def _in_this_process(argv: list[str]) -> Completed:
    """`python -m nbdist ARGV` through its entry point (nbdist.cli.main), called in this
    process from the repository (a fresh Python would spend seconds on importing torch for
    the model checks): its exit status and what it printed."""
    import contextlib
    import io

    from nbdist.cli import main

    out, err = io.StringIO(), io.StringIO()
    saved_cwd = os.getcwd()
    try:
        os.chdir(ROOT)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
    finally:
        os.chdir(saved_cwd)
    return Completed(code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def i25_commands(tmp_path_factory):
    """Every command of I25_COMMANDS, then a slurm-script that is fine, in this process."""
    tmp = tmp_path_factory.mktemp("bad25cmd")
    argvs = [[a.replace("{tmp}", str(tmp)) for a in argv] for argv, _ in I25_COMMANDS.values()]
    argvs.append(["slurm-script", "-n", "3", "--write", str(tmp / "job.sh"), "--", "train", "--model", MLP])
    argvs.append(
        ["slurm-script", "-n", "4", "--write", str(tmp / "scale.sh"), "--", "scale", "--model", MLP, "--quick"]
    )
    return tmp, [_in_this_process(argv) for argv in argvs]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(I25_COMMANDS))
def test_bad_input_before_any_rank_starts(i25_commands, name):
    tmp, parts = i25_commands
    part = parts[list(I25_COMMANDS).index(name)]
    assert_one_clear_error(part, *_needles(I25_COMMANDS[name][1], tmp))
    assert part.returncode == 2, part.output
    assert not (tmp / "dashboard.db").exists()  # refused before the store was made


def test_slurm_script_writes_a_script_that_passes_the_checks(i25_commands):
    tmp, parts = i25_commands
    for part, script in zip(parts[-2:], ["job.sh", "scale.sh"], strict=True):
        assert part.returncode == 0 and "nbdist: error" not in part.output, part.output
        assert (tmp / script).read_text().startswith("#!/bin/bash\n")
