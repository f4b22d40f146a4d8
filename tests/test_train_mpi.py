"""Training on real MPI ranks: every algorithm learns, staleness and fair service,
exact resume, checkpoints, early stopping and targets, multi-process workers,
BatchNorm (synchronised too: --sync-batchnorm), and a graceful stop by signal.

Starting Python + torch + MPI costs seconds per rank on a small box, while a digits run
trains in well under a second, so most runs are batched: one `mpiexec` job per rank
count runs many command lines through `nbdist.cli.main` (tests/mpi_scripts/train_many.py),
and each test then reads its own run's files. Resumes run in a later job, i.e. in other
processes than the ones that wrote the checkpoints. The graceful stop runs
`python -m nbdist train` itself.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from itertools import pairwise
from pathlib import Path

import numpy as np
import psutil
import pytest
from batched_runs import cut_at_markers
from conftest import BatchedRuns
from mpi_stops import run_and_stop
from safetensors.numpy import load_file

from nbdist.metrics import read_log
from nbdist.specs import parse_spec
from nbdist.train.checkpoint import Checkpoints
from nbdist.train.context import DEFAULT_WORKER_OPTIMIZER

pytestmark = pytest.mark.mpi

ROOT = Path(__file__).resolve().parent.parent
TRAIN_MANY = str(ROOT / "tests" / "mpi_scripts" / "train_many.py")
MLP = str(ROOT / "examples" / "digits_mlp.py")
CNN = str(ROOT / "examples" / "digits_cnn.py")
PIPELINE = str(ROOT / "examples" / "digits_pipeline.py")
LOSS_X1000 = str(ROOT / "tests" / "models" / "digits_mlp_loss_x1000.py")

# The bar, and the budget chosen once per algorithm (an epoch of digits takes well
# under 0.1 s here; the budget leaves a margin for the noise of asynchronous runs).
ACCURACY = 0.90
EPOCHS = 12
DIGITS_TRAIN = 1437  # nbdist.datasets.digits(): 80% of scikit-learn's 1797 images
MOMENTUM_MASTER = "sgd(lr=0.1, momentum=0.9)"
BATCH = 32  # the default --batch-size
# Two of the accuracy runs also validate every N samples (test_validations_every_n_samples):
# cheaper than runs of their own, and they show that it leaves training as it was.
EVERY_SAMPLES = 400
SAMPLED = ["--validate-every-samples", str(EVERY_SAMPLES)]
# The master/worker runs record every update (the staleness tests read the order of service).
TRACE = ["--trace-updates"]
ACCURACY_RUNS = {
    # Downpour's default master optimizer is plain sgd: asynchronous pushes already act as
    # momentum. A synchronous round is one big-batch step, which wants momentum back.
    "downpour": ["--algorithm", "downpour", *SAMPLED, *TRACE],
    "downpour-sync": ["--algorithm", "downpour", "--synchronous", "--master-optimizer", MOMENTUM_MASTER, *TRACE],
    "easgd": ["--algorithm", "easgd", *TRACE],
    "easgd-sync": ["--algorithm", "easgd", "--synchronous", *TRACE],
    "gem": ["--algorithm", "gem(lr=0.05, momentum=0.9, kappa=1.0)", *TRACE],
    "adag": ["--algorithm", "adag", *TRACE],
    "allreduce": ["--topology", "allreduce", *SAMPLED],
}
# Extra runs in the same jobs: {ranks: {name: argv after `train`}}.
EXTRA_RUNS = {
    3: {
        # --sync-batchnorm with one process per worker: a warning, and plain BatchNorm.
        "cnn-master-worker": ["--model", CNN, "--epochs", "6", "--sync-batchnorm"],
        "cnn-allreduce": ["--model", CNN, "--epochs", "6", "--topology", "allreduce"],
        # Validated only at the end: the statistics of its earlier checkpoints are the ranks' own.
        "cnn-allreduce-syncbn": [
            "--model",
            CNN,
            "--epochs",
            "6",
            "--topology",
            "allreduce",
            "--sync-batchnorm",
            "--validate-every",
            "10",
        ],
        "target": ["--model", MLP, "--epochs", "30", "--target", "val_acc > 0.5"],
        # A tiny lr: val_loss moves by far less than min_delta from one epoch to the next.
        "early-stopping": [
            "--model",
            MLP,
            "--epochs",
            "30",
            "--topology",
            "allreduce",
            "--worker-optimizer",
            "sgd(lr=1e-6)",
            "--early-stopping",
            "1",
            "--min-delta",
            "0.001",
        ],
        # GEM's workers add up raw gradients (no optimiser to skip an overflowed one).
        "gem-fp16-overflow": [
            "--model",
            LOSS_X1000,
            "--epochs",
            "4",
            "--algorithm",
            "gem(lr=0.00005)",
            "--precision",
            "fp16",
        ],
        # 1 master + 1 worker of 2 pipeline stages, GPipe, Downpour pushing every batch.
        "pipeline-gpipe": [
            "--model",
            PIPELINE,
            "--epochs",
            str(EPOCHS),
            "--procs-per-worker",
            "2",
            "--worker-parallel",
            "pipeline",
            "--pipeline-schedule",
            "gpipe",
            *TRACE,
        ],
        # The same, its leader's whole-model message through PowerSGD (the stages' matrices).
        "pipeline-powersgd": [
            "--model",
            PIPELINE,
            "--epochs",
            str(EPOCHS),
            "--procs-per-worker",
            "2",
            "--worker-parallel",
            "pipeline",
            "--pipeline-schedule",
            "gpipe",
            "--compression",
            "powersgd(2)",
            *TRACE,
        ],
    },
    5: {
        # 1 master + 2 workers of 2 processes each.
        "procs-per-worker-2": ["--model", MLP, "--epochs", str(EPOCHS), "--procs-per-worker", "2", *TRACE],
        # On the device path (torch tensors through the staging), as on a GPU.
        "cnn-procs-per-worker-2-syncbn": [
            "--model",
            CNN,
            "--epochs",
            "6",
            "--procs-per-worker",
            "2",
            "--sync-batchnorm",
            "--device",
            "cpu",
        ],
        # 1 master + 2 workers of 2 pipeline stages, 1F1B, EASGD.
        "pipeline-1f1b": [
            "--model",
            PIPELINE,
            "--epochs",
            str(EPOCHS),
            "--procs-per-worker",
            "2",
            "--worker-parallel",
            "pipeline",
            "--algorithm",
            "easgd",
            *TRACE,
        ],
    },
}
SLOW_VALIDATION = str(ROOT / "tests" / "models" / "digits_mlp_slow_validation.py")
# test_an_asynchronous_master_serves_its_workers_while_it_validates_a_checkpointed_epoch
EXTRA_RUNS[3]["slow-validation"] = [
    "--model",
    SLOW_VALIDATION,
    "--epochs",
    "3",
    "--batch-size",
    "16",
    "--trace-updates",
]
# Long runs that the -n 3 job trains last, each stopped by SIGUSR1 to `mpiexec` once it
# has logged an epoch (test_sigusr1_stops_every_rank_and_checkpoints); the master/worker
# one is resumed by the `resumed` job.
STOP_EPOCHS = 200
STOP_RUNS = {
    f"stop-{topology}": ["--model", MLP, "--topology", topology, "--epochs", str(STOP_EPOCHS)]
    for topology in ("master-worker", "allreduce")
}
# --compression: each codec on the allreduce and on workers' messages to a master (test_compression_*).
COMPRESSED_RUNS = {
    3: {
        "allreduce-fp16": ["--topology", "allreduce", "--compression", "fp16"],
        "allreduce-bf16": ["--topology", "allreduce", "--compression", "bf16"],
        "allreduce-topk": ["--topology", "allreduce", "--compression", "topk(0.1)"],
        "allreduce-powersgd": ["--topology", "allreduce", "--compression", "powersgd(2)"],
        "downpour-topk": ["--algorithm", "downpour", "--compression", "topk(ratio=0.1)"],
        "downpour-powersgd": ["--algorithm", "downpour", "--compression", "powersgd(2)"],
        "easgd-bf16": ["--algorithm", "easgd", "--compression", "bf16"],
    },
    # The workers' own allreduce and their messages to the master.
    5: {"procs-per-worker-2-fp16": ["--procs-per-worker", "2", "--compression", "fp16"]},
}
for _n, _runs in COMPRESSED_RUNS.items():
    EXTRA_RUNS[_n].update({name: ["--model", MLP, "--epochs", str(EPOCHS), *argv] for name, argv in _runs.items()})


def _run_batch(
    n: int, runs: dict[str, list[str]], runs_dir: Path, timeout: float, quiet: bool = True, stops: tuple = ()
):
    """Run `runs` (name -> argv after `train`) in one `mpiexec -n n` job; the runs named in
    `stops` (in the job's order) are each sent SIGUSR1 once they have logged an epoch."""
    from conftest import run_mpi

    names = list(runs)
    argvs = [
        [*runs[name], "--runs-dir", str(runs_dir), "--run-name", name, "--quiet" if quiet else "--no-quiet"]
        for name in names
    ]
    spec = runs_dir / f"runs-{n}.json"
    runs_dir.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps(argvs))
    if stops:
        done = run_and_stop(n, [TRAIN_MANY, str(spec)], [runs_dir / name for name in stops], runs_dir, timeout)
    else:
        done = run_mpi(n, [TRAIN_MANY, str(spec)], timeout=timeout)
    codes = {names[int(i)]: int(rc) for i, rc in re.findall(r"nbdist-test: run (\d+) rc=(-?\d+)", done.stdout)}
    return done, codes


