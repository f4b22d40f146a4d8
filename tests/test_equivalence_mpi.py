"""Equivalences on real MPI ranks (docs/explanation/architecture.md, section 7).

- allreduce over 2 and 4 ranks == one process on the concatenated batch (also when the
  ranks' batch sizes differ by one), through nbdist's own MpiReducer (several
  buckets), sample shares and flat optimiser;
- the device path (--device cpu: torch tensors as the buffers, through the array-API rules
  and the transport's staging, as on a GPU) == the numpy path to 1e-6, for allreduce and
  for the master/worker runs below, a BatchNorm model's state included (initial
  broadcasts, validation, a worker of 2 processes), and after a resume from a checkpoint;
- synchronised BatchNorm (--sync-batchnorm) over 4 ranks of different batch sizes == one
  process on the concatenated batch: outputs, input and parameter gradients, running
  statistics (BatchNorm1d/2d/3d, momentum None, no affine parameters);
- the allreduce topology's buckets on a torch.distributed gloo group made from the MPI
  ranks (--allreduce-backend gloo, the code NCCL runs on GPUs) == the MPI path to 1e-6;
- the same weights as PyTorch DistributedDataParallel on gloo;
- Downpour with one worker and sync_every=1 == plain SGD on the same batch order;
- asynchronous DiLoCo with one worker == windows of H SGD steps, each followed by the
  outer Nesterov step on its pseudo-gradient;
- EASGD with elastic_force=0 leaves the centre where it started;
- a synchronous round of GEM, ADAG or DynSGD over 4 workers is one step on the
  sample-weighted mean of their updates: with updates -lr * g_i (GEM with pi = 1, ADAG's
  workers one plain SGD step), that is SGD on the concatenated batch, not W steps.

The single-process references are plain torch in this process; the model, data, seed
and batches come from tests/mpi_scripts/equivalence_common.py, which the MPI scripts use.
Every MPI part runs in ONE 5-rank job (tests/mpi_scripts/equivalence_job.py): starting
Python and torch on each rank costs more than all of their training.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from torch import nn

SCRIPTS = Path(__file__).resolve().parent / "mpi_scripts"
sys.path.insert(0, str(SCRIPTS))

import equivalence_common as common  # noqa: E402

from nbdist.data.sharding import ShardPlan  # noqa: E402
from nbdist.metrics import read_log  # noqa: E402

pytestmark = pytest.mark.mpi

STEPS = 12
TOL = 1e-5


def assert_weights_close(actual: dict, expected: dict, tol: float = TOL) -> None:
    assert set(actual) == set(expected), (sorted(actual), sorted(expected))
    for name in expected:
        assert actual[name].shape == expected[name].shape, name
        diff = float(np.max(np.abs(actual[name] - expected[name])))
        assert diff <= tol, f"{name}: max abs difference {diff:.3g} > {tol:g}"


def state_dict_arrays(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def moved(a: dict, b: dict) -> float:
    return max(float(np.max(np.abs(a[k] - b[k]))) for k in a)


@pytest.fixture(scope="module")
def allreduce_weights(job):
    """Directory with <ranks>-<layout>.safetensors for 4 and 2 ranks (the job's first 4
    ranks; the 2-rank runs use pairs of them), syncbn-*.safetensors, ddp.safetensors and
    the job's stdout.txt."""
    return job[0]


@pytest.fixture(scope="module")
def api_runs(job):
    return job[1]


@pytest.mark.timeout(420)
@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("layout", ["equal", "unequal"])
def test_allreduce_equals_one_process_on_the_concatenated_batch(allreduce_weights, ranks, layout):
    got = load_file(str(allreduce_weights / f"{ranks}-{layout}.safetensors"))
    expected = common.reference_weights(STEPS, ranks, unequal=layout == "unequal")
    # The comparison means something only if training moved the weights a lot more than TOL.
    assert moved(expected, state_dict_arrays(common.initial_model())) > 0.1
    assert_weights_close(got, expected)


