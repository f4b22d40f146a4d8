"""What the study dashboard reads from the run store, and how it keeps up with a study
that is running: the study's settings once; its trial rows on each poll (a study has up to
a few thousand); its trial events only from the last one seen on (they are many: one per
trial and epoch); its runs when a trial's row changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nbdist.dashboard.study.frames import FINISHED, study_space
from nbdist.hpo.space import Space
from nbdist.store import RunRow, RunStore, TrialRow

__all__ = ["StudyInfo", "StudyData"]

# Events are read from a little before the newest one seen: a writer's clock a little behind
# another's (two jobs of one study on two hosts) does not hide its events; those read twice
# are recognised by their key.
CLOCK_SLACK = 5.0


@dataclass
class StudyInfo:
    id: str
    objectives: list[str]
    maximize: list[bool]
    searcher: str
    scheduler: str
    space: Space | None
    layout: dict[str, Any] | None  # the study's layout of MPI ranks, when its groups were ranks
    status: str

    @property
    def pbt(self) -> bool:
        """A population-based study (pbt, pb2): its lineage and schedules are drawn."""
        return self.scheduler.split("(")[0].strip().lower() in ("pbt", "pb2")


def study_info(store: RunStore, study_id: str) -> StudyInfo:
    row = store.study(study_id)
    options = row.get("options") or {}
    objectives = [o.strip() for o in (row.get("objective") or "figure of merit").split(",")]
    directions = [d.strip() for d in (row.get("direction") or "").split(",") if d.strip()]
    directions += ["minimize"] * (len(objectives) - len(directions))
    return StudyInfo(
        id=study_id,
        objectives=objectives,
        maximize=[d == "maximize" for d in directions[: len(objectives)]],
        searcher=row.get("searcher") or "",
        scheduler=str((options.get("study") or {}).get("scheduler") or "fifo"),
        space=study_space(row.get("space")),
        layout=options.get("layout"),
        status=row.get("status") or "",
    )


class StudyData:
    """A study's rows as last read, and what changed since the read before."""

    def __init__(self, store: RunStore, study_id: str):
        self.store, self.info = store, study_info(store, study_id)
        self.trials: list[TrialRow] = []
        self.events: list[dict[str, Any]] = []
        self.runs: dict[int, list[RunRow]] = {}  # trial -> its fold runs
        self._keys: set[tuple[int, str, int]] = set()
        self._newest = 0.0
        self._signature: tuple = ()
        self._digest: tuple = ()
        self.finished: set[int] = set()

    def poll(self) -> tuple[bool, list[dict[str, Any]], int]:
        """Read what is new: (whether any trial row changed, the new events, how many
        trials finished since the last poll). Nothing is read while the store's digest of
        the study stays the same."""
        digest = self.store.study_digest(self.info.id)
        if digest == self._digest:
            return False, [], 0
        before = self._digest or ((), (), None)
        self._digest = digest
        trials_changed, events_changed = digest[0] != before[0], digest[1] != before[1]
        changed = digest[2] != before[2]  # the study's status: the header says it
        self.info.status = digest[2] or self.info.status
        if trials_changed or events_changed:  # an exploit changes a running trial's parameters only
            trials = self.store.trials(self.info.id)
            signature = tuple((t.number, t.state, t.fom, t.epochs, t.group, t.ended, str(t.params)) for t in trials)
            if signature != self._signature:
                changed, self.trials, self._signature = True, trials, signature
                self.runs = self._runs()
        new = self._new_events() if events_changed else []
        finished = {t.number for t in self.trials if t.state in FINISHED} - self.finished
        self.finished |= finished
        return changed, new, len(finished)

    def _new_events(self) -> list[dict[str, Any]]:
        after = self._newest - CLOCK_SLACK if self._newest else None
        new = []
        for event in self.store.trial_events(self.info.id, after=after):
            key = (event["number"], event["kind"], event["epoch"])
            self._newest = max(self._newest, event["time"] or 0.0)
            if key not in self._keys:
                self._keys.add(key)
                new.append(event)
        self.events += new
        return new

    def _runs(self) -> dict[int, list[RunRow]]:
        runs: dict[int, list[RunRow]] = {}
        for run in self.store.runs(study=self.info.id):
            if run.trial is not None:
                runs.setdefault(run.trial, []).append(run)
        for found in runs.values():
            found.sort(key=lambda r: r.id)
        return runs

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.trials:
            out[t.state] = out.get(t.state, 0) + 1
        return out