class Batch(BatchedRuns):
    """The runs of one job, keeping the job's completed process for its stdout."""

    def __init__(self, done, codes, runs_dir: Path):
        super().__init__(done.output, done.returncode, runs_dir, codes)
        self.done = done

    def output_of(self, name: str) -> str:
        """What the job printed (stdout, then stderr) during run `name` (train_many.py marks
        each run's end on both streams)."""
        i = list(self.codes).index(name)
        return "".join(cut_at_markers(text, i + 1)[0][i] for text in (self.done.stdout, self.done.stderr))


RESUME_CONFIGS = {
    "downpour-sync": ["--algorithm", "downpour", "--synchronous", "--master-optimizer", MOMENTUM_MASTER],
    "easgd-sync": ["--algorithm", "easgd", "--synchronous"],
    "allreduce": ["--topology", "allreduce"],
    # Warm-up past the resumed checkpoint, scaling and a schedule (see LR_CONFIGS).
    "downpour-sync-lr": [
        "--algorithm",
        "downpour",
        "--synchronous",
        "--master-optimizer",
        MOMENTUM_MASTER,
        "--lr-scaling",
        "linear",
        "--warmup-epochs",
        "3",
        "--master-lr-schedule",
        "steplr(step_size=1, gamma=0.7)",
    ],
    "allreduce-lr": [
        "--topology",
        "allreduce",
        "--lr-scaling",
        "sqrt",
        "--warmup-epochs",
        "2.5",
        "--worker-lr-schedule",
        "CosineAnnealingLR(T_max=4)",
    ],
    # The residuals and PowerSGD's warm start are in every rank's share of the checkpoint.
    "allreduce-powersgd": ["--topology", "allreduce", "--compression", "powersgd(1)"],
}
RESUME_RANKS = 3
for _name, _argv in RESUME_CONFIGS.items():
    # Run A trains 4 epochs at once (checkpointing each); run B stops after 2 and is
    # resumed later (see `resumed`).
    EXTRA_RUNS[RESUME_RANKS][f"{_name}-A"] = ["--model", MLP, "--epochs", "4", "--checkpoint-every", "1", *_argv]
    EXTRA_RUNS[RESUME_RANKS][f"{_name}-B"] = ["--model", MLP, "--epochs", "2", *_argv]
