"""Schedulers: how a study's trials share its groups' epochs, behind one small interface
(`Scheduler`), looked up by name once in `SCHEDULERS` (fifo, median, asha, hyperband, pbt,
pb2).

    --scheduler "asha(min_epochs=1, reduction=3)"     (the CLI, the %%distnn magic, the API)

Nothing here touches MPI or a framework: the runner carries the decisions out.
"""

from __future__ import annotations

from nbdist.hpo.schedulers.asha import ASHA, Hyperband, rungs
from nbdist.hpo.schedulers.base import (
    COMPLETE,
    FAILED,
    PAUSED,
    SCHEDULERS,
    STOPPED,
    Exchange,
    Scheduler,
    SchedulerError,
    Setting,
    Work,
)
from nbdist.hpo.schedulers.fifo import FIFO, Median
from nbdist.hpo.schedulers.pb2 import PB2
from nbdist.hpo.schedulers.pbt import PBT, explore

__all__ = [
    "Scheduler",
    "SchedulerError",
    "Setting",
    "Work",
    "Exchange",
    "SCHEDULERS",
    "PAUSED",
    "COMPLETE",
    "STOPPED",
    "FAILED",
    "FIFO",
    "Median",
    "ASHA",
    "Hyperband",
    "PBT",
    "PB2",
    "rungs",
    "explore",
]
