"""The learning rate a step gets (train/lr.py), without MPI: scaling by the workers where a
step combines their gradients, the warm-up ramp, named torch schedules, the master's
position in samples and its resume, and the errors for bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from nbdist.algorithms import make_algorithm
from nbdist.backends import backend_for
from nbdist.backends.torch_optimizers import torch_lr_schedules
from nbdist.errors import OptionsError
from nbdist.layout import Layout
from nbdist.options import TrainOptions
from nbdist.specs import SpecError, parse_spec
from nbdist.train.lr import WARMUP_START, LrPlan, MasterLr, WorkerLr, lr_metrics, plan_learning_rates, rule_lr
from nbdist.train.rules import resolve_rules


@pytest.fixture(scope="module")
def backend():
    torch.manual_seed(0)
    return backend_for(nn.Sequential(nn.Linear(4, 3)), sample=np.zeros((2, 4), np.float32))


def plans(backend, topology="master-worker", algorithm="downpour", workers=2, masters=1, **options):
    """(worker plan, master plan) as set-up makes them for this run."""
    opts = TrainOptions(topology=topology, algorithm=algorithm, workers=workers, masters=masters, **options)
    rule, _, worker_spec, master_spec = resolve_rules(opts)
    lrs = [backend.check_optimizer(spec) if spec is not None else None for spec in (worker_spec, master_spec)]
    return plan_learning_rates(opts, Layout(workers=workers, masters=masters, topology=topology), rule, backend, *lrs)


# ---------------------------------------------------------------- the lr of a step
def test_warmup_rises_linearly_from_the_unscaled_lr_to_the_scaled_one():
    plan = LrPlan(base=0.1, scale=4.0, warmup_epochs=2.0)
    # Goyal et al.: the first step takes the single-worker lr, the ramp is linear per step.
    assert plan.lr(0, 0.0) == pytest.approx(0.1)
    assert plan.lr(0, 0.5) == pytest.approx(0.4 * (0.25 + 0.75 * 0.25))
    assert plan.lr(1, 1.0) == pytest.approx(0.4 * (0.25 + 0.75 * 0.5))
    assert plan.lr(2, 2.0) == pytest.approx(0.4)
    assert plan.lr(5, 5.3) == pytest.approx(0.4)
    # Nothing scaled: from a tenth of the lr.
    plain = LrPlan(base=0.1, warmup_epochs=1.0)
    assert plain.lr(0, 0.0) == pytest.approx(0.1 * WARMUP_START)
    assert plain.lr(0, 0.5) == pytest.approx(0.1 * (WARMUP_START + (1 - WARMUP_START) / 2))
    assert LrPlan(base=0.1).lr(0, 0.0) == 0.1  # no warm-up


def test_worker_steps_take_the_warmup_lr_step_by_step(backend):
    params = np.zeros(3, np.float32)
    opt = backend.make_optimizer(parse_spec("sgd(lr=0.2)"), params)
    lr = WorkerLr(LrPlan(base=0.2, scale=2.0, warmup_epochs=1.0), opt, batches_per_epoch=4)
    seen = []
    for step in range(4):
        lr.before_step(0, step)
        before = params.copy()
        opt.step(np.ones(3, np.float32))
        seen.append(float(before[0] - params[0]))  # plain SGD moves by lr x gradient
    assert seen == pytest.approx([0.2 * 2 * (0.5 + 0.5 * s / 4) for s in range(4)], rel=1e-6)
    lr.before_step(1, 0)
    assert opt.learning_rate == pytest.approx(0.4)


def test_a_named_torch_schedule_per_epoch_with_scaling_on_top(backend):
    worker, _ = plans(
        backend,
        topology="allreduce",
        algorithm=None,
        workers=4,
        lr_scaling="sqrt",
        worker_optimizer="sgd(lr=0.1)",
        worker_lr_schedule="StepLR(step_size=2, gamma=0.5)",
    )
    assert [worker.lr(e, e + 0.5) for e in range(5)] == pytest.approx(
        [0.2, 0.2, 0.1, 0.1, 0.05]
    )  # sqrt(4) = 2 times torch's StepLR
    cosine, _ = plans(
        backend,
        topology="allreduce",
        algorithm=None,
        workers=2,
        worker_optimizer="sgd(lr=0.1)",
        worker_lr_schedule="cosineannealinglr(T_max=4)",
    )
    assert [cosine.lr(e, e) for e in range(5)] == pytest.approx(
        [0.05 * (1 + math.cos(math.pi * e / 4)) for e in range(5)]
    )
    assert lr_metrics(cosine, None, 1) == {"worker_lr": pytest.approx(cosine.lr(1, 2.0))}


def test_only_steps_on_the_combined_gradient_are_scaled(backend):
    # Allreduce with 4 ranks: the workers' optimiser steps on the mean over 4 batches.
    worker, master = plans(backend, topology="allreduce", algorithm=None, workers=4, lr_scaling="linear")
    assert (worker.scale, master) == (4.0, None)
    # Synchronous downpour under 2 masters of 2 workers: 4 workers reach the centre.
    worker, master = plans(backend, masters=2, synchronous=True, lr_scaling="linear")
    assert (worker, master.scale) == (None, 4.0)
    # Asynchronous: each update is one worker's batch; not scaled.
    _, master = plans(backend, lr_scaling="linear", warmup_epochs=1.0)
    assert (master.scale, master.warmup_epochs) == (1.0, 1.0)
    # GEM's own lr, synchronous and not; EASGD's workers step locally.
    assert plans(backend, algorithm="gem(lr=0.05)", synchronous=True, lr_scaling="sqrt")[0].scale == pytest.approx(
        math.sqrt(2)
    )
    gem_async = plans(backend, algorithm="gem(lr=0.05)", lr_scaling="sqrt")[0]
    assert (gem_async.base, gem_async.scale) == (pytest.approx(0.05), 1.0)
    assert plans(backend, algorithm="easgd", synchronous=True, lr_scaling="linear")[0].scale == 1.0
    # DiLoCo's synchronous round averages the workers' windows; asynchronous, each window
    # arrives alone.
    assert plans(backend, algorithm="diloco", workers=4, synchronous=True, lr_scaling="sqrt")[0].scale == 2.0
    assert plans(backend, algorithm="diloco", workers=4, lr_scaling="sqrt")[0].scale == 1.0
    assert plans(backend, algorithm="async_local_sgd", workers=4, lr_scaling="sqrt")[0].scale == 1.0


def test_gem_takes_its_lr_from_the_plan():
    gem = make_algorithm(parse_spec("gem(lr=0.05)"))
    lr = WorkerLr(LrPlan(base=0.05, warmup_epochs=1.0), rule_lr(gem), batches_per_epoch=2)
    lr.before_step(0, 1)
    assert gem.lr == np.float32(0.05 * (WARMUP_START + (1 - WARMUP_START) / 2))
    assert rule_lr(make_algorithm(parse_spec("easgd"))) is None


def test_master_position_in_samples_resumes_exactly(backend):
    def run(updates, resume_at=None):
        opt = backend.make_optimizer(parse_spec("sgd(lr=0.1)"), np.zeros(3, np.float32))
        plan = LrPlan(0.1, 2.0, backend.checked_lr_schedule(parse_spec("steplr(step_size=1, gamma=0.5)"), 0.1), 1.5)
        master, lrs = MasterLr(plan, opt, epoch_samples=100), []
        for i, samples in enumerate(updates):
            if i == resume_at:  # a new master (another process) from the checkpointed position
                saved = master.to_json()
                opt = backend.make_optimizer(parse_spec("sgd(lr=0.1)"), np.zeros(3, np.float32))
                master = MasterLr(plan, opt, epoch_samples=100)
                master.load_json(saved)
            master.before_update(samples)
            lrs.append(opt.learning_rate)
        return lrs

    updates = [32, 32, 36] * 3  # three epochs of 100 samples
    straight = run(updates)
    # Epoch 0 from the unscaled lr; epoch 1 halved by the schedule, still warming up; epoch 2 done.
    assert straight[0] == pytest.approx(0.1)
    assert straight[3] == pytest.approx(0.1 * (0.5 + 0.5 * (1 / 1.5)))
    assert straight[6:] == pytest.approx([0.05] * 3)
    assert run(updates, resume_at=4) == straight


def test_a_stale_update_of_a_master_without_momentum_takes_a_smaller_lr(backend):
    """train/asynchrony.py: lr / (1 + staleness) per update, on top of schedule and warm-up;
    only the master's plan, and the epoch records keep the plan's lr."""
    opt = backend.make_optimizer(parse_spec("sgd(lr=0.1)"), np.zeros(3, np.float32))
    plan = LrPlan(0.1, warmup_epochs=1.0, stale_lr=True)
    master = MasterLr(plan, opt, epoch_samples=100)
    lrs = []
    for samples, staleness in [(50, 0), (50, 3), (50, 0), (50, 7)]:
        master.before_update(samples, staleness)
        lrs.append(opt.learning_rate)
    warm = WARMUP_START + (1 - WARMUP_START) * 0.5  # half-way through the warm-up epoch
    assert lrs == pytest.approx([0.1 * WARMUP_START, 0.1 * warm / 4, 0.1, 0.1 / 8])
    assert lr_metrics(None, plan, 0) == {"master_lr": pytest.approx(0.1)}
    assert LrPlan(0.1).update_lr(0, 0.0, 7) == 0.1  # without the correction, staleness changes nothing
    opts = TrainOptions(algorithm="downpour", workers=8, sync_every=2)  # workers with local steps too
    worker, master_plan = plan_learning_rates(
        opts, Layout(workers=8), resolve_rules(opts)[0], backend, 0.05, 0.1, master_stale_lr=True
    )
    assert master_plan.stale_lr and not worker.stale_lr


# ------------------------------------------------------------------------ bad input
def test_an_unknown_schedule_lists_the_known_ones(backend):
    with pytest.raises(SpecError) as err:
        plans(backend, master_lr_schedule="steplrr(step_size=2)")
    text = str(err.value)
    assert text.startswith("--master-lr-schedule: unknown torch learning-rate schedule")
    assert "(did you mean 'steplr'?); choose one of: constantlr, cosineannealinglr," in text


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("LambdaLR", "'lambdalr' takes a function, which an option string cannot give"),
        ("SequentialLR(milestones=[2])", "'sequentiallr' combines other schedulers"),
        ("ReduceLROnPlateau", "'reducelronplateau' steps on a validation metric, not once per epoch"),
    ],
)
def test_a_schedule_an_option_cannot_build_says_why_not_that_it_is_unknown(backend, name, why):
    with pytest.raises(SpecError) as err:
        plans(backend, algorithm="easgd", worker_lr_schedule=name)
    text = str(err.value)
    assert text.startswith(f"--worker-lr-schedule: torch learning-rate schedule {why}"), text
    assert "unknown" not in text and text.endswith("; choose one of: " + ", ".join(sorted(torch_lr_schedules())))


def test_a_schedule_argument_it_does_not_take(backend):
    with pytest.raises(
        SpecError,
        match=r"--worker-lr-schedule: learning-rate schedule 'steplr' takes no "
        r"parameter 'step'; it takes: step_size, gamma",
    ):
        plans(backend, algorithm="easgd", worker_lr_schedule="steplr(step=2)")
    with pytest.raises(
        SpecError,
        match=r"--worker-lr-schedule: learning-rate schedule steplr\(step_size='two'\): "
        r"TypeError",
    ):
        plans(backend, algorithm="easgd", worker_lr_schedule="steplr(step_size='two')")


def test_a_schedule_for_an_optimizer_the_run_does_not_have(backend):
    with pytest.raises(OptionsError, match="--master-lr-schedule: easgd has no master optimizer"):
        plans(backend, algorithm="easgd", master_lr_schedule="steplr(step_size=2)")
    with pytest.raises(OptionsError, match="allreduce topology has no master"):
        plans(backend, topology="allreduce", algorithm=None, master_lr_schedule="steplr(step_size=2)")
    with pytest.raises(OptionsError, match="--worker-lr-schedule: the workers of downpour with --sync-every 1"):
        plans(backend, worker_lr_schedule="steplr(step_size=2)")


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"lr_scaling": "squared"}, "--lr-scaling 'squared': choose one of none, linear, sqrt"),
        ({"warmup_epochs": -1.0}, "--warmup-epochs must be 0 (no warm-up) or more, got -1.0"),
    ],
)
def test_bad_lr_options(changes, message):
    with pytest.raises(OptionsError) as err:
        TrainOptions(**changes).validate()
    assert str(err.value) == message