# `--compression none` is today's code path: the same weights, bit for bit, as run A without it.
for _name in ("allreduce", "downpour-sync"):
    EXTRA_RUNS[RESUME_RANKS][f"{_name}-none"] = [*EXTRA_RUNS[RESUME_RANKS][f"{_name}-A"], "--compression", "none"]
# Like allreduce-B, but its latest checkpoint is truncated before the resume.
EXTRA_RUNS[RESUME_RANKS]["allreduce-C"] = EXTRA_RUNS[RESUME_RANKS]["allreduce-B"]
TRUNCATED = "checkpoints/epoch-0002/rank-00000.safetensors"
# Allreduce ranks keep rank 0's copy of the weights and optimiser state (world rank -> owner).
ALLREDUCE_TWINS = {3: {1: 0, 2: 0}, 4: {1: 0, 2: 0, 3: 0}}


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    """{3: Batch, 5: Batch}: every accuracy run under -n 3 and -n 5, plus the extras (the
    -n 3 job's stop runs stopped by signal, each copied as it was then to `stopped/`)."""
    out = {}
    for n in (3, 5):
        runs_dir = tmp_path_factory.mktemp(f"n{n}")
        runs = {name: ["--model", MLP, "--epochs", str(EPOCHS), *argv] for name, argv in ACCURACY_RUNS.items()}
        runs.update(EXTRA_RUNS[n])
        if n == RESUME_RANKS:
            runs.update(STOP_RUNS)
        stops = tuple(name for name in runs if name in STOP_RUNS)
        out[n] = Batch(*_run_batch(n, runs, runs_dir, timeout=400, stops=stops), runs_dir)
        for name in stops:  # before the `resumed` job continues one in its directory
            if out[n].codes.get(name) == 0:
                shutil.copytree(runs_dir / name, runs_dir / "stopped" / name, symlinks=True)
    return out


# ------------------------------------------------------------------------- accuracy
@pytest.mark.timeout(900)
@pytest.mark.parametrize("n", [3, 5])
@pytest.mark.parametrize("name", list(ACCURACY_RUNS))
def test_every_algorithm_learns_digits(batches, n, name):
    summary = batches[n].summary(name)
    assert summary["epochs_run"] == EPOCHS
    assert summary["stop_reason"] == f"completed {EPOCHS} epochs"
    history = summary["history"]
    assert [h["epoch"] for h in history] == list(range(1, EPOCHS + 1))
    samples = [h["samples"] for h in history]
    if name == "allreduce" or "--synchronous" in ACCURACY_RUNS[name]:
        # Every sample of the training set is used once per epoch, over all workers.
        assert all(s == DIGITS_TRAIN for s in samples), samples
    else:
        # Asynchronous: the master never waits for a late worker, whose share counts in the
        # epoch it arrives in; every sample is still used once per epoch, over the run.
        assert sum(samples) == EPOCHS * DIGITS_TRAIN, samples
    final = summary["final"]["val_acc"]
    assert final >= ACCURACY, f"{name} on {n} ranks: val_acc {final:.4f} after {EPOCHS} epochs: {history}"
    # The weights that reach 0.90 are the ones written out.
    weights = load_file(str(batches[n].run(name) / "final" / "model.safetensors"))
    assert set(weights) == {"0.weight", "0.bias", "2.weight", "2.bias"}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("topology", ["master-worker", "allreduce"])
def test_batchnorm_model_learns_and_its_statistics_travel(batches, topology):
    summary = batches[3].summary(f"cnn-{topology}")
    assert summary["final"]["val_acc"] >= ACCURACY, summary["history"]
    weights = load_file(str(batches[3].run(f"cnn-{topology}") / "final" / "model.safetensors"))
    # The saved model holds BatchNorm statistics gathered from the workers, not the
    # initial zeros and ones (the master itself never runs a training batch).
    assert np.abs(weights["1.running_mean"]).max() > 1e-3
    assert np.abs(weights["1.running_var"] - 1).max() > 1e-3


def _model_states(checkpoint: Path, ranks: range) -> dict[int, np.ndarray]:
    return {rank: Checkpoints.read_rank(checkpoint, rank)[0]["model"]["state"] for rank in ranks}


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    "name, ranks, twins, epochs",
    [
        ("cnn-allreduce-syncbn", 3, [(0, 1, 2)], (5, 6)),
        # Asynchronous workers write their share of a checkpoint at the end (or when asked).
        ("cnn-procs-per-worker-2-syncbn", 5, [(1, 2), (3, 4)], (6,)),
    ],
)
def test_synchronised_batchnorm_learns_and_every_rank_of_a_batch_holds_the_same_statistics(
    batches, name, ranks, twins, epochs
):
    """--sync-batchnorm over the allreduce ranks and over a worker's 2 processes (with
    --device cpu, the device path): the CNN
    learns, and the ranks that share each batch hold bit-identical running statistics in
    its checkpoints (the allreduce run validates, and so averages them, only at its end;
    a worker's processes never average theirs): without it each would hold its own."""
    summary = batches[ranks].summary(name)
    assert summary["final"]["val_acc"] >= ACCURACY, summary["history"]
    run = batches[ranks].run(name)
    for epoch in epochs:
        states = _model_states(run / "checkpoints" / f"epoch-{epoch:04d}", range(ranks))
        for group in twins:
            assert np.abs(states[group[0]]).max() > 1e-3  # statistics were gathered
            for rank in group[1:]:
                assert np.array_equal(states[rank], states[group[0]]), (epoch, group, rank)
    if ranks == 5:  # different workers train apart
        assert not np.array_equal(states[1], states[3])


