"""DiLoCo, asynchronous local SGD and EAMSGD on real MPI ranks (issue 29), in ONE mpiexec
job of 3 ranks (a master and two workers) through tests/mpi_scripts/train_many.py: each
rule learns the digits; a synchronous DiLoCo round with H = 1, outer lr 1 and no
momentum is synchronous averaging (the same weights as synchronous Downpour with the
workers' sgd as its master optimiser); a run stopped after 2 epochs and resumed (a later
run of the job, reading the checkpoint from disk) ends where the straight run did, its
outer momentum included; the pseudo-gradients go through --compression fp16. And
--warm-start-epochs: synchronous first, then asynchronous, resumed on either side of the
switch; a warm start as long as the run is one clear error. And async_local_sgd's dynamic
local steps (DyLU) with one worker made slower: its windows are shorter, the run still
learns, a resume goes on from the measured speeds; with --synchronous it is one clear
error."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import numpy as np
import pytest
from conftest import BatchedRuns, run_mpi
from safetensors.numpy import load_file

from nbdist.metrics.log import read_log
from nbdist.train.checkpoint import Checkpoints

pytestmark = pytest.mark.mpi

ROOT = Path(__file__).resolve().parent.parent
TRAIN_MANY = str(ROOT / "tests" / "mpi_scripts" / "train_many.py")
MLP = str(ROOT / "examples" / "digits_mlp.py")
EPOCHS = 8
ACCURACY = 0.85
H = 8
BATCH = 32

LEARNS = {
    "diloco-sync": ["--algorithm", "diloco(inner_steps=8)", "--synchronous"],
    "diloco-async": ["--algorithm", "diloco(inner_steps=8)"],
    "diloco-fp16": ["--algorithm", "diloco(inner_steps=8)", "--synchronous", "--compression", "fp16"],
    "async_local_sgd": ["--algorithm", "async_local_sgd(inner_steps=8)"],
    "eamsgd": ["--algorithm", "eamsgd(lr=0.05)"],
}
AVERAGING = {
    "diloco-averaging": [
        "--algorithm",
        "diloco(inner_steps=1, outer_lr=1.0, outer_momentum=0.0)",
        "--worker-optimizer",
        "sgd(lr=0.05)",
    ],
    "downpour-averaging": ["--algorithm", "downpour", "--master-optimizer", "sgd(lr=0.05)"],
}
RESUMED = ["--algorithm", "diloco(inner_steps=8)", "--synchronous"]
WARM = ["--model", MLP, "--algorithm", "downpour", "--warm-start-epochs"]
# Worker 1 (world rank 2) sleeps six times as long per batch as worker 0.
ONE_SLOW = str(ROOT / "tests" / "models" / "digits_mlp_one_slow_worker.py")
DYLU = ["--model", ONE_SLOW, "--algorithm", f"async_local_sgd(inner_steps={H}, dynamic_steps=True)"]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    runs_dir = tmp_path_factory.mktemp("new-rules")
    runs = {name: ["--model", MLP, "--epochs", str(EPOCHS), *argv] for name, argv in LEARNS.items()}
    runs.update({name: ["--model", MLP, "--epochs", "2", "--synchronous", *argv] for name, argv in AVERAGING.items()})
    runs["resume-A"] = ["--model", MLP, "--epochs", "4", "--checkpoint-every", "1", *RESUMED]
    runs["resume-B"] = ["--model", MLP, "--epochs", "2", *RESUMED]
    runs["warm"] = [*WARM, "2", "--epochs", "4", "--keep-checkpoints", "6"]
    # Its target holds after epoch 1, inside the warm phase: the run ends there.
    runs["warm-early"] = [*WARM, "3", "--epochs", "4", "--target", "val_acc > 0.0"]
    runs["warm-too-long"] = [*WARM, "4", "--epochs", "4"]
    runs["dylu"] = [*DYLU, "--epochs", str(EPOCHS), "--trace-updates", "--keep-checkpoints", "6"]
    runs["dylu-synchronous"] = [*DYLU, "--epochs", "2", "--synchronous"]
    names = list(runs)
    argvs = [[*runs[n], "--runs-dir", str(runs_dir), "--run-name", n, "--quiet"] for n in names]
    resumes = {
        "resume-B-resumed": ["--resume", str(runs_dir / "resume-B"), "--epochs", "4"],
        "warm-resumed": ["--resume", str(runs_dir / "warm"), "--epochs", "5"],  # after the switch
        # Before the switch (epoch 1 of 3 synchronous ones), with a target that never holds.
        "warm-early-resumed": ["--resume", str(runs_dir / "warm-early"), "--target", "val_acc > 2.0"],
        # Four epochs more: the fast worker still trains when the slow one's first update comes.
        "dylu-resumed": ["--resume", str(runs_dir / "dylu"), "--epochs", str(EPOCHS + 4)],
    }
    names += list(resumes)
    argvs += [[*argv, "--no-quiet"] for argv in resumes.values()]
    spec = runs_dir / "runs.json"
    spec.write_text(json.dumps(argvs))
    done = run_mpi(3, [TRAIN_MANY, str(spec)], timeout=400)
    codes = {names[int(i)]: int(rc) for i, rc in re.findall(r"nbdist-test: run (\d+) rc=(-?\d+)", done.stdout)}
    return BatchedRuns(done.output, done.returncode, runs_dir, codes)


def weights(job, name):
    return load_file(str(job.run(name) / "final" / "model.safetensors"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(LEARNS))
def test_each_new_rule_learns_digits(job, name):
    summary = job.summary(name)
    assert summary["stop_reason"] == f"completed {EPOCHS} epochs"
    history = summary["history"]
    accuracies = [round(h["val_acc"], 3) for h in history]
    # Asynchronous DiLoCo too: its outer momentum lowered for the asynchrony's (0.4 at 2
    # workers, train/asynchrony.py); with the published 0.9 its accuracy swung from epoch
    # to epoch here (bench/results/2026-11-27-convergence-new-rules.md).
    assert history[-1]["val_acc"] >= ACCURACY, f"{name}: {accuracies}"
    assert history[-1]["val_loss"] < history[0]["val_loss"]


@pytest.mark.timeout(600)
def test_diloco_with_h1_outer_lr_1_no_momentum_is_synchronous_averaging(job):
    diloco, downpour = weights(job, "diloco-averaging"), weights(job, "downpour-averaging")
    start = job.summary("diloco-averaging")["history"][0]["val_loss"]
    assert start == pytest.approx(job.summary("downpour-averaging")["history"][0]["val_loss"], rel=1e-4)
    for key in diloco:
        np.testing.assert_allclose(diloco[key], downpour[key], rtol=0, atol=2e-5, err_msg=key)


@pytest.mark.timeout(600)
def test_a_resumed_diloco_run_continues_its_outer_momentum_exactly(job):
    job.run("resume-B-resumed")
    assert re.search(r"resumed from \S*/resume-B/checkpoints/epoch-0002 at epoch 3\b", job.output), job.output[-3000:]
    a, b = weights(job, "resume-A"), weights(job, "resume-B")
    for key in a:
        np.testing.assert_allclose(b[key], a[key], rtol=0, atol=1e-6, err_msg=key)
    # The outer momentum is in the master's (rank 0's) share of the checkpoint, not zero,
    # and the straight run had the same at that epoch.
    shares = []
    for name in ("resume-A", "resume-B"):
        shares.append(
            Checkpoints.read_rank(Checkpoints(job.runs_dir / name).root / "epoch-0002", 0)[0]["rule"]["momentum"]
        )
    assert np.abs(shares[1]).max() > 0
    np.testing.assert_array_equal(shares[1], shares[0])
    history_a, history_b = job.summary("resume-A")["history"], job.summary("resume-B")["history"]
    assert [h["val_loss"] for h in history_b] == pytest.approx([h["val_loss"] for h in history_a], rel=1e-6)


# ----------------------------------------------------------------------------- warm start
def synchronous_at(run: Path, epoch: int) -> bool:
    meta = json.loads((run / "checkpoints" / f"epoch-{epoch:04d}" / "meta.json").read_text())
    return meta["options"]["synchronous"]


@pytest.mark.timeout(600)
def test_a_warm_start_trains_synchronously_then_asynchronously(job):
    run = job.run("warm")
    summary = job.summary("warm")
    # (resumed for a fifth epoch later in the job: see the next test)
    assert [h["epoch"] for h in summary["history"]][:4] == [1, 2, 3, 4], summary["history"]
    assert summary["history"][3]["val_acc"] >= 0.8, summary["history"]
    # The run directory keeps the run's own options; the checkpoints say which phase wrote them.
    saved = json.loads((run / "options.json").read_text())
    assert saved["synchronous"] is False and saved["warm_start_epochs"] == 2
    assert synchronous_at(run, 2) and not synchronous_at(run, 3) and not synchronous_at(run, 4)


@pytest.mark.timeout(600)
def test_a_warm_start_resumes_on_either_side_of_the_switch(job):
    job.run("warm-resumed")
    assert re.search(r"resumed from \S*/warm/checkpoints/epoch-0004 at epoch 5\b", job.output), job.output[-3000:]
    assert [h["epoch"] for h in job.summary("warm")["history"]] == [1, 2, 3, 4, 5]
    assert not synchronous_at(job.runs_dir / "warm", 5)
    # Stopped by its target inside the warm phase, then resumed there: epochs 2 and 3
    # synchronous, then asynchronous.
    early = job.runs_dir / "warm-early"
    # (from the checkpoint the target's stop wrote)
    assert re.search(r"resumed from \S*/warm-early/checkpoints/\S+ at epoch 2\b", job.output), job.output[-3000:]
    job.run("warm-early-resumed")
    assert [h["epoch"] for h in job.summary("warm-early")["history"]] == [1, 2, 3, 4]
    assert synchronous_at(early, 3) and not synchronous_at(early, 4)


def test_a_warm_start_as_long_as_the_run_is_one_clear_error(job):
    assert job.codes["warm-too-long"] != 0
    assert "--warm-start-epochs 4 is not shorter than the run (--epochs 4)" in job.output
    assert "Traceback" not in job.output


# ----------------------------------------------------------------------------- dynamic local steps
def traced_updates(run: Path) -> list[dict]:
    """The master's 'update' records (--trace-updates): worker, samples, the window named."""
    return [{**r["values"], "epoch": r["epoch"]} for r in read_log(run, "update") if r["rank"] == 0]