def test_an_fp16_overflow_on_one_rank_is_skipped_by_every_rank(allreduce_weights):
    """fp16 on 4 allreduce ranks, one of whose gradients overflows once: the job checks
    that all ranks skipped the same step, hold the same halved loss scale and the same
    weights (allreduce_equivalence.py's last phase)."""
    done = (allreduce_weights / "stdout.txt").read_text()
    assert f"OK fp16-overflow skipped=1 scale={2**15}" in done, done


@pytest.mark.parametrize("ranks", [2, 4])
def test_allreduce_on_torch_tensors_equals_the_numpy_path(allreduce_weights, ranks):
    on_host = load_file(str(allreduce_weights / f"{ranks}-equal.safetensors"))
    assert_weights_close(load_file(str(allreduce_weights / f"{ranks}-device.safetensors")), on_host, tol=1e-6)


@pytest.mark.parametrize("name", list(common.sync_bn_layers()))
def test_synchronised_batchnorm_over_4_ranks_equals_one_process_on_the_concatenated_batch(allreduce_weights, name):
    """--sync-batchnorm's layers over 4 ranks of 3 to 6 samples each == plain torch
    BatchNorm on the 18 samples: outputs, input and parameter gradients at each step, and
    the running statistics after them (allreduce_equivalence.py's syncbn phase, which also
    checks that every rank ends with the same statistics)."""
    got = load_file(str(allreduce_weights / f"syncbn-{name}.safetensors"))
    layer, shape = common.sync_bn_layers()[name]
    for step in range(common.SYNC_BN_STEPS):
        x, g = (torch.from_numpy(a) for a in common.sync_bn_batches(shape, step))
        x.requires_grad_()
        layer.zero_grad()
        out = layer(x)
        (out * g).sum().backward()
        expected = {f"out-{step}": out.detach().numpy(), f"dx-{step}": x.grad.numpy()}
        if layer.affine:  # the backend's flat gradient: parameters in reverse order
            expected[f"grads-{step}"] = np.concatenate([p.grad.numpy().ravel() for p in [layer.bias, layer.weight]])
        _assert_relatively_close(got, expected)
    state = {f"0.{k}": v.numpy() for k, v in layer.state_dict().items() if k.startswith(("running", "num"))}
    assert int(got["0.num_batches_tracked"]) == common.SYNC_BN_STEPS
    _assert_relatively_close(got, state)
    # The global statistics, not one rank's: rank 0's rows alone normalise differently.
    alone = layer(x.detach()[: common.SYNC_BN_SIZES[0]]).detach().numpy()
    assert np.abs(alone - got[f"out-{common.SYNC_BN_STEPS - 1}"][: common.SYNC_BN_SIZES[0]]).max() > 0.1


def _assert_relatively_close(got: dict, expected: dict, tol: float = TOL) -> None:
    """To `tol` relative to the size of each value, at least 1 (a parameter gradient sums
    hundreds of float32 terms of about 40)."""
    for name, want in expected.items():
        diff = np.abs(got[name].astype(np.float64) - want) / np.maximum(1.0, np.abs(want))
        assert diff.max() <= tol, f"{name}: max relative difference {diff.max():.3g} > {tol:g}"


@pytest.mark.timeout(420)
def test_allreduce_matches_pytorch_ddp_on_gloo(allreduce_weights):
    """PyTorch's DDP on a gloo group of 2 processes (ranks 0 and 1 of the allreduce job,
    after its own phases: ddp_reference.py) against nbdist's 2-rank allreduce."""
    assert "OK ddp" in (allreduce_weights / "stdout.txt").read_text()
    ddp = load_file(str(allreduce_weights / "ddp.safetensors"))
    ours = load_file(str(allreduce_weights / "2-equal.safetensors"))
    assert moved(ddp, state_dict_arrays(common.initial_model())) > 0.1
    assert_weights_close(ours, ddp)