def test_sync_batchnorm_with_one_process_per_worker_says_there_is_nothing_to_synchronise(batches):
    assert batches[3].output.count("--sync-batchnorm: each worker is one process") == 1, batches[3].output


@pytest.mark.timeout(900)
def test_procs_per_worker_two(batches):
    run = batches[5].run("procs-per-worker-2")
    layout = json.loads((run / "layout.json").read_text())["options"]
    assert (layout["workers"], layout["procs_per_worker"]) == (2, 2), layout
    summary = batches[5].summary("procs-per-worker-2")
    assert summary["final"]["val_acc"] >= ACCURACY, summary["history"]
    # Only each worker's leader talks to the master.
    sources = Counter(r["values"]["source_rank"] for r in read_log(run, "update"))
    assert set(sources) == {1, 3}, sources
    # Each worker's two processes log their own throughput.
    train_ranks = {r["rank"] for r in read_log(run, "train")}
    assert train_ranks == {1, 2, 3, 4}
    # The second process of each worker keeps its leader's copy of the weights.
    _check_checkpoint_dir(run / "checkpoints" / f"epoch-{EPOCHS:04d}", 5, {2: 1, 4: 3})


@pytest.mark.timeout(900)
@pytest.mark.parametrize("n,name", [(3, "pipeline-gpipe"), (5, "pipeline-1f1b"), (3, "pipeline-powersgd")])
def test_pipeline_workers_learn_digits(batches, n, name):
    run = batches[n].run(name)
    summary = batches[n].summary(name)
    assert summary["final"]["val_acc"] >= ACCURACY, summary["history"]
    samples = [h["samples"] for h in summary["history"]]
    if n == 3:  # one worker: each epoch is the training set
        assert all(s == DIGITS_TRAIN for s in samples), summary["history"]
    else:  # two asynchronous workers: a late share counts in the epoch it arrives in
        assert sum(samples) == EPOCHS * DIGITS_TRAIN, summary["history"]
    # The master's model is the two stages in a row.
    weights = load_file(str(run / "final" / "model.safetensors"))
    assert set(weights) == {"0.0.weight", "0.0.bias", "1.0.weight", "1.0.bias", "1.2.weight", "1.2.bias"}
    # Only each worker's leader (stage 0) talks to the master, for the whole model.
    leaders = {1} if n == 3 else {1, 3}
    assert set(r["values"]["source_rank"] for r in read_log(run, "update")) == leaders
    # Every stage checkpoints weights of its own (no twins), of its own size.
    path = run / "checkpoints" / f"epoch-{EPOCHS:04d}"
    _check_checkpoint_dir(path, n)
    first, second = 64 * 128 + 128, 128 * 64 + 64 + 64 * 10 + 10
    sizes = [Checkpoints.read_rank(path, rank)[0]["model"]["params"].size for rank in range(n)]
    assert sizes == [first + second] + [first, second] * (n // 2), sizes
    if name == "pipeline-powersgd":
        # The same messages as pipeline-gpipe's, each in far fewer bytes.
        sent = {
            run: sum(r["values"]["bytes_sent"] for r in read_log(batches[n].run(run), "train") if r["rank"] == 1)
            for run in ("pipeline-gpipe", name)
        }
        assert 0 < sent[name] < sent["pipeline-gpipe"] / 4, sent


@pytest.mark.timeout(900)
def test_fp16_gradients_that_overflow_are_left_out_of_a_gem_workers_sum(batches):
    """GEM's workers have no optimiser that could skip a step: a gradient that overflowed in
    fp16 (inf) would go into the sum they send, and the master's centre would become NaN.
    The worker leaves it out, and the loss scale backs off."""
    summary = batches[3].summary("gem-fp16-overflow")
    assert all(np.isfinite(h["val_loss"]) for h in summary["history"]), summary["history"]
    assert summary["final"]["val_acc"] >= 0.8, summary["history"]
    records = list(read_log(batches[3].run("gem-fp16-overflow"), "train"))
    skipped = [r["values"]["fp16_skipped"] for r in records if r["role"] == "worker"]
    scales = [r["values"]["loss_scale"] for r in records if r["role"] == "worker"]
    assert max(skipped) > 0 and min(scales) < 2.0**16, (skipped, scales)


# ---------------------------------------------------------------------- compression
@pytest.mark.timeout(900)
@pytest.mark.parametrize("n, name", [(n, name) for n, runs in COMPRESSED_RUNS.items() for name in runs])
def test_compression_learns_digits_and_counts_its_bytes(batches, n, name):
    summary = batches[n].summary(name)
    assert summary["final"]["val_acc"] >= ACCURACY, f"{name}: {summary['history']}"
    run = batches[n].run(name)
    sent = Counter()
    for record in read_log(run, "train"):
        sent[record["rank"]] += record["values"]["bytes_sent"]
    # What one allreduce step puts on the wire per rank, for the MLP's 4810 gradient floats
    # (one bucket): fp16/bf16 two to a word; topk(0.1) 481 values and 481 indices;
    # powersgd(2) the biases (74 floats), P and Q of the 10x64 and 64x64 weights (20 + 128,
    # 128 + 128). An allreduce rank takes ceil(1437 / (3 * 32)) = 15 steps an epoch.
    per_step = {"fp16": 4 * 2405, "bf16": 4 * 2405, "topk": 4 * 962, "powersgd": 4 * (74 + 148 + 256)}
    if name.startswith("allreduce"):
        codec = name.split("-")[1]
        assert set(sent.values()) == {EPOCHS * 15 * per_step[codec]}, (sent, per_step[codec])
    else:
        assert all(v > 0 for v in sent.values()) and len(sent) == n - 1, sent


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["allreduce", "downpour-sync"])
def test_compression_none_is_todays_run_bit_for_bit(batches, name):
    plain = load_file(str(batches[RESUME_RANKS].run(f"{name}-A") / "final" / "model.safetensors"))
    none = load_file(str(batches[RESUME_RANKS].run(f"{name}-none") / "final" / "model.safetensors"))
    assert set(plain) == set(none)
    for key in plain:
        assert np.array_equal(plain[key], none[key]), key


