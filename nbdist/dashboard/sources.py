"""Where a dashboard's records come from: the run store (a served dashboard, past runs)
or a notebook Job (its live records, in the kernel). Both answer the same three
questions: what run is this, what is new since I last asked, and (for studies) the trials.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from nbdist.store import RunStore, StoreError, TrialRow

__all__ = ["RunInfo", "RecordSource", "StoreSource", "JobSource", "run_choices", "check_choices"]


@dataclass(frozen=True, slots=True)
class RunInfo:
    id: str
    status: str
    topology: str
    layout: dict[str, Any]
    options: dict[str, Any]
    started: float | None
    reason: str | None = None
    kind: str = "train"  # "scale": a scaling study (scaling_view.py)


class RecordSource(Protocol):
    def info(self) -> RunInfo | None:
        """The run, once it is known (a job's first record names it)."""

    def poll(self) -> list[dict[str, Any]]:
        """The records that arrived since the previous poll."""

    def close(self) -> None: ...


class StoreSource:
    """One run of a store (a file or a database); each poll reads only the rows stored
    since the last one."""

    def __init__(self, store: str | Path, run_id: str, *, batch: int = 50_000):
        self.run_id = run_id
        self.batch = batch
        self._store = RunStore(store, create=False)
        self._after = 0

    def info(self) -> RunInfo:
        run = self._store.run(self.run_id)
        return RunInfo(
            run.id,
            run.status,
            run.options.get("topology", "master-worker"),
            run.layout,
            run.options,
            run.started,
            run.reason,
            run.kind,
        )

    def poll(self) -> list[dict[str, Any]]:
        records, self._after = self._store.records(self.run_id, after=self._after, limit=self.batch)
        return records

    def close(self) -> None:
        self._store.close()


class JobSource:
    """A notebook Job's records as they stream in (the Job keeps them; this remembers how
    far it has read)."""

    def __init__(self, job: Any):
        self.job = job
        self._read = 0

    def info(self) -> RunInfo | None:
        run_id = self.job.run_id
        if run_id is None:
            return None
        status = self.job.status
        return RunInfo(
            run_id,
            status,
            self.job.options.topology,
            self.job.layout,
            self.job.options.to_dict(),
            self.job.started,
            None,
        )

    def poll(self) -> list[dict[str, Any]]:
        self.job.live.poll()
        new, self._read = self.job.live.since(self._read)
        return new

    def close(self) -> None:
        """Nothing to release: the job owns its records."""


def run_choices(store: RunStore) -> dict[str, str]:
    """Label -> run id, newest first, for the run picker."""
    choices = {}
    for run in store.runs():
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(run.started)) if run.started else "?"
        choices[f"{run.id}  ({run.status}, {when})"] = run.id
    return choices


def check_choices(store: RunStore, run: str | None = None, study: str | None = None) -> None:
    """A StoreError naming what the store holds when `run` or `study` is not in it (a
    served dashboard says so at its start, not on every page it serves)."""
    if run is not None and run not in store.run_ids():
        raise StoreError(f"no run {run!r} in the store {store.label}")
    if study is not None:
        store.study(study)  # its error names the studies the store holds


def trials_frame(trials: list[TrialRow]) -> Any:
    """A study's trials as a DataFrame, one row each, the parameters as columns."""
    import pandas as pd

    rows = [
        {
            "trial": t.number,
            "state": t.state,
            "fom": t.fom,
            "fom_std": t.fom_std,
            "generation": t.generation,
            "group": t.group,
            "folds": len(t.folds),
            **{f"param.{k}": v for k, v in t.params.items()},
        }
        for t in trials
    ]
    return pd.DataFrame(rows)