# ----------------------------------------------------------------------- nbdist.train
API_EPOCHS, API_BATCH, API_SEED = 3, 16, 3
DOWNPOUR_RUNS = {
    "downpour-sync": dict(synchronous=True, master_optimizer=common.OPTIMIZER),
    "downpour-async": dict(master_optimizer=common.OPTIMIZER),
    "downpour-async-plain": dict(master_optimizer=f"sgd(lr={common.LR})"),
}
EASGD_RUNS = {"easgd-async": dict(), "easgd-sync": dict(synchronous=True)}
# 1 master + 4 workers, synchronous, one batch per round. GEM's pi is pinned to 1 (pi_max 1,
# kappa so large that the clip always bites, no proxy momentum), so each worker sends
# -lr * g_i; ADAG's and DynSGD's workers take one plain SGD step and send the same.
# 97 samples: the shards' batches differ by one sample, so the round's mean must be
# sample-weighted to equal the concatenated batch.
ROUND_WORKERS, ROUND_TRAIN = 4, 97
ROUND_RUNS = {
    "gem-sync": dict(algorithm=f"gem(lr={common.LR}, momentum=0.0, kappa=1e9, pi_max=1.0)"),
    "adag-sync": dict(algorithm="adag", worker_optimizer=f"sgd(lr={common.LR})"),
    "dynsgd-sync": dict(algorithm="dynsgd", worker_optimizer=f"sgd(lr={common.LR})"),
}


# Asynchronous DiLoCo with one worker (1 master + 1 worker): windows of H plain SGD steps,
# each followed by the outer Nesterov step on its pseudo-gradient (6 batches an epoch: a
# window of 4, then one of 2 cut by the epoch's end).
DILOCO_H, DILOCO_OUTER_LR, DILOCO_MU = 4, 0.7, 0.9
DILOCO_RUNS = {
    "diloco-async-one-worker": dict(
        algorithm=f"diloco(inner_steps={DILOCO_H}, outer_lr={DILOCO_OUTER_LR}, outer_momentum={DILOCO_MU})",
        worker_optimizer=f"sgd(lr={common.LR})",
    )
}


