"""What every master/worker update rule provides.

An algorithm is a pure rule over flat float32 arrays plus a small slotted state: no MPI,
no framework. The arrays are numpy arrays or torch tensors (wherever the model lives),
handled through the array API (arrays.py): one rule, written once, for both. The topology calls it at fixed points:

worker:  once, with the initial weights      `worker_start`
         after each batch's gradient      `worker_step`   (local progress; time to sync?)
         when it is time to sync           `worker_message` (fill the payload to send)
         when the master's reply arrives   `worker_reply`   (apply it to the local weights)
master:  on updates from workers           `master_apply`   (move the centre; say what to reply)
         on a synchronous round            `master_round`   (the same, the updates streamed)
worker:  on a synchronous round's reply    `worker_round_reply`
top master, with sub-masters (--masters > 1): on the masters' steps  `merge_master_steps`

A synchronous round averages its updates, sample-weighted (`weighted_mean`), whatever
the rule: one round is one step on the mean, as one worker with the round's samples
would take (EASGD's elastic round is that average too, see easgd.py). The master draws a
round's updates one at a time (`master_round`), so that it holds one worker's payload at
a time however many workers it serves; the result is master_apply's, bit for bit.

Optimisers are passed in as `FlatOptimizer` objects (the backend makes them), so the
rules never name a framework.

Every rule registers on `RULES` (nbdist.registry): its class carries its name, its
parameters (the constructor's, with defaults, and `parameter_help`), the topologies it
trains and what the contract tests may expect of it (tests/test_rule_contracts.py). A new
rule is one module and `@RULES.register` (docs/howto/custom-rule.md).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import numpy as np

from nbdist.algorithms.arrays import Array, copy_into, f32, is_array, to_numpy
from nbdist.backends.base import FlatOptimizer
from nbdist.registry import Registry
from nbdist.specs import ValueRange

__all__ = [
    "Rule",
    "RULES",
    "Algorithm",
    "RuleState",
    "Update",
    "MOMENTUM",
    "weighted_mean",
    "mean_factors",
    "accumulate_mean",
]

# The momentum of a rule's velocity: at 1 or above it never decays and the run diverges.
MOMENTUM = ValueRange(0.0, 1.0, high_open=True)


class RuleState:
    """Base for the slotted per-rank state of a rule; arrays and scalars checkpoint as-is,
    each under its field's name."""

    __slots__ = ()

    def saved_before_as(self) -> dict[str, str]:
        """Renamed fields' names in the checkpoints written before the rename, {field: old
        name}: read where a field's own name is missing, so that those still resume. (A
        method, not a class variable: that would be one of the dataclass's fields.)"""
        return {}

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {f.name: to_numpy(getattr(self, f.name)) for f in fields(self)}  # type: ignore[arg-type]

    def load_arrays(self, arrays: dict[str, np.ndarray]) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            name = f.name if f.name in arrays else self.saved_before_as().get(f.name, f.name)
            if name not in arrays:
                continue
            current = getattr(self, f.name)
            value = arrays[name]
            if is_array(current):
                copy_into(current, value)
            else:
                # .item(): a scalar saved as shape (1,) by older checkpoints loads too.
                setattr(self, f.name, type(current)(np.asarray(value).item()))


@dataclass(slots=True)
class Update:
    """One worker's message as the master sees it."""

    payload: Array  # the worker_message array (the master may overwrite it)
    staleness: int  # master version when applied - version the worker computed from
    samples: int  # samples behind this update (weights synchronous averages)
    version: int = 0  # the master version the worker computed from (staleness is set from it when applied)


class Rule:
    """What every registered update rule's class carries: its name, the help of its
    constructor's parameters and the topologies it trains (--topology)."""

    name: ClassVar[str]
    parameter_help: ClassVar[dict[str, str]] = {}
    topologies: ClassVar[tuple[str, ...]] = ("master-worker",)
    # Parameters that exercise every part of the rule (EASGD's elastic momentum, say):
    # the contract tests build it with these.
    example_parameters: ClassVar[dict[str, Any]] = {}


RULES: Registry[Rule] = Registry("update rule")


