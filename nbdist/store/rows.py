"""The rows a run store hands out (a run, a trial), the states they take, and how their
JSON columns are written and read: what the store's modules share."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from nbdist.store.dialects import mask_url

__all__ = [
    "RunRow",
    "TrialRow",
    "RUN_STATES",
    "TRIAL_STATES",
    "STALE_SECONDS",
    "json_text",
    "from_json",
    "without_passwords",
    "process_alive",
]

# A writer (a run's, a study job's) silent this long is taken for gone.
STALE_SECONDS = 60.0
RUN_STATES = ("running", "completed", "stopped", "failed", "killed")
TRIAL_STATES = ("running", "paused", "complete", "pruned", "stopped", "failed")


@dataclass(frozen=True, slots=True)
class RunRow:
    id: str
    kind: str
    status: str
    reason: str | None
    run_dir: str | None
    options: dict[str, Any]
    layout: dict[str, Any]
    final: dict[str, Any]
    study: str | None
    trial: int | None
    started: float | None
    ended: float | None
    heartbeat: float | None


@dataclass(frozen=True, slots=True)
class TrialRow:
    study: str
    number: int
    params: dict[str, Any]
    state: str  # running | paused | complete | pruned | stopped | failed
    fom: float | None
    fom_std: float | None
    folds: list[float]
    generation: int | None
    group: int | None
    error: str | None
    started: float | None
    ended: float | None
    owner: str | None = None  # the job (coordinator) that trains or trained it
    goal_reached: bool = False  # it reached the study's --goal: every job of the study stops
    epochs: int | None = None  # the epochs it trained (fewer than the study's when stopped early)
    values: list[float] | None = None  # a multi-objective study's values, one per objective


def json_text(value: Any) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"), default=str)


def without_passwords(value: Any) -> Any:
    """Options as stored: any URL in them (--store postgresql://...) without its password."""
    if isinstance(value, dict):
        return {k: without_passwords(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_passwords(v) for v in value]
    return mask_url(value) if isinstance(value, str) else value


def from_json(text: str | None, empty: Any) -> Any:
    return empty if text is None else json.loads(text)


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True