# ------------------------------------------------------------ validation every N samples
def _sample_validations(run: Path) -> list[dict]:
    return [r["values"] for r in read_log(run, "val")]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("n", [3, 5])
def test_validations_every_n_samples_in_allreduce(batches, n):
    """Every rank knows the global count at each step, so the validation falls at the step
    that passes each multiple of N: within one step, BATCH samples per rank, after it."""
    run = batches[n].run("allreduce")
    points = _sample_validations(run)
    total = EPOCHS * DIGITS_TRAIN
    assert len(points) == total // EVERY_SAMPLES
    for k, point in enumerate(points, start=1):
        assert 0 <= point["samples_seen"] - k * EVERY_SAMPLES < BATCH * n, (k, point)
    _check_values(points)
    # The epoch records carry the samples seen so far, exact in a synchronous run.
    history = batches[n].summary("allreduce")["history"]
    assert [h["samples_seen"] for h in history] == [DIGITS_TRAIN * e for e in range(1, EPOCHS + 1)]
    _check_curve(run, points, history)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("n", [3, 5])
def test_validations_every_n_samples_at_an_asynchronous_master(batches, n):
    """The master validates a copy of the centre in the background, each time the samples
    of the updates it applied pass another multiple of N, at the end of that turn of its
    loop (up to one update per worker: BATCH samples each with downpour). A mark passed while
    the previous validation still runs is validated when that one ends, at the count then:
    never two points in one interval of N, and none before its mark."""
    run = batches[n].run("downpour")
    points = _sample_validations(run)
    total = EPOCHS * DIGITS_TRAIN
    assert points, "no validation every N samples"
    intervals = [p["samples_seen"] // EVERY_SAMPLES for p in points]
    assert intervals == sorted(set(intervals)) and intervals[0] >= 1, intervals
    assert points[-1]["samples_seen"] <= total
    # Each is of the centre at the version it names, later versions for later points.
    assert [p["version"] for p in points] == sorted({p["version"] for p in points})
    _check_values(points)
    history = batches[n].summary("downpour")["history"]
    seen = [h["samples_seen"] for h in history]
    assert seen == sorted(seen) and seen[-1] == total, seen
    _check_curve(run, points, history)


def _check_values(points: list[dict]) -> None:
    assert all(np.isfinite(p["val_loss"]) and p["val_loss"] > 0 for p in points), points
    assert all(0.0 <= p["val_acc"] <= 1.0 for p in points), points
    assert max(p["val_acc"] for p in points) >= ACCURACY - 0.05, points  # it learns, and they show it


def _check_curve(run: Path, points: list[dict], history: list[dict]) -> None:
    """The reader merges both kinds of validation points by samples seen."""
    from nbdist.metrics import samples_to_reach, validation_curve

    curve = validation_curve(run)
    samples = [s for s, _ in curve]
    assert samples == sorted(set(samples))
    assert {p["samples_seen"] for p in points} | {h["samples_seen"] for h in history} == set(samples)
    reached = samples_to_reach(curve, 0.5)
    assert reached is not None and reached <= history[-1]["samples_seen"]
    assert all(v < 0.5 for s, v in curve if s < reached)


# ------------------------------------------------------------------------ staleness
def _updates(run: Path) -> list[dict]:
    return sorted((r["values"] for r in read_log(run, "update")), key=lambda v: v["version"])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["downpour-sync", "easgd-sync"])
def test_synchronous_updates_are_never_stale(batches, name):
    updates = _updates(batches[5].run(name))
    assert updates, "no update records"
    assert {u["staleness"] for u in updates} == {0}
    assert {u["source_rank"] for u in updates} == {1, 2, 3, 4}
    # A synchronous round applies one update from each of the 4 workers at one version.
    per_version = Counter(u["version"] for u in updates)
    assert set(per_version.values()) == {4}, per_version.most_common(3)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["downpour", "gem", "easgd", "adag"])