class Algorithm(Rule, ABC):
    """A master/worker update rule: pure functions of flat float32 arrays and a state.

    The topology calls the worker side (`worker_start`, `worker_step`, `worker_message`,
    `worker_reply`) on every worker and the master side (`master_apply`, `master_round`)
    on the master, at the points the module docstring lists. Arrays are numpy arrays or
    torch tensors wherever the model lives (the array API); a rule imports no MPI and no
    framework, so it is tested on plain arrays. The class attributes say what the rest of
    nbdist needs to know: `name` (what `--algorithm` takes), `default_sync_every`, which
    optimisers it uses, what a worker sends (`carries_local_steps`,
    `message_is_weights`) and whether the master adds updates as they are
    (`centre_takes_worker_steps`, `auto_stale_discount`). A rule registers on `RULES`
    (docs/howto/custom-rule.md).

    Args:
        **params: The rule's own parameters (`--algorithm "easgd(elastic_force=0.5)"`),
            given to the subclass's constructor; they show in its `repr`.

    Example:
        ADAG's master adds each update as it comes; the centre is every reply:

        >>> import numpy as np
        >>> from nbdist.algorithms import ADAG, Update
        >>> rule = ADAG()
        >>> centre = np.zeros(3, dtype=np.float32)
        >>> update = Update(np.full(3, 0.5, np.float32), staleness=0, samples=32)
        >>> replies = rule.master_apply(rule.new_master_state(3), centre, [update], None)
        >>> centre
        array([0.5, 0.5, 0.5], dtype=float32)
        >>> replies[0] is centre
        True
    """

    default_sync_every: ClassVar[int] = 1
    uses_worker_optimizer: ClassVar[bool] = True
    uses_master_optimizer: ClassVar[bool] = False
    # With one worker that syncs after every batch, the rule is plain training with its
    # optimiser (the master's, else the worker's): a contract test holds it to that.
    one_worker_is_plain_training: ClassVar[bool] = False
    # What a worker sends is made from its weights (the weights, or their displacement),
    # not from its gradients: every local step reaches the centre, whatever took it (a
    # GAN's discriminator steps, taken inside the gradient computation, do).
    carries_local_steps: ClassVar[bool] = False
    # The centre takes each worker's window displacement as it is (no elastic pull, no
    # rescaling): the workers' momentum then reaches the centre, and with many workers
    # its total with asynchrony's can make the centre collapse (train/asynchrony.py).
    centre_takes_worker_steps: ClassVar[bool] = False
    # Under --momentum-correction auto, from train/asynchrony.COLLAPSE_SEEN_FROM
    # asynchronous workers, the master scales each update by 1 / (1 + staleness) before
    # it adds it (discount_stale, set on the instance by the run): the rules whose master
    # adds updates as they are and was seen to collapse without it (ADAG, GEM).
    auto_stale_discount: ClassVar[bool] = False
    discount_stale: bool = False
    # A worker's message is its weights themselves (EASGD), not a step: a codec that sends
    # a part and keeps the rest for later (--compression topk, powersgd) does not fit.
    message_is_weights: ClassVar[bool] = False
    # A synchronous round averages the workers' windows (DiLoCo): with H = 1, SGD, an outer
    # lr of 1 and no outer momentum that is allreduce's step on the W workers' batch, so
    # --lr-scaling scales the workers' optimiser as it scales allreduce's.
    round_averages_windows: ClassVar[bool] = False
    # The workers' optimiser when --worker-optimizer is not given (None: nbdist's default);
    # DiLoCo's workers take AdamW steps, as in the paper.
    default_worker_optimizer: ClassVar[str | None] = None
    # The master names each worker's next window in its reply, from the worker's measured
    # speed (dynamic local steps, async_local_sgd(dynamic_steps=True)): `next_window` on
    # the master, `worker_window` on the worker. Asynchronous runs only (train/rules.py).
    adapts_windows: bool = False
    # Set by the run (train/settle.py) when the master applies each update as it comes
    # (no --synchronous): a rule whose asynchronous update is a share of a round (DiLoCo)
    # reads it; master_apply on a synchronous round's updates sees it False.
    asynchronous: bool = False

    def __init__(self, **params: Any):
        self.params = params

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{self.name}({args})"

    def sync_window(self) -> int | None:
        """The window (batches between syncs) that the rule's own parameters fix, as
        DiLoCo's inner_steps does; None: --sync-every, else default_sync_every."""
        return None

    def bind(self, workers: int) -> None:
        """Called once, before any update, with the number of workers whose updates reach
        the centre (every master's, with sub-masters). By default a rule ignores it."""

    def next_window(self, window: int, speed: float, fastest: float) -> int:
        """The next window (local steps) of a worker whose last window ran at `speed`,
        when the fastest worker still training ran at `fastest` (both samples per
        second, measured by its master), for a rule that `adapts_windows`; `window` is
        the run's (inner_steps or --sync-every). By default every worker keeps `window`."""
        return window

    def outer_momentum(self) -> tuple[float, int] | None:
        """The momentum of the master's own outer step (DiLoCo's) and the asynchronous
        arrivals between two of its updates; None (the default): the rule's master keeps
        no momentum. Asynchrony adds a momentum of its own, by which the run lowers this
        one (train/asynchrony.py, through set_outer_momentum)."""
        return None

    def set_outer_momentum(self, momentum: float) -> None:
        """Step with `momentum` as the outer momentum (a rule whose outer_momentum() is
        not None)."""
        raise TypeError(f"{self.name} keeps no outer momentum")

    # -- worker side ------------------------------------------------------------------
    @abstractmethod
    def new_worker_state(self, n: int, sync_every: int, like: Array | None = None) -> RuleState:
        """The worker's state, its arrays in the namespace and on the device of `like`
        (the worker's weights; numpy without it)."""

    def worker_start(self, state: RuleState, params: Array) -> None:
        """Called once the worker holds the master's initial weights. By default nothing
        happens: only rules that remember where a window started need it."""

    @abstractmethod
    def worker_step(self, state: RuleState, params: Array, grad: Array, opt: FlatOptimizer | None) -> bool:
        """Use one batch's gradient; True when the worker should now talk to its master."""

    @abstractmethod
    def worker_message(self, state: RuleState, params: Array, out: Array) -> None:
        """Write what the worker sends into `out` (len(params) floats)."""

    @abstractmethod
    def worker_reply(self, state: RuleState, params: Array, reply: Array) -> None:
        """Apply the master's reply to the local weights."""

    def worker_window(self, state: RuleState, steps: int) -> None:
        """The master's reply named this worker's next window: `steps` local steps (a
        rule that `adapts_windows` is told after every reply of an asynchronous run)."""

    # -- master side ------------------------------------------------------------------
    def new_master_state(self, n: int, like: Array | None = None) -> RuleState:
        return _NoState()

    @abstractmethod
    def master_apply(
        self,
        state: RuleState,
        centre: Array,
        updates: Sequence[Update],
        opt: FlatOptimizer | None,
    ) -> list[Array]:
        """Fold `updates` into `centre` (one update when asynchronous, one per worker
        when synchronous) and return, per update, the array to send back."""

    def master_round(
        self,
        state: RuleState,
        centre: Array,
        updates: Iterable[Update],
        samples: Sequence[int],
        opt: FlatOptimizer | None,
        out: Array,
    ) -> Array:
        """A synchronous round whose updates are drawn one at a time: each payload is valid
        (and may be overwritten) only until the next is drawn, so the master holds one at a
        time whatever its number of workers. `samples` are the updates' counts, in order,
        known before any payload; `out` is a buffer of len(centre) floats, the rule's own
        for the round. Moves the centre as `master_apply` on the whole round would, bit
        for bit, and returns the one array replied to every worker of the round (which
        `worker_round_reply` applies). By default: weighted_mean folded into `out`, then
        master_apply on that one update."""
        mean = accumulate_mean(out, (u.payload for u in updates), mean_factors(samples))
        return self.master_apply(state, centre, [Update(mean, 0, int(sum(samples)))], opt)[0]

    def add_updates(self, centre: Array, updates: Sequence[Update]) -> list[Array]:
        """master_apply for a rule whose master adds the updates as they are (ADAG, GEM):
        their sample-weighted mean into `centre`, each first scaled by 1 / (1 + staleness)
        when `discount_stale` is set; the centre is every reply."""
        if self.discount_stale:
            for u in updates:
                discount(u)
        centre += weighted_mean(updates)
        return [centre] * len(updates)

    def worker_round_reply(self, state: RuleState, params: Array, reply: Array) -> None:
        """Apply the reply of a synchronous round (`master_round`'s) to the local weights."""
        self.worker_reply(state, params, reply)

    def merge_master_steps(self, centre: Array, steps: Sequence[Update]) -> None:
        """The top master's rule for the masters' steps (roles/hierarchy.py): each
        payload is one master's displacement of the centre, its rule applied to its own
        workers' updates, and `samples` weighs it (the workers behind it). Asynchronous,
        one step comes at a time and is added as it is (the sub-master already applied
        the rule); a synchronous round's steps all start from the same centre, and their
        weighted mean is the step of one master averaging every worker's update."""
        centre += weighted_mean(steps)


