"""The learning rate each optimiser steps with: scaling by the workers, warm-up, schedules.

For one optimiser (or a rule's own lr, GEM's) the lr of a step is a function of where
training is, and of nothing else:

    lr(epoch, progress) = schedule(epoch) x scale x warm-up(progress)

- schedule(epoch): `--worker-lr-schedule` / `--master-lr-schedule`, a torch or Keras
  schedule evaluated at the (0-based) epoch from the optimiser's own lr; without one, that lr.
- scale: `--lr-scaling` by W, the workers whose gradients one step combines (Goyal et al.
  2017, "Accurate, Large Minibatch SGD"), only where a step does combine them: the
  allreduce workers' optimiser, a synchronous master's optimiser, a rule's own lr when
  synchronous. An asynchronous update, and a worker's local step, come from one worker's
  batch; the centre already receives W times as many of them, so scaling them would
  multiply the step size the centre sees by W twice.
- warm-up(progress): `--warmup-epochs E` rises linearly from `warmup_start` to 1 over the
  first E epochs of progress (epochs as a float: epoch + the fraction of it done), per step.
  It starts at 1/scale, i.e. at the unscaled lr (Goyal et al.), or at WARMUP_START of the
  lr where nothing is scaled.

Being a function of the position, the lr needs no state of its own beyond the position:
a worker's (epoch, step) is in every checkpoint, and a master counts the samples it has
applied (`MasterLr.to_json`), so a resumed run steps with the same lr as an uninterrupted
one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from nbdist.algorithms import Algorithm
from nbdist.backends import Backend
from nbdist.backends.base import LrSchedule
from nbdist.errors import OptionsError
from nbdist.layout import Layout
from nbdist.options import LR_SCALINGS, TrainOptions
from nbdist.specs import Spec, SpecError, parse_spec
from nbdist.train.asynchrony import staleness_lr_factor

__all__ = [
    "LrPlan",
    "TakesLearningRate",
    "WorkerLr",
    "MasterLr",
    "master_lr_for",
    "plan_learning_rates",
    "combined_workers",
    "rule_lr",
    "lr_metrics",
    "WARMUP_START",
    "SCALES",
]

# Where warm-up starts when nothing is scaled: a small fraction of the lr.
WARMUP_START = 0.1
SCALES: dict[str, Callable[[int], float]] = {"none": lambda w: 1.0, "linear": float, "sqrt": math.sqrt}
assert tuple(SCALES) == LR_SCALINGS


@runtime_checkable
class TakesLearningRate(Protocol):
    """An optimiser (FlatOptimizer) or a rule with an lr of its own (GEM)."""

    @property
    def learning_rate(self) -> float: ...

    def set_learning_rate(self, lr: float) -> None: ...


@dataclass(frozen=True)
class LrPlan:
    """The lr of one optimiser as a function of the training position."""

    base: float  # the optimiser's own lr (its spec's)
    scale: float = 1.0
    schedule: LrSchedule | None = None
    warmup_epochs: float = 0.0
    # An asynchronous master with no momentum to lower: each update's lr is divided by
    # 1 + its staleness (train/asynchrony.py); the epoch records keep the plan's lr.
    stale_lr: bool = False

    @property
    def warmup_start(self) -> float:
        return 1.0 / self.scale if self.scale > 1.0 else WARMUP_START

    def target(self, epoch: int) -> float:
        """The lr of `epoch` once warm-up is over."""
        scheduled = self.schedule.lr_at(epoch) if self.schedule is not None else self.base
        return scheduled * self.scale

    def warmup(self, progress: float) -> float:
        if progress >= self.warmup_epochs:
            return 1.0
        start = self.warmup_start
        return start + (1.0 - start) * max(progress, 0.0) / self.warmup_epochs

    def lr(self, epoch: int, progress: float) -> float:
        """The lr of a step taken at `progress` epochs into training, in `epoch`."""
        return self.target(epoch) * self.warmup(progress)

    def update_lr(self, epoch: int, progress: float, staleness: int) -> float:
        """The lr of a master's update `staleness` versions old, taken at `progress`."""
        lr = self.lr(epoch, progress)
        return lr * staleness_lr_factor(staleness) if self.stale_lr else lr


def combined_workers(layout: Layout, worker_parallel: str = "allreduce") -> int:
    """W: the workers whose gradients a combined step takes. Allreduce: every rank of the
    run takes its own batch, except pipeline replicas, whose stages share one. Master-worker:
    every worker reaching the centre (one group of --procs-per-worker processes is one
    worker; with --masters > 1, all masters' workers)."""
    if layout.topology == "allreduce":
        return layout.workers if worker_parallel == "pipeline" else layout.ranks_per_run
    return layout.workers * layout.masters


def rule_lr(algorithm: Algorithm | None) -> TakesLearningRate | None:
    """The rule itself when it steps with an lr of its own (GEM), else None."""
    return algorithm if isinstance(algorithm, TakesLearningRate) else None