# Runs trained again with --device cpu (the rules and staging on torch tensors), each
# compared with its numpy run; EASGD with its elastic force, so that the centre moves.
# The BatchNorm runs carry a model state: broadcast at the start, sent to a master,
# averaged over allreduce ranks at validation, checkpointed.
BATCHNORM_RUNS = {
    "allreduce-bn": dict(ranks=3, topology="allreduce", worker_optimizer=common.OPTIMIZER),
    # 1 master + 2 workers of 2 processes each (their gradient allreduced between them).
    "procs2-bn": dict(
        ranks=5, algorithm="easgd", synchronous=True, workers=2, procs_per_worker=2, worker_optimizer=common.OPTIMIZER
    ),
}
# Allreduce runs whose buckets go through a torch.distributed gloo group made from the MPI
# ranks (the code NCCL runs on GPUs), each compared with the MPI run of the same name:
# numpy views on 2 ranks, and torch tensors with a BatchNorm state on 3. The job trains
# them one after the other in the same processes, each on a group of its own.
GLOO_COMPARED = {"allreduce-2-gloo": "allreduce-2", "allreduce-bn-gloo": "allreduce-bn"}
DEVICE_COMPARED = ("downpour-async", "easgd-elastic-sync", "gem-sync", "adag-sync", "dynsgd-sync", *BATCHNORM_RUNS)
# Runs trained with --device cpu for API_EPOCHS - 1 epochs, then resumed from their last
# checkpoint for the last one, each compared with its straight numpy run.
DEVICE_RESUMED = ("downpour-async", "allreduce-bn", "procs2-bn")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """One `mpiexec -n 5` job (equivalence_job.py): allreduce_equivalence.py on its first
    4 ranks, then the nbdist.train runs (api_train.py): the Downpour runs on 2 of the
    ranks (one master, one worker, through nbdist.train(comm=...)), the EASGD runs on 3
    (two workers), the synchronous rounds on all 5 (four workers). (the allreduce
    directory, the runs' directory)"""
    from conftest import run_mpi

    directory = tmp_path_factory.mktemp("allreduce")
    runs_dir = tmp_path_factory.mktemp("api")
    base = dict(
        topology="master-worker",
        epochs=API_EPOCHS,
        batch_size=API_BATCH,
        seed=API_SEED,
        runs_dir=str(runs_dir),
        quiet=True,
    )
    runs = [
        dict(base, run_name=name, ranks=2, algorithm="downpour", sync_every=1, **extra)
        for name, extra in DOWNPOUR_RUNS.items()
    ]
    runs += [
        dict(
            base,
            run_name=name,
            ranks=3,
            algorithm="easgd(elastic_force=0.0)",
            worker_optimizer=common.OPTIMIZER,
            **extra,
        )
        for name, extra in EASGD_RUNS.items()
    ]
    runs += [dict(base, run_name=name, ranks=2, **extra) for name, extra in DILOCO_RUNS.items()]
    runs += [
        dict(base, run_name=name, ranks=1 + ROUND_WORKERS, n_train=ROUND_TRAIN, synchronous=True, sync_every=1, **extra)
        for name, extra in ROUND_RUNS.items()
    ]
    runs.append(
        dict(
            base,
            run_name="easgd-elastic-sync",
            ranks=3,
            algorithm="easgd",
            synchronous=True,
            worker_optimizer=common.OPTIMIZER,
        )
    )
    runs += [dict(base, run_name=name, batchnorm=True, **extra) for name, extra in BATCHNORM_RUNS.items()]
    runs.append(dict(base, run_name="allreduce-2", ranks=2, topology="allreduce", worker_optimizer=common.OPTIMIZER))
    runs += [
        dict(
            next(r for r in runs if r["run_name"] == mpi),
            run_name=name,
            allreduce_backend="gloo",
            **({"device": "cpu"} if "bn" in name else {}),
        )
        for name, mpi in GLOO_COMPARED.items()
    ]
    runs += [
        dict(run, run_name=run["run_name"] + "-device", device="cpu")
        for run in runs
        if run["run_name"] in DEVICE_COMPARED
    ]
    halves = [
        dict(run, run_name=run["run_name"] + "-device-half", device="cpu", epochs=API_EPOCHS - 1)
        for run in runs
        if run["run_name"] in DEVICE_RESUMED
    ]
    runs += halves + [dict(run, epochs=API_EPOCHS, resume=str(runs_dir / run["run_name"])) for run in halves]
    spec = runs_dir / "runs.json"
    spec.write_text(json.dumps(runs))
    argv = [str(SCRIPTS / "equivalence_job.py"), str(directory), str(STEPS), str(spec)]
    done = run_mpi(1 + ROUND_WORKERS, argv, timeout=420)
    assert done.returncode == 0, done.output
    # 3 layouts on 4 and on 2 ranks, syncbn, fp16-overflow, ddp; then one per run.
    assert done.stdout.count("OK ") == 9 + len(runs), done.output
    (directory / "stdout.txt").write_text(done.stdout)
    return directory, runs_dir


def sgd_weights(*, workers: int = 1, n_train: int | None = None, momentum: float = 0.0) -> dict[str, np.ndarray]:
    """Single-process torch SGD, one step per round on the concatenation of the round's
    batches of every worker (the shards nbdist's workers train on, in their order); with
    one worker, the batches that worker sees."""
    data = common.make_data() if n_train is None else common.make_data(n_train)
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    model = common.initial_model(API_SEED)
    opt = torch.optim.SGD(model.parameters(), lr=common.LR, momentum=momentum)
    loss_fn = nn.CrossEntropyLoss()
    plan = ShardPlan(data.n_train, workers, API_BATCH, API_SEED)
    for epoch in range(API_EPOCHS):
        shards = [plan.epoch(epoch, w) for w in range(workers)]
        for step in range(plan.batches_per_epoch):
            batch = np.concatenate([shard[step] for shard in shards])
            opt.zero_grad()
            loss_fn(model(x[batch]), y[batch]).backward()
            opt.step()
    return state_dict_arrays(model)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(DOWNPOUR_RUNS))
