"""What a trial's segment came to, from its fold runs' outcomes: paused where its
scheduler said, trained to its end, stopped early by the study (pruned, out of budget),
or failed; its figure of merit and, in a multi-objective study, its value for each
objective, each the mean over its folds.

A trial the study stopped is what it is: its value is the objective after the epoch it
was judged on (every fold had reported it), and its epochs are that epoch's, not a
finished trial's (nbdist.hpo.searcher's `stopped_at`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nbdist.hpo.schedulers.base import COMPLETE, FAILED, PAUSED, STOPPED
from nbdist.hpo.trial import PAUSED_AT, Segment, Trial, TrialError, fold_fom

__all__ = ["Settled", "settle", "mean_metrics", "pareto_front", "dominates"]


@dataclass(slots=True)
class Settled:
    outcome: str  # the scheduler's word: PAUSED, COMPLETE, STOPPED or FAILED
    state: str  # the trial's row: paused, complete, pruned, stopped or failed
    epochs: int
    fom: float | None = None
    fom_std: float | None = None
    folds: list[float] = field(default_factory=list)  # each fold's figure of merit
    values: list[float] | None = None  # one per objective (multi-objective studies)
    error: str | None = None
    means: dict[str, float] = field(default_factory=dict)  # every final metric, mean over folds


def settle(trial: Trial, segment: Segment | None, folds: dict[int, Any], objectives: Sequence[str]) -> Settled:
    """`folds`: fold -> FoldOutcome (final metrics, error, stop reason) of the segment."""
    errors: dict[int, str] = {}
    values: dict[int, list[float]] = {}
    for fold, outcome in folds.items():
        if outcome.error:
            errors[fold] = outcome.error
            continue
        try:
            values[fold] = [fold_fom(outcome.final or {}, name) for name in objectives]
        except TrialError as exc:
            if not trial.stop_reason:  # a stopped fold's value is its curve's
                errors[fold] = str(exc)
    if trial.stop_reason:
        return _stopped(trial)
    if errors:
        error = "; ".join(f"fold {f}: {e}" for f, e in sorted(errors.items()))
        return Settled(FAILED, "failed", trial.epochs, error=error)
    finals = [o.final or {} for o in folds.values()]
    epochs = min((int(f.get("epoch", trial.epochs)) for f in finals), default=trial.epochs)
    paused = (
        segment is not None
        and segment.pause_at is not None
        and all(o.stop_reason.startswith(PAUSED_AT) for o in folds.values())
    )
    foms = [values[f][0] for f in sorted(values)]
    means = [statistics.fmean(v[i] for v in values.values()) for i in range(len(objectives))]
    return Settled(
        PAUSED if paused else COMPLETE,
        "paused" if paused else "complete",
        segment.pause_at if paused and segment is not None and segment.pause_at else epochs,
        fom=means[0],
        fom_std=statistics.pstdev(foms) if len(foms) > 1 else 0.0,
        folds=foms,
        values=means if len(objectives) > 1 else None,
        means=mean_metrics(finals),
    )


def _stopped(trial: Trial) -> Settled:
    """A trial the study stopped: its value after the epoch it was judged on, or else the
    last epoch every fold reported."""
    epoch = trial.pruned_at
    if epoch is None:
        reported = [e for e, v in trial.curve.items() if v]
        epoch = max(reported, default=trial.epochs)
    value = trial.mean_at(epoch)
    foms = list(trial.curve.get(epoch, {}).values())
    state = "pruned" if trial.stop_reason.startswith("pruned") else "stopped"
    return Settled(
        STOPPED,
        state,
        epoch,
        fom=value,
        fom_std=statistics.pstdev(foms) if len(foms) > 1 else (0.0 if foms else None),
        folds=foms,
    )


def mean_metrics(finals: list[dict[str, Any]]) -> dict[str, float]:
    keys = {k for f in finals for k, v in f.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {k: statistics.fmean(float(f[k]) for f in finals if k in f) for k in keys}


def dominates(a: Sequence[float], b: Sequence[float], maximize: Sequence[bool]) -> bool:
    """Whether `a` is at least as good as `b` in every objective and better in one."""
    at_least = all((x >= y) if up else (x <= y) for x, y, up in zip(a, b, maximize, strict=True))
    return at_least and any(x != y for x, y in zip(a, b, strict=True))


def pareto_front(rows: list[dict[str, Any]], maximize: Sequence[bool]) -> list[dict[str, Any]]:
    """The complete trials that no other complete trial dominates, by trial number."""
    done = [r for r in rows if r["state"] == "complete" and r.get("values") is not None]
    return sorted(
        (r for r in done if not any(dominates(o["values"], r["values"], maximize) for o in done if o is not r)),
        key=lambda r: r["number"],
    )
