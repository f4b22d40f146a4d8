"""Sub-masters under a top master (--masters 2) on real MPI ranks.

6 ranks = 2 masters x (1 + 2 workers): rank 0 is the top master with workers 1 and 2,
rank 3 a sub-master with workers 4 and 5. Starting 6 ranks of Python + torch costs far
more than a digits run, so ONE `mpiexec` job runs every training run in turn through
`nbdist.cli.main` (tests/mpi_scripts/hierarchy_runs.py): the accuracy runs, a straight
and a split-and-resumed run, a run whose sub-master's worker fails, a run stopped at the
sub-master's epoch end and its resume, and a long run that the fixture stops with
SIGUSR1 to `mpiexec` once it has logged an epoch, and its resume.
"""

from __future__ import annotations

import json
import re
import textwrap
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import BatchedRuns
from mpi_stops import run_and_stop
from safetensors.numpy import load_file

from nbdist.metrics import read_log

pytestmark = pytest.mark.mpi

ROOT = Path(__file__).resolve().parent.parent
# train_many.py, plus a stop injected at one exact point of one run (see the script).
HIERARCHY_RUNS = str(ROOT / "tests" / "mpi_scripts" / "hierarchy_runs.py")
MLP = str(ROOT / "examples" / "digits_mlp.py")
RANKS = 6
TOP_WORKERS, SUB_MASTER, SUB_WORKERS = {1, 2}, 3, {4, 5}
ACCURACY = 0.90
EPOCHS = 12
MOMENTUM_MASTER = "sgd(lr=0.1, momentum=0.9)"
EVERY_SAMPLES = 400
# Every update recorded (--trace-updates): the tests read which client each master served.
ACCURACY_RUNS = {
    name: [*argv, "--trace-updates"]
    for name, argv in {
        # Also validates every N samples (test_the_top_master_validates_every_n_samples).
        "downpour": ["--algorithm", "downpour", "--validate-every-samples", str(EVERY_SAMPLES)],
        "downpour-sync": ["--algorithm", "downpour", "--synchronous", "--master-optimizer", MOMENTUM_MASTER],
        "easgd": ["--algorithm", "easgd"],
        "easgd-sync": ["--algorithm", "easgd", "--synchronous"],
        "adag": ["--algorithm", "adag"],
    }.items()
}
STOP_EPOCHS = 300
RESUMED_EPOCHS = 16
RESUME = ["--algorithm", "downpour", "--synchronous", "--master-optimizer", MOMENTUM_MASTER]

# NaN from the 6th loss call on, on rank 4 only (a worker of the sub-master).
NAN_ON_RANK_4 = """
    import math

    from mpi4py import MPI
    from torch import nn

    import nbdist.datasets

    calls = 0

    def build_model():
        return nn.Sequential(nn.Linear(64, 10))

    def loss(output, target):
        global calls
        calls += 1
        value = nn.functional.cross_entropy(output, target)
        return value * math.nan if calls > 5 and MPI.COMM_WORLD.Get_rank() == 4 else value

    def load_data():
        return nbdist.datasets.digits()
"""


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    runs_dir = tmp_path_factory.mktemp("hierarchy")
    nan_model = runs_dir / "nan_on_rank_4.py"
    nan_model.write_text(textwrap.dedent(NAN_ON_RANK_4))
    runs = {name: ["--model", MLP, "--epochs", str(EPOCHS), *argv] for name, argv in ACCURACY_RUNS.items()}
    runs["resume-A"] = ["--model", MLP, "--epochs", "4", "--checkpoint-every", "1", *RESUME]
    runs["resume-B"] = ["--model", MLP, "--epochs", "2", *RESUME]
    # Runs one after the other: the resume starts new communicators, model and optimisers
    # from the files that run B wrote. (--run-name is ignored: it continues in B's directory.)
    runs["resume-B2"] = ["--resume", str(runs_dir / "resume-B"), "--epochs", "4"]
    runs["nan"] = ["--model", str(nan_model), "--epochs", "3"]
    runs["stop-at-sub-epoch-end"] = ["--model", MLP, "--epochs", "6", *RESUME]
    # The resumes keep every checkpoint: the tests read the stop checkpoints they resumed from.
    runs["stop-at-sub-epoch-end-resume"] = [
        "--resume",
        str(runs_dir / "stop-at-sub-epoch-end"),
        "--epochs",
        "4",
        "--keep-checkpoints",
        "1000",
    ]
    # Stopped by the signal once it logged an epoch, then resumed in the same directory.
    runs["stop"] = ["--model", MLP, "--epochs", str(STOP_EPOCHS)]
    runs["stop-resume"] = [
        "--resume",
        str(runs_dir / "stop"),
        "--epochs",
        str(RESUMED_EPOCHS),
        "--keep-checkpoints",
        "1000",
    ]
    names = list(runs)
    argvs = [
        [*runs[name], "--masters", "2", "--runs-dir", str(runs_dir), "--run-name", name, "--quiet"] for name in names
    ]
    spec = runs_dir / "runs.json"
    spec.write_text(json.dumps(argvs))
    # SIGUSR1 to mpiexec once the run `stop` logged an epoch.
    done = run_and_stop(RANKS, [HIERARCHY_RUNS, str(spec)], [runs_dir / "stop"], runs_dir, timeout=500)
    found = re.findall(r"nbdist-test: run (\d+) rc=(-?\d+)", done.stdout)
    return BatchedRuns(done.output, done.returncode, runs_dir, {names[int(i)]: int(rc) for i, rc in found})


