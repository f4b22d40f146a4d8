"""The metric record: small, append-only, the same from every rank."""

from __future__ import annotations

from copy import deepcopy
from dataclasses import dataclass, fields
from typing import Any

__all__ = ["Record", "stopped_on_request"]


@dataclass(slots=True)
class Record:
    run: str
    trial: int | None
    rank: int
    role: str  # "master" | "worker" | "coordinator"
    kind: str  # "train", "updates", "epoch", "val", "phase", "resources", "run", ...
    step: int
    epoch: int
    time: float  # seconds since the epoch (time.time())
    values: dict[str, Any]
    # Per rank and run, counting from 0 across resumes: (run, rank, seq) names a record
    # once, so a store that is fed the same record twice (a log read again, a batch
    # streamed and ingested) keeps one copy.
    seq: int = 0

    def to_dict(self) -> dict[str, Any]:
        # Not dataclasses.asdict: its recursion cost a master tracing its updates about
        # 13 us a record; only the values' nested lists and dicts need copying (a caller
        # may change them after emitting, before the log is flushed).
        out = {name: getattr(self, name) for name in _FIELDS}
        out["values"] = {k: deepcopy(v) if isinstance(v, (list, dict)) else v for k, v in self.values.items()}
        return out


_FIELDS = tuple(f.name for f in fields(Record))


def stopped_on_request(reason: str) -> bool:
    """Whether a run's stop reason says it ended before its epochs because it was asked to
    (a stop signal, the study's pruner or scheduler, a job giving up), not by a rule of its own (early
    stopping, target): its 'run' status is then "stopped", not "completed"."""
    return reason.startswith(("stopped", "pruned", "paused", "abandoned"))