def test_downpour_one_worker_is_plain_sgd(api_runs, name):
    momentum = 0.0 if name.endswith("plain") else common.MOMENTUM
    expected = sgd_weights(momentum=momentum)
    assert moved(expected, state_dict_arrays(common.initial_model(API_SEED))) > 0.1
    got = load_file(str(api_runs / name / "final" / "model.safetensors"))
    assert_weights_close(got, expected)
    summary = json.loads((api_runs / name / "summary.json").read_text())
    assert summary["epochs_run"] == API_EPOCHS
    # One worker: the master always answers before the next gradient, no staleness.
    assert all(h["staleness_max"] == 0 for h in summary["history"])


def diloco_weights(h: int, outer_lr: float, mu: float) -> dict[str, np.ndarray]:
    """Single-process torch, one worker: from the centre, h SGD steps on its batches (a
    window ends with its epoch), then the outer step on the pseudo-gradient
    delta = centre - weights, torch.optim.SGD(nesterov=True)'s: m <- mu m + delta,
    centre <- centre - outer_lr (delta + mu m); the next window starts from the centre."""
    data = common.make_data()
    x, y = torch.from_numpy(data.x_train), torch.from_numpy(data.y_train)
    model = common.initial_model(API_SEED)
    params = list(model.parameters())
    centre = [p.detach().clone() for p in params]
    momentum = [torch.zeros_like(p) for p in params]
    opt = torch.optim.SGD(params, lr=common.LR)
    loss_fn = nn.CrossEntropyLoss()
    plan = ShardPlan(data.n_train, 1, API_BATCH, API_SEED)
    for epoch in range(API_EPOCHS):
        batches = plan.epoch(epoch, 0)
        for start in range(0, len(batches), h):
            for batch in batches[start : start + h]:
                opt.zero_grad()
                loss_fn(model(x[batch]), y[batch]).backward()
                opt.step()
            with torch.no_grad():
                for p, c, m in zip(params, centre, momentum, strict=True):
                    delta = c - p
                    m.mul_(mu).add_(delta)
                    c.sub_(outer_lr * (delta + mu * m))
                    p.copy_(c)
    return state_dict_arrays(model)


@pytest.mark.timeout(400)
def test_asynchronous_diloco_with_one_worker_is_h_local_steps_then_the_outer_step(api_runs):
    (name,) = DILOCO_RUNS
    expected = diloco_weights(DILOCO_H, DILOCO_OUTER_LR, DILOCO_MU)
    assert moved(expected, state_dict_arrays(common.initial_model(API_SEED))) > 0.1
    # Plain SGD on the same batches ends elsewhere: the outer step is what is compared.
    assert moved(expected, sgd_weights()) > 0.01
    got = load_file(str(api_runs / name / "final" / "model.safetensors"))
    assert_weights_close(got, expected)
    summary = json.loads((api_runs / name / "summary.json").read_text())
    assert summary["epochs_run"] == API_EPOCHS


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(EASGD_RUNS))
def test_easgd_zero_elastic_force_leaves_the_centre_unchanged(api_runs, name):
    initial = state_dict_arrays(common.initial_model(API_SEED))
    got = load_file(str(api_runs / name / "final" / "model.safetensors"))
    assert set(got) == set(initial)
    for key in initial:
        assert np.array_equal(got[key], initial[key]), f"{name}: the centre moved ({key})"
    history = json.loads((api_runs / name / "summary.json").read_text())["history"]
    assert len(history) == API_EPOCHS
    # The centre (validated by the master) never moves...
    assert len({h["val_loss"] for h in history}) == 1, history
    # ...while the two workers, free of the centre, do learn.
    assert history[-1]["train_loss"] < history[0]["train_loss"] - 0.05, history


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(ROUND_RUNS))
def test_a_synchronous_round_is_one_step_on_the_mean(api_runs, name):
    plan = ShardPlan(ROUND_TRAIN, ROUND_WORKERS, API_BATCH, API_SEED)
    for epoch in range(API_EPOCHS):  # unequal batches: the weighting by samples matters
        assert len(set(plan.step_sizes(epoch).ravel())) > 1
    expected = sgd_weights(workers=ROUND_WORKERS, n_train=ROUND_TRAIN)
    initial = state_dict_arrays(common.initial_model(API_SEED))
    assert moved(expected, initial) > 0.05
    got = load_file(str(api_runs / name / "final" / "model.safetensors"))
    assert_weights_close(got, expected)
    summary = json.loads((api_runs / name / "summary.json").read_text())
    assert summary["epochs_run"] == API_EPOCHS
    assert all(h["samples"] == ROUND_TRAIN for h in summary["history"])