@dataclass(slots=True)
class _NoState(RuleState):
    pass


def mean_factors(samples: Sequence[int]) -> list[float]:
    """What weighted_mean multiplies each payload by (float32 values): its share of the
    samples, or an equal share when no update carries samples."""
    weights = [float(n) for n in samples]
    total = sum(weights)
    if total <= 0:
        weights, total = [1.0] * len(weights), float(len(weights))
    return [f32(w / total) for w in weights]


def discount(u: Update) -> Update:
    """Scale a stale update by 1 / (1 + staleness), in place (DynSGD, Jiang et al. 2017)."""
    if u.staleness:
        u.payload *= f32(1.0 / (1.0 + u.staleness))
    return u


def weighted_mean(updates: Sequence[Update]) -> Array:
    """Sample-weighted mean of the payloads: for gradients, the gradient of the
    concatenated batch. Updates that carry no samples count equally."""
    if len(updates) == 1:
        return updates[0].payload
    factors = mean_factors([u.samples for u in updates])
    out = updates[0].payload * factors[0]
    for u, factor in zip(updates[1:], factors[1:], strict=True):
        out += u.payload * factor
    return out


def accumulate_mean(out: Array, payloads: Iterable[Array], factors: Sequence[float]) -> Array:
    """weighted_mean of payloads that come one at a time, into `out`: the same float32
    products and sums in the same order, so the same bits, with one payload held at a
    time. Each payload is scaled in place (p *= f rounds as p * f does)."""
    for k, (payload, factor) in enumerate(zip(payloads, factors, strict=True)):
        payload *= factor
        if k == 0:
            out[...] = payload
        else:
            out += payload
    return out
