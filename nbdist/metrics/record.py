"""The metric record: small, append-only, the same from every rank."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(slots=True)
class Record:
    run: str
    trial: int | None
    rank: int
    role: str  # "master" | "worker" | "coordinator"
    kind: str  # "train", "update", "epoch", "phase", "resources", "run", ...
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
