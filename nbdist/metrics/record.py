"""The metric record: small, append-only, the same from every rank."""

from __future__ import annotations

from dataclasses import asdict, dataclass
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
        return asdict(self)


def stopped_on_request(reason: str) -> bool:
    """Whether a run's stop reason says it ended before its epochs because it was asked to
    (a stop signal, the study's pruner, a job giving up), not by a rule of its own (early
    stopping, target): its 'run' status is then "stopped", not "completed"."""
    return reason.startswith(("stopped", "pruned", "abandoned"))