def test_asynchronous_updates_are_stale_and_every_worker_is_served(batches, name):
    updates = _updates(batches[5].run(name))
    assert updates, "no update records"
    staleness = [u["staleness"] for u in updates]
    assert max(staleness) > 0, "4 asynchronous workers and never a stale update"
    assert min(staleness) >= 0
    # One update per version, versions 1..N with no gap.
    assert [u["version"] for u in updates] == list(range(1, len(updates) + 1))
    workers = {1, 2, 3, 4}
    assert {u["source_rank"] for u in updates} == workers
    # Fair service: each worker gets a share of the updates while all four are training,
    # not only once the others have finished (the first half of the run).
    first_half = Counter(u["source_rank"] for u in updates[: len(updates) // 2])
    for rank in workers:
        assert first_half[rank] >= 0.10 * (len(updates) // 2), (name, first_half)
    # The epoch records carry the staleness summary.
    history = batches[5].summary(name)["history"]
    assert max(h["staleness_max"] for h in history) == max(staleness)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["downpour", "easgd-sync"])
def test_the_masters_update_summaries_count_every_traced_update(batches, name):
    """The 'updates' summary of each interval holds exactly the updates traced in it."""
    run = batches[5].run(name)
    traced = Counter((u["source_rank"], u["staleness"]) for u in _updates(run))
    summaries = [r["values"] for r in read_log(run, "updates")]
    summed = Counter()
    for v in summaries:
        summed.update({(rank, s): c for rank, s, c in v["histogram"]})
    assert summed == traced
    assert summaries[-1]["version"] == max(u["version"] for u in _updates(run))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", ["downpour", "gem", "easgd", "adag"])
def test_staleness_is_counted_as_each_update_of_a_batch_is_applied(batches, name):
    """The master applies the updates of one pass (those found ready, up to the bodies its
    pool holds, roles/master/run.py ASYNC_BODIES; the others are served first at the next
    pass) one after the other, each at its own version, and answers them after the batch:
    every reply carries the version at the batch's end. So a worker's next update, computed from that reply,
    says where the batch of its previous update ended (version - 1 - staleness when
    staleness is counted as the update is applied). The update right after a worker's in
    the same batch is applied one version later: it is at least 1 stale."""
    updates = _updates(batches[5].run(name))
    by_worker: dict[int, list[dict]] = {}
    for u in updates:
        by_worker.setdefault(u["source_rank"], []).append(u)
    at_version = {u["version"]: u for u in updates}
    batched = 0
    for mine in by_worker.values():
        # The first update of each worker was computed from the initial weights (version 0).
        assert mine[0]["version"] - 1 - mine[0]["staleness"] == 0, mine[0]
        for previous, update in pairwise(mine):
            batch_end = update["version"] - 1 - update["staleness"]
            assert batch_end >= previous["version"], (previous, update)
            if batch_end > previous["version"]:
                batched += 1
                second = at_version[previous["version"] + 1]
                assert second["staleness"] >= 1, (previous, second)
    # 4 workers on 5 ranks of a small box: the master often finds several messages ready.
    assert batched > 0, "no batch of two or more updates in the whole run"


# ---------------------------------------------------------------- stopping decisions
@pytest.mark.timeout(900)
def test_target_stops_the_run_early(batches):
    summary = batches[3].summary("target")
    assert "target" in summary["stop_reason"] and "val_acc > 0.5" in summary["stop_reason"]
    assert summary["epochs_run"] <= 5
    assert summary["final"]["val_acc"] > 0.5
    # Each earlier epoch was still below the target.
    assert all(h["val_acc"] <= 0.5 for h in summary["history"][:-1])


@pytest.mark.timeout(900)
def test_early_stopping_with_a_tiny_learning_rate(batches):
    summary = batches[3].summary("early-stopping")
    assert "early stopping" in summary["stop_reason"], summary["stop_reason"]
    assert summary["epochs_run"] == 2, summary["history"]
    # The decision is checkpointed, so the run can be picked up again.
    latest = json.loads((batches[3].run("early-stopping") / "checkpoints" / "LATEST.json").read_text())
    assert latest["label"] == "epoch-0002"


# -------------------------------------------------------------- resume, checkpoints
@pytest.fixture(scope="module")
def resumed(batches):
    """Run A: 4 epochs at once; run B: 2 epochs (both in the -n 3 job), then B resumed to
    4 epochs in a new job, i.e. by other processes than the ones that checkpointed it
    (and the -n 3 job's stopped master/worker run, for one more epoch)."""
    first = batches[RESUME_RANKS]
    second = {f"{name}-B": ["--resume", str(first.runs_dir / f"{name}-B"), "--epochs", "4"] for name in RESUME_CONFIGS}
    truncated = first.run("allreduce-C") / TRUNCATED
    truncated.write_bytes(truncated.read_bytes()[:100])
    second["allreduce-C"] = ["--resume", str(first.runs_dir / "allreduce-C"), "--epochs", "4"]
    # The master/worker run that the -n 3 job stopped by signal, for one more epoch.
    stopped = json.loads((first.runs_dir / "stopped" / "stop-master-worker" / "summary.json").read_text())
    second["stop-master-worker"] = [
        "--resume",
        str(first.runs_dir / "stop-master-worker"),
        "--epochs",
        str(stopped["epochs_run"] + 1),
    ]
    # --runs-dir/--run-name are ignored by a resume (it continues in its own directory).
    done, codes = _run_batch(RESUME_RANKS, second, first.runs_dir / "unused", timeout=300, quiet=False)
    return first, Batch(done, codes, first.runs_dir)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(RESUME_CONFIGS))
def _assert_same_run(a: Path, b: Path) -> None:
    """Run b, stopped and resumed, ended where the straight run a did."""
    weights_a = load_file(str(a / "final" / "model.safetensors"))
    weights_b = load_file(str(b / "final" / "model.safetensors"))
    assert set(weights_a) == set(weights_b)
    for key in weights_a:
        diff = float(np.max(np.abs(weights_a[key] - weights_b[key])))
        assert diff <= 1e-6, f"{key}: resumed run differs from the straight run by {diff:g}"
    summary_a = json.loads((a / "summary.json").read_text())
    summary_b = json.loads((b / "summary.json").read_text())
    assert summary_b["epochs_run"] == 4
    assert [h["epoch"] for h in summary_b["history"]] == [1, 2, 3, 4]
    # The same run, so the same validation curve, epoch by epoch.
    np.testing.assert_allclose(
        [h["val_loss"] for h in summary_b["history"]], [h["val_loss"] for h in summary_a["history"]], rtol=1e-6
    )
    assert summary_b["stop_reason"] == "completed 4 epochs"
    # The samples seen went on from the checkpoint's count (these runs are synchronous: exact).
    assert [h["samples_seen"] for h in summary_b["history"]] == [h["samples_seen"] for h in summary_a["history"]]
    # The history each checkpoint refers to, stored once: each epoch once.
    assert [json.loads(line) for line in (b / "history.jsonl").read_text().splitlines()] == summary_b["history"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(RESUME_CONFIGS))
def test_resume_continues_exactly(resumed, name):
    first, second = resumed
    a = first.run(f"{name}-A")
    second.run(f"{name}-B")  # the resume itself succeeded
    b = first.runs_dir / f"{name}-B"
    _assert_same_run(a, b)
    # The resume says where it picked up.
    assert re.search(rf"resumed from \S*/{name}-B/checkpoints/epoch-0002 at epoch 3\b", second.done.stdout), (
        second.done.stdout
    )
    # The resumed part logged epochs 3 and 4 only (appended to the first part's log).
    epochs = [r["epoch"] for r in read_log(b, "epoch")]
    assert epochs == [1, 2, 3, 4], epochs
    latest = json.loads((b / "checkpoints" / "LATEST.json").read_text())
    assert latest["label"] == "epoch-0004"


# The lr each epoch of those runs ends with, written out: with 3 ranks, 2 workers under a
# master and 3 allreduce ranks. Warm-up starts at the unscaled lr and reaches the scaled
# one after E epochs; the schedule (StepLR, cosine annealing) multiplies per epoch.
def _downpour_lr(e: int) -> float:
    return 0.1 * 0.7**e * 2 * (0.5 + 0.5 * min(1.0, (e + 1) / 3))


def _allreduce_lr(e: int) -> float:
    scale = 3**0.5
    default_lr = parse_spec(DEFAULT_WORKER_OPTIMIZER).kwargs["lr"]  # allreduce-lr gives no optimiser
    return (
        default_lr * (1 + np.cos(np.pi * e / 4)) / 2 * scale * (1 / scale + (1 - 1 / scale) * min(1.0, (e + 1) / 2.5))
    )


LR_CONFIGS = {"downpour-sync-lr": ("master_lr", _downpour_lr), "allreduce-lr": ("worker_lr", _allreduce_lr)}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(LR_CONFIGS))
def test_the_recorded_lr_follows_warmup_scaling_and_schedule(resumed, name):
    first, _ = resumed
    key, expected = LR_CONFIGS[name]
    for run in (f"{name}-A", f"{name}-B"):  # straight, and stopped after 2 epochs then resumed
        records = list(read_log(first.runs_dir / run, "epoch"))
        assert [r["epoch"] for r in records] == [1, 2, 3, 4]
        np.testing.assert_allclose(
            [r["values"][key] for r in records], [expected(e) for e in range(4)], rtol=1e-6, err_msg=run
        )
        # Downpour's workers (--sync-every 1) take no steps of their own.
        assert "worker_lr" not in records[0]["values"] or key == "worker_lr"


