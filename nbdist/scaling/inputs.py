"""The performance model's inputs: what the calibration probe measured on the ranks at hand.

Every time is in seconds and every size in bytes or floats, measured through nbdist's own
code paths (calibrate.py says how each one is taken). A `Calibration` is plain data: it
goes to JSON and back unchanged (the run store keeps it with the scaling study), so a
prediction can be made again later, elsewhere, from the same inputs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from nbdist.errors import UserError

__all__ = ["Calibration", "CalibrationError"]


class CalibrationError(UserError):
    """Inputs the model cannot use (from a store written by another version, or by hand)."""


@dataclass
class Calibration:
    """The measured inputs of the performance model.

    Compute: `step_s` is one forward and backward pass at `batch_size` on one rank with the
    node otherwise idle, `per_sample_s` how it grows with the batch, `busy_factor` how much
    slower it is with every core of the node computing too (memory bandwidth, clocks), and
    `spread` the measured step times over their mean, sorted: the simulator draws from it.

    The loops' own costs per step, beyond forward and backward: `allreduce_loop_s` (an
    allreduce rank: the batch's data, the optimiser step, the trailer), `worker_step_s` per
    rule (a worker's `worker_step`: accumulating, a local optimiser step) and
    `worker_exchange_s` per rule (a worker's side of one exchange: packing its message,
    applying the reply, the header).

    MPI within the node: point-to-point `p2p_alpha_s + bytes * p2p_beta_s` and a two-rank
    `Iallreduce` `allreduce_alpha_s + bytes * allreduce_beta_s` (per round and per byte).

    The master: `apply_s` per rule (its `master_apply` on a flat buffer of the model's size),
    `master_fixed_s` (its serving loop's cost per update beyond the rule and the receive,
    from a real master serving one worker), `client_test_s` (looking at one client's posted
    receive, which every pass of the loop does for every client), `reply_latency_s` (what a
    lone worker waits beyond the master's service: the messages' way there and back), and
    `checkpoint_s` (one rank's share of a checkpoint written), and `merge_s` (the top
    master adding a sub-master's push to the centre).

    Oversubscribed, ranks wait by sleeping `poll_sleep_s` at a time between polls: a message
    whose receiver sleeps so on cores that other processes keep busy takes `wake_s` more,
    and a synchronous step `round_extra_s` more than even sharing of the cores gives, for
    each runnable process beyond the cores (the cores are time-sliced: the last rank to
    finish its step may wait for a slice, the others for it); `turn_s` is how long a rank
    waited for a core each time it became runnable then (the kernel's count: its run-queue
    wait over the times it got a core).

    Goodput: `noise_scale` is the simple gradient noise scale B_simple measured on the
    model (None when it could not be measured), between batches of `noise_batches`.
    """

    model: str
    params: int  # floats in the flat weights
    state: int  # floats of model state (BatchNorm statistics) every message carries too
    batch_size: int
    cores: int  # cores of the node the probe ran on
    step_s: float
    per_sample_s: float
    busy_factor: float
    spread: list[float]
    allreduce_loop_s: float
    worker_step_s: dict[str, float]
    worker_exchange_s: dict[str, float]
    p2p_alpha_s: float
    p2p_beta_s: float
    allreduce_alpha_s: float
    allreduce_beta_s: float
    apply_s: dict[str, float]
    master_fixed_s: float
    client_test_s: float
    reply_latency_s: float
    poll_sleep_s: float  # the longest sleep of a rank that waits without polling all the time
    merge_s: float = 0.0  # the top master's merge of a sub-master's push (a flat add)
    round_s: dict[str, float] = field(default_factory=dict)  # a synchronous master's master_round of one update
    round_extra_s: float = 0.0  # a synchronous step with one more runnable than cores, beyond even sharing
    turn_s: float = 0.0  # a rank's mean wait for a core each time it became runnable, one runnable too many
    wake_s: float = 0.0  # what a message costs more when its receiver sleeps between polls on busy cores
    checkpoint_s: float = 0.0
    # alpha (s) and beta (s/byte) of a message between rank 0's node and another, where the
    # job's ranks are on several nodes (None on one node: a preset stands in, network.py)
    between_nodes: tuple[float, float] | None = None
    noise_scale: float | None = None
    noise_range: tuple[float, float] | None = None  # its 16th and 84th percentiles (bootstrap over batches)
    noise_batches: tuple[int, int] = (0, 0)
    train_samples: int = 0  # the model's training set
    ranks: int = 1  # the ranks the probe had
    host: str = ""
    when: float = 0.0  # time.time() of the probe
    seconds: float = 0.0  # how long the probe took
    notes: list[str] = field(default_factory=list)

    # -- derived -----------------------------------------------------------------------
    @property
    def message_bytes(self) -> int:
        """A worker's message (or a reply): its weights or gradient and its model state."""
        return 4 * (self.params + self.state)

    def compute_s(self, batch: int) -> float:
        """Forward and backward at `batch` samples on an otherwise idle node."""
        fixed = self.step_s - self.per_sample_s * self.batch_size
        return max(fixed, 0.0) + self.per_sample_s * batch

    def rules(self) -> list[str]:
        """The update rules whose master and worker costs were measured."""
        return sorted(self.apply_s)

    def check_rule(self, rule: str) -> None:
        if rule not in self.apply_s:
            raise CalibrationError(
                f"the calibration has no measurements of the rule {rule!r}; it measured: {', '.join(self.rules())}"
            )

    # -- JSON ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        values["noise_batches"] = list(self.noise_batches)
        values["noise_range"] = None if self.noise_range is None else list(self.noise_range)
        values["between_nodes"] = None if self.between_nodes is None else list(self.between_nodes)
        return values

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Calibration:
        known = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        required -= {f.name for f in dataclasses.fields(cls) if f.default_factory is not dataclasses.MISSING}
        missing = sorted(required - set(values))
        if missing:
            raise CalibrationError(f"the calibration lacks {', '.join(missing)}: measure it again (nbdist scale)")
        given = {k: v for k, v in values.items() if k in known}
        for name in ("noise_batches", "noise_range", "between_nodes"):
            if given.get(name) is not None:
                given[name] = tuple(given[name])
        calibration = cls(**given)
        calibration.check()
        return calibration

    def check(self) -> None:
        """Every time a number, none negative; what the model divides by, above 0."""
        for name in ("step_s", "busy_factor", "p2p_beta_s", "allreduce_beta_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise CalibrationError(f"the calibration's {name} must be a number above 0, got {value!r}")
        if self.params < 1 or self.batch_size < 1 or self.cores < 1:
            raise CalibrationError("the calibration needs params, batch_size and cores of at least 1")
        if not self.spread:
            raise CalibrationError("the calibration has no measured spread of step times")