def assert_same_run_as_on_the_host(name: str, run: Path, resumed: bool = False) -> None:
    """`run` (on --device cpu) ended with the weights, model state and validation curve
    of the numpy run `name` (to 1e-6), and the weights moved."""
    host = run.parent / name
    on_host = load_file(str(host / "final" / "model.safetensors"))
    torch.manual_seed(API_SEED)
    initial = state_dict_arrays(common.build_batchnorm_model() if name in BATCHNORM_RUNS else common.build_model())
    assert moved(on_host, initial) > 0.05
    assert json.loads((run / "options.json").read_text())["device"] == "cpu"
    got = load_file(str(run / "final" / "model.safetensors"))
    # BatchNorm's integer batch counter is no float state: checkpoints do not hold it (on
    # the numpy path neither), so a resumed run counts from zero again.
    counters = {k for k in on_host if k.endswith("num_batches_tracked")}
    assert_weights_close(
        {k: v for k, v in got.items() if k not in counters},
        {k: v for k, v in on_host.items() if k not in counters},
        tol=1e-6,
    )
    history, expected = (
        {h["epoch"]: h["val_loss"] for h in json.loads((r / "summary.json").read_text())["history"]}
        for r in (run, host)
    )
    # A resumed run's history holds every epoch, the ones before its checkpoint too.
    assert set(history) == set(expected) == set(range(1, API_EPOCHS + 1)), (sorted(history), resumed)
    np.testing.assert_allclose([history[e] for e in history], [expected[e] for e in history], rtol=1e-6)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", DEVICE_COMPARED)
def test_runs_on_torch_tensors_equal_the_numpy_path(api_runs, name):
    assert_same_run_as_on_the_host(name, api_runs / f"{name}-device")
    if name in BATCHNORM_RUNS:  # the statistics moved from their initial zeros and ones
        state = load_file(str(api_runs / f"{name}-device" / "final" / "model.safetensors"))
        assert np.abs(state["1.running_mean"]).max() > 1e-3 and np.abs(state["1.running_var"] - 1).max() > 1e-3


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(GLOO_COMPARED))
def test_allreduce_on_a_gloo_group_equals_the_mpi_path(api_runs, name):
    mpi, run = api_runs / GLOO_COMPARED[name], api_runs / name
    # Every rank reduced on gloo, the MPI run on MPI.
    ranks = 3 if "bn" in name else 2
    assert [r["values"]["allreduce"] for r in read_log(run, "run")] == ["gloo"] * ranks
    assert [r["values"]["allreduce"] for r in read_log(mpi, "run")] == ["mpi (view)"] * ranks
    torch.manual_seed(API_SEED)
    initial = state_dict_arrays(common.build_batchnorm_model() if "bn" in name else common.build_model())
    expected = load_file(str(mpi / "final" / "model.safetensors"))
    assert moved(expected, initial) > 0.05
    assert_weights_close(load_file(str(run / "final" / "model.safetensors")), expected, tol=1e-6)
    history, reference = (
        [h["val_loss"] for h in json.loads((r / "summary.json").read_text())["history"]] for r in (run, mpi)
    )
    assert len(history) == API_EPOCHS
    np.testing.assert_allclose(history, reference, rtol=1e-6)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", DEVICE_RESUMED)
def test_a_run_on_torch_tensors_resumed_from_a_checkpoint_equals_the_numpy_path(api_runs, name):
    run = api_runs / f"{name}-device-half"
    # It stopped after API_EPOCHS - 1 epochs and went on from that epoch's checkpoint.
    assert (run / "checkpoints" / f"epoch-{API_EPOCHS - 1:04d}").is_dir()
    assert json.loads((run / "checkpoints" / "LATEST.json").read_text())["label"] == f"epoch-{API_EPOCHS:04d}"
    assert_same_run_as_on_the_host(name, run, resumed=True)