@pytest.mark.timeout(900)
def test_resume_falls_back_from_a_truncated_checkpoint(resumed):
    first, second = resumed
    second.run("allreduce-C")
    c = first.runs_dir / "allreduce-C"
    damaged = c / "checkpoints" / "epoch-0002"
    output = second.done.output
    warnings = [line for line in output.splitlines() if "damaged" in line]
    assert len(warnings) == 1, output  # one line, from one rank
    assert re.fullmatch(
        rf"nbdist: warning: checkpoint {re.escape(str(damaged))} is damaged: rank-00000.safetensors "
        rf"is truncated \(100 of \d+ bytes\); resuming from epoch-0001",
        warnings[0],
    ), warnings
    assert "Traceback" not in output
    assert re.search(r"resumed from \S*/allreduce-C/checkpoints/epoch-0001 at epoch 2\b", second.done.stdout), output
    _assert_same_run(first.run("allreduce-A"), c)
    assert Checkpoints(c).latest_intact() == (c / "checkpoints" / "epoch-0004", [])


def _check_checkpoint_dir(path: Path, ranks: int, twins: dict[int, int] | None = None) -> None:
    """A committed checkpoint of `ranks` ranks, intact; `twins` (rank -> owner): the ranks
    that hold the owner's copy of the weights and write only their own arrays."""
    meta = json.loads((path / "meta.json").read_text())
    assert meta["label"] == path.name
    files = sorted(p.name for p in path.iterdir())
    # Safetensors and JSON only: nothing that needs pickle to load.
    assert all(f.endswith((".safetensors", ".json")) for f in files), files
    assert sorted(meta["files"]) == [f for f in files if f != "meta.json"]
    assert Checkpoints.damage(path) is None
    twins = twins or {}
    for rank in range(ranks):
        arrays, rank_meta = Checkpoints.read_rank(path, rank)
        assert arrays["model"]["params"].dtype == np.float32
        assert rank_meta["rank"] == rank and "history" not in rank_meta
        stored = load_file(str(path / f"rank-{rank:05d}.safetensors"))
        assert "rng/torch_cpu" in stored
        if rank in twins:
            owner = load_file(str(path / f"rank-{twins[rank]:05d}.safetensors"))
            assert "model/params" not in stored
            np.testing.assert_array_equal(arrays["model"]["params"], owner["model/params"])
        else:
            assert "model/params" in stored


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(RESUME_CONFIGS))
def test_checkpoint_every_epoch(resumed, name):
    first, _ = resumed
    root = first.run(f"{name}-A") / "checkpoints"
    labels = sorted(p.name for p in root.iterdir() if p.is_dir())
    # --keep-checkpoints 3 (the default) deleted the first.
    assert labels == ["epoch-0002", "epoch-0003", "epoch-0004"], labels
    assert not list(root.glob(".*")), "an uncommitted or deleted checkpoint directory was left behind"
    assert json.loads((root / "LATEST.json").read_text())["label"] == "epoch-0004"
    twins = ALLREDUCE_TWINS[RESUME_RANKS] if name.startswith("allreduce") else None
    for label in labels:
        _check_checkpoint_dir(root / label, RESUME_RANKS, twins)
    # The last epoch checkpoint holds the weights that were written out as final (the
    # centre on the master, the replica on rank 0 of allreduce).
    final = load_file(str(first.run(f"{name}-A") / "final" / "model.safetensors"))
    saved = load_file(str(root / "epoch-0004" / "rank-00000.safetensors"))["model/params"]
    # The flat buffer holds the parameters in reverse registration order.
    flat = np.concatenate([final[k].ravel() for k in ("2.bias", "2.weight", "0.bias", "0.weight")])
    assert np.array_equal(saved, flat)


