"""Who trains a study's trials, as the coordinator sees them: an executor starts a trial's
segment on a free group, reports each epoch and each segment's end, and stops a trial
when asked.

Executors: groups of MPI ranks under mpiexec (nbdist.roles.study), groups of a notebook's
engines (nbdist.notebook_study), a Python function in this process (nbdist.hpo.inprocess).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from nbdist.hpo.trial import Segment, Trial

__all__ = ["TrialExecutor", "EpochReport", "TrialFinished", "FoldOutcome", "Running"]


@dataclass(slots=True)
class EpochReport:
    """A fold run of a running trial finished an epoch (its leader's epoch record)."""

    number: int
    fold: int
    epoch: int
    metrics: dict[str, Any]


@dataclass(slots=True)
class FoldOutcome:
    final: dict[str, Any] | None = None  # the fold run's final metrics (its leader's RunResult)
    error: str | None = None
    stop_reason: str = ""
    run_id: str | None = None
    ends_study: bool = False  # the error is in the study's settings: every trial would fail with it


@dataclass(slots=True)
class TrialFinished:
    """Every rank of the trial's group is done with its segment: its group is free again."""

    number: int
    folds: dict[int, FoldOutcome]


@dataclass
class Running:
    """A trial's segment on a group, as the coordinator keeps it (group None: a trial
    recovered from its runs' records)."""

    trial: Trial
    group: int | None
    segment: Segment | None = None

    @property
    def placed(self) -> int:
        """The group of a segment that runs (every one the runner started has one)."""
        if self.group is None:
            raise RuntimeError(f"trial {self.trial.number} runs on no group: it was recovered from its records")
        return self.group

    @property
    def planned(self) -> Segment:
        """The segment that runs (every one the runner started has one)."""
        if self.segment is None:
            raise RuntimeError(f"trial {self.trial.number} has no segment: it was recovered from its records")
        return self.segment


class TrialExecutor(ABC):
    """Trains trials on `groups` groups of ranks, one trial per group at a time."""

    groups: int
    in_process: bool = False  # no ranks to copy a training state between (PBT)
    layout: Any = None  # the study's Layout where its groups are MPI ranks: the store keeps it (the dashboard's ranks)

    @abstractmethod
    def start(self, group: int, trial: Trial, segment: Segment) -> None:
        """Start training `segment` of `trial` on `group` (which is free); returns at once."""

    @abstractmethod
    def poll(self, timeout: float) -> list[EpochReport | TrialFinished]:
        """What happened since the last poll, waiting at most `timeout` for something."""

    @abstractmethod
    def stop(self, group: int, reason: str) -> None:
        """Stop the trial running on `group` after its current epoch (at its next step
        boundary where it cannot wait that long)."""

    def answer(self, report: EpochReport, stop_reason: str) -> None:  # noqa: B027 - a hook: by default nothing
        """The study's word on `report` ('' to go on): a gated segment's run waits for it."""

    def close(self) -> None:  # noqa: B027 - a hook: by default nothing
        """The study is over (or interrupted): release the groups."""