def _updates(run: Path, rank: int) -> list[dict]:
    records = [r["values"] for r in read_log(run, "update") if r["rank"] == rank]
    return sorted(records, key=lambda v: v["version"])


# ------------------------------------------------------------------------- accuracy
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(ACCURACY_RUNS))
def test_sub_masters_learn_digits(job, name):
    summary = job.summary(name)
    assert summary["stop_reason"] == f"completed {EPOCHS} epochs"
    history = summary["history"]
    assert [h["epoch"] for h in history] == list(range(1, EPOCHS + 1))
    # All 4 workers (2 per master) share one pass over the data per epoch. Synchronous,
    # every epoch counts exactly that; asynchronous, an epoch ends without waiting for a
    # late worker, whose share counts in the epoch it arrives in: every sample is still
    # counted once over the run.
    import nbdist.datasets

    n_train = nbdist.datasets.digits().n_train
    samples = [h["samples"] for h in history]
    if name.endswith("-sync"):
        assert set(samples) == {n_train}, samples
    else:
        assert sum(samples) == EPOCHS * n_train and min(samples) > 0, samples
    final = summary["final"]["val_acc"]
    assert final >= ACCURACY, f"{name}: val_acc {final:.4f} after {EPOCHS} epochs: {history}"

    run = job.run(name)
    top = _updates(run, 0)
    # The top master serves its own workers and the sub-master, whose pushes are updates too.
    assert {u["source_rank"] for u in top} == TOP_WORKERS | {SUB_MASTER}
    assert [u["version"] for u in top if u["source_rank"] == SUB_MASTER], "no push from the sub-master"
    # The sub-master serves its own two workers; only the top master validates and reports.
    assert {u["source_rank"] for u in _updates(run, SUB_MASTER)} == SUB_WORKERS
    assert {r["rank"] for r in read_log(run, "epoch")} == {0}
    statuses = {r["rank"]: r["values"]["status"] for r in read_log(run, "run")}
    assert statuses.get(0) == statuses.get(SUB_MASTER) == "completed", statuses

    if "sync" in name:
        # One version per round; every round has both workers and the sub-master in it.
        assert {u["staleness"] for u in top} == {0}
        assert set(Counter(u["version"] for u in top).values()) == {3}
        assert {u["staleness"] for u in _updates(run, SUB_MASTER)} == {0}
    else:
        assert [u["version"] for u in top] == list(range(1, len(top) + 1))
        assert min(u["staleness"] for u in top) >= 0


