"""What a failed job tells its user: one message, led by the failure that came first.

The ranks of a notebook job report their ends to the client (`nbdist.job.Job`); these
functions turn the failures among them into the one `JobError` the user reads.
"""

from __future__ import annotations

from typing import Any

from nbdist.cluster import HEAL_HINT
from nbdist.engine import EngineOutcome
from nbdist.errors import TrainingError
from nbdist.liveness import DeadEngine
from nbdist.metrics.record import stopped_on_request

__all__ = ["JobError", "one_error", "ranks_text", "remote_text", "run_ending", "unwrap", "verdict"]

# How much later than the MPI peers of a dead engine the client may hear of its death.
DEATH_NOTICE_SECONDS = 1.0


class JobError(TrainingError):
    """A job that failed: the message names the rank(s) and what happened there."""

    def __init__(self, message: str, detail: str = ""):
        super().__init__(message)
        self.detail = detail  # a traceback from the rank, for unexpected failures


def unwrap(value: Any) -> Any:
    return value[0] if isinstance(value, list) and len(value) == 1 else value


def remote_text(value: Any) -> str:
    # ipyparallel's RemoteError carries the remote exception's name and value.
    name, text = getattr(value, "ename", None), getattr(value, "evalue", None)
    if name:
        return f"{name}: {text}"
    return f"{type(value).__name__}: {value}"


def _when(outcome: EngineOutcome) -> float:
    return outcome.failed_at if outcome.failed_at is not None else float("inf")


def ranks_text(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, sorted(ranks)))}"


def one_error(errors: list[EngineOutcome], ranks_in_job: int, dead: dict[int, DeadEngine] | None = None) -> JobError:
    """One message for the user, led by the failure that came first: the same error from
    several ranks is said once; a rank whose engine died is named with its host and pid
    (those that died with it after it, once); later, different failures follow."""
    dead = dead or {}
    parts: list[tuple[float, str]] = []
    died = sorted((o for o in errors if o.rank in dead), key=_when)
    if died:
        first = dead[died[0].rank]
        text = f"rank {first.rank} (engine {first.engine_id} on {first.host}, pid {first.pid}) died: {first.why}"
        if len(died) > 1:
            text += f"; {ranks_text([o.rank for o in died[1:]])} died with it"
        # The client hears of a death through the controller, after the peers' MPI calls
        # already failed on it: those errors are its consequences, not earlier failures.
        parts.append((_when(died[0]) - DEATH_NOTICE_SECONDS, text))
    by_text: dict[str, list[EngineOutcome]] = {}
    for o in sorted((o for o in errors if o.rank not in dead), key=_when):
        by_text.setdefault(o.error, []).append(o)
    for text, group in by_text.items():
        ranks = [o.rank for o in group]
        if "rank" not in text and not group[0].user_error:
            # User errors were agreed by all ranks and already say where; name the rest.
            text = f"{text} (on {'every rank' if len(ranks) == ranks_in_job else ranks_text(ranks)})"
        parts.append((_when(group[0]), text))
    parts.sort(key=lambda part: part[0])
    lead, *later = [text for _, text in parts]
    detail = next((o.detail for o in sorted(errors, key=_when) if o.detail), "")
    hint = "; its traceback: job.error.detail" if detail else ""
    return JobError(lead + (f"; then {'; '.join(later[:2])}" if later else "") + hint, detail)


def verdict(
    outcomes: list[EngineOutcome],
    dead: dict[int, DeadEngine],
    stuck_ranks: list[int],
    abandon_seconds: float,
    abandon_why: str,
) -> tuple[JobError | None, str | None]:
    """How a job's ranks ended, told once: the error (None: none failed) and a warning
    (a run that went on without ranks that died and ended well)."""
    # The ranks that gave up because of another's failure say nothing new.
    errors = [o for o in outcomes if o.error and not o.abandoned and o.rank not in stuck_ranks]
    gave_up = any(o.abandoned for o in outcomes)
    if not errors and not stuck_ranks and not gave_up:
        return None, None
    if dead and not stuck_ranks and any(o.result is not None for o in outcomes) and all(o.rank in dead for o in errors):
        # The run went on without them (an asynchronous master dropped them, or the
        # ranks left restarted from the last checkpoint) and ended well.
        return None, (
            f"{one_error(errors, len(outcomes), dead)}; the run went on without "
            f"{ranks_text(sorted(dead))} and ended well; {HEAL_HINT}"
        )
    first = one_error(errors, len(outcomes), dead) if errors else None
    said = [str(first) if first is not None else f"the ranks {abandon_why or 'were told to give up'}"]
    if stuck_ranks:
        said.append(
            f"{ranks_text(stuck_ranks)} still running {abandon_seconds:g} s after being told to give "
            f"up (SIGUSR2): blocked in MPI or in the model's code"
        )
    elif first is None:
        said.append("they gave up (SIGUSR2), without a final checkpoint; the cluster is ready for the next job")
    if stuck_ranks or dead:
        said.append(HEAL_HINT)
    return JobError("; ".join(said), first.detail if first is not None else ""), None


def run_ending(
    error: JobError | None, outcomes: list[EngineOutcome] | None, run_id: str
) -> tuple[str, str | None, dict[str, Any] | None]:
    """How one run of a job ended, as the run store records it: state, reason, final metrics."""
    if error is not None:
        return "failed", str(error), None
    result = next(
        (o.result for o in outcomes or [] if o.result is not None and getattr(o.result, "run_id", None) == run_id),
        None,
    )
    if result is None:
        return "failed", "the job ended without a result", None
    if getattr(result, "error", None):
        return "failed", result.error, None
    return ("stopped" if stopped_on_request(result.stop_reason) else "completed"), result.stop_reason, result.final