@pytest.mark.timeout(600)
def test_dynamic_steps_give_a_slow_worker_shorter_windows_and_the_run_learns(job):
    run = job.run("dylu")
    history = job.summary("dylu")["history"]  # (resumed for more epochs later in the job)
    assert [h["epoch"] for h in history][:EPOCHS] == list(range(1, EPOCHS + 1))
    assert history[EPOCHS - 1]["val_acc"] >= ACCURACY, history
    ups = [u for u in traced_updates(run) if u["epoch"] < EPOCHS]
    # While both workers train: after worker 0's last update the slow one trains alone,
    # and is then the fastest, with windows of H again.
    both = ups[: max(k for k, u in enumerate(ups) if u["worker"] == 0)]
    fast, slow = ([u for u in both if u["worker"] == w] for w in (0, 1))
    named_fast, named_slow = [u["window"] for u in fast], [u["window"] for u in slow]
    assert statistics.median(named_fast) == H, named_fast
    assert statistics.median(named_slow) <= H // 2, named_slow
    # The windows it trained are what it was told: after the first (not yet timed), at
    # most the window named (an epoch's end cuts one short).
    for told, trained in zip(slow, slow[1:], strict=False):
        assert trained["samples"] <= told["window"] * BATCH, (told, trained)
    assert statistics.median(u["samples"] for u in slow) < statistics.median(u["samples"] for u in fast)
    # It therefore sent more often per sample: more updates in fewer samples.
    assert len(slow) > len(fast) * sum(u["samples"] for u in slow) / sum(u["samples"] for u in fast)
    # The speeds are in the master's share of the last checkpoint, the slow one's lower.
    speeds = Checkpoints.read_scalars(Checkpoints(run).root / f"epoch-{EPOCHS:04d}", 0)["speeds"]
    assert 0 < speeds[1] < speeds[0], speeds


@pytest.mark.timeout(600)
def test_a_resumed_dylu_run_names_windows_from_the_speeds_it_saved(job):
    job.run("dylu-resumed")
    assert re.search(rf"resumed from \S*/dylu/checkpoints/epoch-{EPOCHS:04d} at epoch {EPOCHS + 1}\b", job.output)
    assert [h["epoch"] for h in job.summary("dylu")["history"]] == list(range(1, EPOCHS + 5))
    after = [u for u in traced_updates(job.runs_dir / "dylu") if u["epoch"] >= EPOCHS]
    # Its first window after the resume is not timed: the window named then comes from
    # the checkpointed speeds (a fresh start names H until it has timed one).
    first_slow = next(u for u in after if u["worker"] == 1)
    assert first_slow["window"] < H, after[:6]


def test_dynamic_steps_in_a_synchronous_run_is_one_clear_error(job):
    assert job.codes["dylu-synchronous"] != 0
    assert "async_local_sgd(dynamic_steps=True) sets each worker's window by its speed" in job.output
    assert "drop --synchronous" in job.output
    assert "Traceback" not in job.output