@pytest.mark.timeout(900)
def test_the_top_master_validates_every_n_samples(job):
    """It counts its own workers' samples and those each sub-master's push merges (a
    push's SAMPLES are the sub-master's epoch tally, sent only at its epoch's end)."""
    run = job.run("downpour")
    points = [r for r in read_log(run, "val")]
    assert {r["rank"] for r in points} == {0}  # only the top master validates
    seen = [r["values"]["samples_seen"] for r in points]
    intervals = [s // EVERY_SAMPLES for s in seen]
    assert intervals == sorted(set(intervals)) and intervals[0] >= 1, seen
    import nbdist.datasets

    total = EPOCHS * nbdist.datasets.digits().n_train
    # Every sample of all four workers, each once: the sub-master's merged ones included.
    assert job.summary("downpour")["history"][-1]["samples_seen"] == total
    assert seen[-1] <= total
    assert all(0.0 <= r["values"]["val_acc"] <= 1.0 for r in points)


# -------------------------------------------------------------- resume, checkpoints
@pytest.mark.timeout(900)
def test_synchronous_resume_with_sub_masters_is_exact(job):
    a, b = job.run("resume-A"), job.run("resume-B")
    job.run("resume-B2")  # the resume itself succeeded
    weights_a = load_file(str(a / "final" / "model.safetensors"))
    weights_b = load_file(str(b / "final" / "model.safetensors"))
    assert set(weights_a) == set(weights_b)
    for key in weights_a:
        diff = float(np.max(np.abs(weights_a[key] - weights_b[key])))
        assert diff <= 1e-6, f"{key}: resumed run differs from the straight run by {diff:g}"
    summary_a = json.loads((a / "summary.json").read_text())
    summary_b = json.loads((b / "summary.json").read_text())
    assert [h["epoch"] for h in summary_b["history"]] == [1, 2, 3, 4]
    np.testing.assert_allclose(
        [h["val_loss"] for h in summary_b["history"]], [h["val_loss"] for h in summary_a["history"]], rtol=1e-6
    )


@pytest.mark.timeout(900)
def test_every_rank_writes_its_share_of_each_checkpoint(job):
    root = job.run("resume-A") / "checkpoints"
    labels = sorted(p.name for p in root.iterdir() if p.is_dir())
    assert labels == ["epoch-0002", "epoch-0003", "epoch-0004"], labels  # --keep-checkpoints 3
    assert not list(root.glob(".*"))
    assert json.loads((root / "LATEST.json").read_text())["label"] == "epoch-0004"
    for label in labels:
        files = sorted(p.name for p in (root / label).iterdir())
        assert files == ["meta.json"] + [f"rank-{r:05d}.{ext}" for r in range(RANKS) for ext in ("json", "safetensors")]
    last = root / "epoch-0004"
    sub = load_file(str(last / f"rank-{SUB_MASTER:05d}.safetensors"))
    top = load_file(str(last / "rank-00000.safetensors"))
    # At a synchronous epoch's end the sub-master has just pulled: its centre, its pulled
    # copy and the top centre are one and the same.
    assert np.array_equal(sub["own/pulled"], top["model/params"])
    assert np.array_equal(sub["model/params"], top["model/params"])
    assert any(k.startswith("opt/") for k in sub), sorted(sub)  # its own master optimiser
    meta = json.loads((last / f"rank-{SUB_MASTER:05d}.json").read_text())
    assert meta["role"] == "master" and meta["next_epoch"] == 4


# --------------------------------------------------------------------------- errors
@pytest.mark.timeout(900)
def test_a_failing_worker_under_a_sub_master_stops_the_run_with_one_error(job):
    assert job.codes.get("nan") == 2, job.output[-6000:]
    lines = [line for line in job.output.splitlines() if line.startswith("nbdist: error")]
    assert len(lines) == 1, job.output[-6000:]
    assert "loss became nan on rank 4 (worker 0 of master 1, host " in lines[0], lines[0]
    run = job.runs_dir / "nan"
    assert not list(run.glob("checkpoints/.tmp-*")), "an uncommitted checkpoint was left behind"
    statuses = {r["rank"]: r["values"]["status"] for r in read_log(run, "run")}
    assert statuses.get(0) == statuses.get(SUB_MASTER) == "failed", statuses
    # The job went on with its next run: no rank was left behind.
    assert "stop" in job.codes, job.output[-6000:]


# -------------------------------------------------------------------- graceful stop
@pytest.mark.timeout(900)
def test_sigusr1_stops_all_six_ranks_and_commits_a_checkpoint(job):
    assert "Traceback" not in job.output, job.output[-6000:]
    run = job.run("stop")  # exit status 0 on every rank
    # The run's own records: its directory was resumed afterwards (summary.json is the resume's).
    first = {}
    for record in read_log(run, "run"):
        first.setdefault(record["rank"], record["values"])
    assert first[0]["status"] == first[SUB_MASTER]["status"] == "stopped", first
    assert "stop" in first[0]["reason"], first[0]
    root = run / "checkpoints"
    stopped = [p for p in root.iterdir() if p.name.startswith("stopped-")]
    assert len(stopped) == 1, sorted(p.name for p in root.iterdir())
    # Committed, with every rank's share: both masters and all four workers.
    assert (stopped[0] / "meta.json").exists()
    assert sorted(p.name for p in stopped[0].glob("rank-*.safetensors")) == [
        f"rank-{r:05d}.safetensors" for r in range(RANKS)
    ]
    assert not list(root.glob(".tmp-*"))


@pytest.mark.timeout(900)
def test_a_run_stopped_by_signal_resumes_with_every_sample_once_per_epoch(job):
    job.run("stop-resume")
    run = job.runs_dir / "stop"
    stopped = next((run / "checkpoints").glob("stopped-*"))
    stopped_at = json.loads((stopped / "rank-00000.json").read_text())["next_epoch"]
    if stopped_at >= RESUMED_EPOCHS - 1:
        pytest.skip(f"the signal landed only in epoch {stopped_at + 1}")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == f"completed {RESUMED_EPOCHS} epochs"
    history = summary["history"]
    assert [h["epoch"] for h in history] == list(range(1, RESUMED_EPOCHS + 1))
    # The epoch the stop cut in two too: what the masters had taken before the stop is in
    # the stop checkpoint, what they dropped was done again after the resume. Asynchronous:
    # an epoch that ends before a late worker's share says how many samples it waits for
    # (samples_pending), and the share counts in the epoch it arrives in.
    import nbdist.datasets

    n_train = nbdist.datasets.digits().n_train
    assert sum(h["samples"] for h in history) == RESUMED_EPOCHS * n_train, history
    assert all(h["samples"] + h.get("samples_pending", 0) >= n_train for h in history), history
    assert summary["final"]["val_acc"] >= ACCURACY


@pytest.mark.timeout(900)
def test_an_epoch_the_top_master_never_took_survives_stop_and_resume(job):
    run = job.run("stop-at-sub-epoch-end")
    job.run("stop-at-sub-epoch-end-resume")
    stopped = next((run / "checkpoints").glob("stopped-*"))
    # Both sub-master's workers ended epoch 2, the top master dropped the push saying so:
    # the sub-master kept that epoch open, with its tally, in its share of the checkpoint.
    sub = json.loads((stopped / f"rank-{SUB_MASTER:05d}.json").read_text())
    assert sub["next_epoch"] == 1, sub
    assert len(sub["tallies"]["1"][3]) == 2, sub["tallies"]  # the clients that ended it
    assert json.loads((stopped / "rank-00000.json").read_text())["next_epoch"] == 1
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop_reason"] == "completed 4 epochs"
    import nbdist.datasets

    history = summary["history"]
    assert [h["epoch"] for h in history] == [1, 2, 3, 4]
    assert {h["samples"] for h in history} == {nbdist.datasets.digits().n_train}, history


# ------------------------------------------------------------------ the merge rule
@pytest.mark.parametrize("spec", ["easgd", "gem", "adag", "dynsgd", "downpour"])
def test_a_synchronous_round_under_a_sub_master_equals_one_master(spec):
    """Without MPI: top master + sub-master (2 workers each) move the centre exactly as
    one master with all 4 workers does. Each applies the rule to its own workers from the
    same centre; the top master merges the two steps with merge_master_steps, as
    roles/master/ does: their mean for the averaging rules, their sum for EASGD,
    whose elastic force is bound to every worker of the run."""
    import torch

    from nbdist.algorithms import make_algorithm
    from nbdist.algorithms.base import Update
    from nbdist.backends.torch import TorchFlatOptimizer
    from nbdist.specs import parse_spec

    rng = np.random.default_rng(0)
    initial = rng.standard_normal(50).astype(np.float32)  # the centre both masters start from
    payloads = [rng.standard_normal(50).astype(np.float32) for _ in range(4)]

    def master(start):
        algorithm = make_algorithm(parse_spec(spec))
        algorithm.bind(4)
        centre = start.copy()
        opt = (
            TorchFlatOptimizer(torch.optim.SGD, parse_spec("sgd(lr=0.1)"), centre)
            if algorithm.uses_master_optimizer
            else None
        )
        return algorithm, algorithm.new_master_state(50), centre, opt

    def apply(start, workers):
        algorithm, state, centre, opt = master(start)
        algorithm.master_apply(state, centre, [Update(payloads[w].copy(), 0, 32) for w in workers], opt)
        return algorithm, centre

    _, flat = apply(initial, [0, 1, 2, 3])
    top_rule, top = apply(initial, [0, 1])
    _, sub = apply(initial, [2, 3])
    merged = initial.copy()
    top_rule.merge_master_steps(merged, [Update(top - initial, 0, 2), Update(sub - initial, 0, 2)])
    assert np.abs(flat - initial).max() > 0.05
    np.testing.assert_allclose(merged, flat, rtol=1e-5, atol=1e-6)