# -------------------------------------------------------------------- graceful stop
@pytest.mark.timeout(900)
def test_an_asynchronous_master_serves_its_workers_while_it_validates_a_checkpointed_epoch(batches):
    """Each epoch is validated in the background and checkpointed (the default): the
    master used to wait for that validation before writing its share of the snapshot,
    and every worker waited with it. The model's validation sleeps 0.5 s (its training
    steps 0.02 s, so epochs outlast validations): updates must go on being applied in the
    0.4 s before each of the first two epochs' validations ended (the epoch record).
    (A run of the -n 3 job: 1 master, 2 workers.)"""
    run = batches[3].run("slow-validation")
    applied = [r["time"] for r in read_log(run, "update")]
    validated = sorted(r["time"] for r in read_log(run, "epoch"))
    assert len(validated) == 3 and applied
    for end in validated[:2]:
        during = [t for t in applied if end - 0.4 <= t <= end]
        assert during, f"no update applied in the 0.4 s before the validation that ended at {end}"
    assert json.loads((run / "checkpoints" / "LATEST.json").read_text())["label"] == "epoch-0003"


@pytest.mark.timeout(300)
def test_a_stop_while_the_ranks_start_is_kept_and_checkpointed(tmp_path):
    # SLURM's --signal can come at any time, even while the job is still starting: it
    # used to kill the ranks before they caught it, and the job ended "completed" with no run.
    argv = [
        sys.executable,
        "-m",
        "nbdist",
        "launch",
        "-n",
        "3",
        "train",
        "--model",
        MLP,
        "--epochs",
        "50",
        "--runs-dir",
        str(tmp_path),
        "--run-name",
        "run",
        "--quiet",
    ]
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        # The launcher has started prterun (so it catches the signal); its ranks are still
        # importing. A fixed sleep raced the launcher's own imports on a busy machine.
        launcher = psutil.Process(proc.pid)
        deadline = time.monotonic() + 60
        while not launcher.children() and proc.poll() is None:
            assert time.monotonic() < deadline, "the launcher started no job within 60 s"
            time.sleep(0.02)
        proc.send_signal(signal.SIGUSR1)
        output, _ = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == 0, output
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stop_reason"] == "stopped by SIGUSR1", summary["stop_reason"]
    latest = json.loads((tmp_path / "run" / "checkpoints" / "LATEST.json").read_text())["label"]
    assert latest.startswith("stopped-"), latest


@pytest.mark.timeout(900)
@pytest.mark.parametrize("topology", ["master-worker", "allreduce"])
def test_sigusr1_stops_every_rank_and_checkpoints(resumed, topology):
    """A run of the -n 3 job, stopped by SIGUSR1 to `mpiexec` once it logged an epoch (as
    it was then: the copy in `stopped/`); the master/worker one resumed by the next job."""
    first, second = resumed
    name = f"stop-{topology}"
    ranks = RESUME_RANKS
    first.run(name)  # exit status 0 on rank 0...
    assert first.returncode == 0, first.output[-6000:]  # ...and on every rank (the job's worst)
    run_dir = first.runs_dir / "stopped" / name
    output = first.output_of(name)
    assert "Traceback" not in output, output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "stopped" in summary["stop_reason"], summary["stop_reason"]
    assert 1 <= summary["epochs_run"] < STOP_EPOCHS
    root = run_dir / "checkpoints"
    latest = json.loads((root / "LATEST.json").read_text())["label"]
    assert latest.startswith("stopped-"), latest
    _check_checkpoint_dir(root / latest, ranks, ALLREDUCE_TWINS[ranks] if topology == "allreduce" else None)
    assert not list(root.glob(".tmp-*"))
    # Every rank logged that the run stopped.
    statuses = {r["rank"]: r["values"].get("status") for r in read_log(run_dir, "run")}
    if topology == "allreduce":
        assert statuses == dict.fromkeys(range(ranks), "stopped"), statuses
    else:
        assert statuses.get(0) == "stopped", statuses

    if topology == "allreduce":
        return  # (its stop checkpoint is a synchronous cut; test_resume covers its resume)
    # The stop checkpoint holds everything needed to go on, including the tallies of the
    # epochs the workers were in: the `resumed` job resumed it for one more epoch.
    epochs = summary["epochs_run"] + 1
    second.run(name)  # exit status 0
    root = first.runs_dir / name / "checkpoints"
    assert f"resumed from {root / latest} at epoch" in second.done.stdout, second.done.output
    resumed_summary = json.loads((first.runs_dir / name / "summary.json").read_text())
    context = (
        f"stopped run: {summary['stop_reason']}, epochs {[h['epoch'] for h in summary['history']]}\n"
        f"resumed run: {resumed_summary['stop_reason']}, epochs {[h['epoch'] for h in resumed_summary['history']]}\n"
        f"{second.output_of(name)}"
    )
    assert resumed_summary["stop_reason"] == f"completed {epochs} epochs", context
    assert [h["epoch"] for h in resumed_summary["history"]] == list(range(1, epochs + 1)), context
    # The history before the stop is kept as it was...
    assert [h["val_loss"] for h in resumed_summary["history"][:-1]] == [h["val_loss"] for h in summary["history"]]
    # ...and training went on from the stopped weights, not from scratch (a fresh start
    # would have the first epoch's training loss again, about 2.2).
    assert resumed_summary["history"][-1]["train_loss"] < summary["history"][0]["train_loss"] - 0.2, context