def plan_learning_rates(
    options: TrainOptions,
    layout: Layout,
    algorithm: Algorithm | None,
    backend: Backend,
    worker_lr: float | None,
    master_lr: float | None,
    master_stale_lr: bool = False,
) -> tuple[LrPlan | None, LrPlan | None]:
    """(the workers' plan, the master's plan), None where the run has no such lr.
    `worker_lr`, `master_lr`: the lr the worker and master optimisers start with (None:
    no such optimiser); `master_stale_lr`: the master's update lr is divided by 1 +
    staleness (train/asynchrony.py). Set-up, on every rank: a schedule that cannot run, or one given
    for an optimiser the run does not have, is one error here."""
    own = rule_lr(algorithm)
    if worker_lr is None and own is not None:
        worker_lr = own.learning_rate
    synchronous = options.topology == "allreduce" or options.synchronous
    scale = SCALES[options.lr_scaling](combined_workers(layout, options.worker_parallel))
    # Only what steps on the combined gradient of the W workers is scaled (see above), and
    # the local steps of a synchronous round that averages them (DiLoCo's).
    averaged = synchronous and algorithm is not None and algorithm.round_averages_windows
    worker_scale = scale if options.topology == "allreduce" or (own is not None and synchronous) or averaged else 1.0
    master_scale = scale if synchronous else 1.0
    plans: list[LrPlan | None] = []
    for name, base, plan_scale, text in (
        ("worker", worker_lr, worker_scale, options.worker_lr_schedule),
        ("master", master_lr, master_scale, options.master_lr_schedule),
    ):
        flag = f"--{name}-lr-schedule"
        if base is None:
            if text:
                raise OptionsError(f"{flag}: {_no_lr(name, options, algorithm)}")
            plans.append(None)
            continue
        schedule = _schedule(backend, parse_spec(text, what=flag), base, flag) if text else None
        plans.append(
            LrPlan(
                float(base),
                plan_scale,
                schedule,
                float(options.warmup_epochs),
                stale_lr=master_stale_lr and name == "master",
            )
        )
    return plans[0], plans[1]


def _schedule(backend: Backend, spec: Spec, base: float, flag: str) -> LrSchedule:
    try:
        return backend.checked_lr_schedule(spec, base)
    except SpecError as exc:
        raise SpecError(f"{flag}: {exc}") from None


def _no_lr(name: str, options: TrainOptions, algorithm: Algorithm | None) -> str:
    if name == "master":
        if algorithm is None:
            return "the allreduce topology has no master; use --worker-lr-schedule"
        return f"{algorithm.name} has no master optimizer (its master adds the workers' updates); drop it"
    rule = algorithm.name if algorithm is not None else "sgd"
    return (
        f"the workers of {rule} with --sync-every 1 take no steps of their own (the master "
        f"optimizer steps); use --master-lr-schedule"
    )


def lr_metrics(worker: LrPlan | None, master: LrPlan | None, epoch: int) -> dict[str, float]:
    """The epoch record's `worker_lr` / `master_lr`: the lr at the end of (0-based) `epoch`
    (its schedule's lr, warm-up as far as it got by then)."""
    out = {}
    for name, plan in (("worker_lr", worker), ("master_lr", master)):
        if plan is not None:
            out[name] = plan.lr(epoch, epoch + 1.0)
    return out


class WorkerLr:
    """Sets the lr of a worker's steps (its optimiser's, or the rule's own) from the
    worker's position: epoch and batch. Does nothing for a run without one."""

    def __init__(self, plan: LrPlan | None, taker: TakesLearningRate | None, batches_per_epoch: int):
        self.plan = plan if taker is not None else None
        self.taker = taker
        self.batches = max(1, batches_per_epoch)
        self.current: float | None = None

    def before_step(self, epoch: int, step: int) -> None:
        if self.plan is None or self.taker is None:
            return
        lr = self.plan.lr(epoch, epoch + min(step / self.batches, 1.0))
        if lr != self.current:
            self.taker.set_learning_rate(lr)
            self.current = lr


class MasterLr:
    """Sets a master optimiser's lr from the samples this master has applied: its epochs
    are that count over its workers' share of an epoch, whatever order asynchronous
    workers arrive in. The count is checkpointed (`to_json`)."""

    def __init__(self, plan: LrPlan | None, opt: TakesLearningRate | None, epoch_samples: int):
        self.plan = plan if opt is not None else None
        self.opt = opt
        self.epoch_samples = max(1, int(epoch_samples))
        self.samples = 0
        self.current: float | None = None

    def before_update(self, samples: int, staleness: int = 0) -> None:
        """Called before each step of the optimiser, with the samples behind it and its
        staleness (0 for a synchronous round)."""
        if self.plan is not None and self.opt is not None:
            progress = self.samples / self.epoch_samples
            lr = self.plan.update_lr(int(progress), progress, staleness)
            if lr != self.current:
                self.opt.set_learning_rate(lr)
                self.current = lr
        self.samples += int(samples)

    def to_json(self) -> dict[str, Any]:
        return {"samples": self.samples}

    def load_json(self, saved: dict[str, Any]) -> None:
        self.samples = int(saved.get("samples", 0))


def master_lr_for(ctx: Any, opt: TakesLearningRate | None) -> MasterLr:
    """The lr driver of master `ctx.role.master`'s optimiser; an epoch of it is the samples
    of its own workers' shards (a sub-master's optimiser steps for its workers only)."""
    layout, options = ctx.layout, ctx.options
    plan = ctx.data.plan(layout.workers * max(layout.masters, 1), options.batch_size, options.seed)
    first = ctx.role.master * layout.workers
    return MasterLr(ctx.master_lr, opt, int(plan.step_sizes(0)[:, first : first + layout.workers].sum()))
