"""A set-up of a scaling study: a topology, its rule, its masters, how often it syncs.

A `SetUp` maps a number of ranks to workers and back, and names itself in tables. It is
the one vocabulary the model, the simulator, the sweep and the report share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nbdist.algorithms import RULES, Algorithm

__all__ = ["SetUp", "Point", "master_worker_rules"]


def master_worker_rules() -> dict[str, type[Algorithm]]:
    """The registered rules a master/worker set-up can take, by name (RULES also holds
    allreduce's own rule, which no master applies)."""
    return {name: cls for name, cls in RULES.items() if issubclass(cls, Algorithm)}


@dataclass(frozen=True, slots=True)
class SetUp:
    """`topology` "allreduce" or "master-worker"; `rule` the update rule (allreduce: "sgd");
    `masters` > 1 puts sub-masters under a top master; `sync_every` batches between a
    worker's exchanges (None: the rule's default); `synchronous` rounds instead of updates
    applied as they come."""

    topology: str
    rule: str = "sgd"
    masters: int = 1
    sync_every: int = 1
    synchronous: bool = False

    @property
    def allreduce(self) -> bool:
        return self.topology == "allreduce"

    @property
    def asynchronous(self) -> bool:
        return not self.allreduce and not self.synchronous

    @property
    def label(self) -> str:
        if self.allreduce:
            return "allreduce"
        parts = [self.rule]
        if self.masters > 1:
            parts.append(f"{self.masters} masters")
        if self.sync_every > 1:
            parts.append(f"sync every {self.sync_every}")
        if self.synchronous:
            parts.append("synchronous")
        return ", ".join(parts)

    @property
    def family(self) -> str:
        """allreduce, master/worker or sub-masters: what the prediction curves compare."""
        if self.allreduce:
            return "allreduce"
        return "sub-masters" if self.masters > 1 else "master/worker"

    def workers(self, ranks: int) -> int | None:
        """Workers in all on `ranks` ranks; None where the ranks cannot be laid out so."""
        if self.allreduce:
            return ranks if ranks >= 1 else None
        per, rest = divmod(ranks - self.masters, self.masters)
        return per * self.masters if rest == 0 and per >= 1 else None

    def workers_per_master(self, ranks: int) -> int | None:
        total = self.workers(ranks)
        return None if total is None else total // (1 if self.allreduce else self.masters)

    def ranks(self, workers_per_master: int) -> int:
        if self.allreduce:
            return workers_per_master
        return self.masters * (1 + workers_per_master)

    def with_masters(self, masters: int) -> SetUp:
        return SetUp(self.topology, self.rule, masters, self.sync_every, self.synchronous)

    def train_options(self) -> dict[str, Any]:
        """The training options that make this set-up (nbdist.TrainOptions fields)."""
        if self.allreduce:
            return {"topology": "allreduce"}
        return {
            "topology": "master-worker",
            "algorithm": self.rule,
            "masters": self.masters,
            "sync_every": self.sync_every,
            "synchronous": self.synchronous,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "topology": self.topology,
            "rule": self.rule,
            "masters": self.masters,
            "sync_every": self.sync_every,
            "synchronous": self.synchronous,
        }

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SetUp:
        return cls(**values)


@dataclass(slots=True)
class Point:
    """One configuration's figures, predicted or measured. Times are a worker's per step
    (allreduce) or per exchange with its master (master/worker: `sync_every` batches)."""

    setup: SetUp
    ranks: int
    workers: int
    batch: int  # samples per batch per worker
    samples_per_s: float
    step_s: float
    compute_s: float
    communicate_s: float
    wait_s: float
    staleness_mean: float | None = None
    staleness_p99: float | None = None
    master_utilisation: float | None = None
    cores: int = 0  # the cores the point's ranks had between them
    oversubscribed: bool = False
    scaling: str = "weak"  # weak: the batch per worker fixed; strong: the total batch fixed
    extra: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__slots__ if name != "setup"}
        out["setup"] = self.setup.to_dict()
        out["label"] = self.setup.label
        out["family"] = self.setup.family
        return out

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Point:
        values = {k: v for k, v in values.items() if k not in ("label", "family")}
        values["setup"] = SetUp.from_dict(values["setup"])
        return cls(**values)
