"""Stop requests and the decisions that end a run: signals, early stopping, targets, and
a study's word on each epoch of its trials."""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass

from nbdist.options import Target

__all__ = [
    "StopFlag",
    "EarlyStopping",
    "TrialStopping",
    "StopDecision",
    "VALIDATED_WITH",
    "catch_stop_signals_early",
    "stop_caught_early",
    "PAUSED_AT",
    "pause_reason",
    "FORWARDED_SIGNAL_FILE",
    "signal_name",
]

# In an epoch's record: the later epoch whose validation its val_* values are, the two
# having ended on one centre (an asynchronous master's, roles/master/state.py end_epochs).
# Patience counts that validation once, with the later epoch.
VALIDATED_WITH = "validated_with_epoch"

# A run paused by its study says so in its stop reason (the study resumes it later).
PAUSED_AT = "paused at epoch"


def pause_reason(epoch: int) -> str:
    return f"{PAUSED_AT} {epoch}: the study resumes it from this checkpoint"


# `python -m nbdist launch` passes every stop on to the ranks as SIGUSR1 (Open MPI's
# launcher kills the ranks soon after a SIGTERM), and first writes the name of the
# signal it was sent into the file this variable names, so that the run says which one
# stopped it (SIGTERM from the batch system, Ctrl-C, ...), not SIGUSR1.
FORWARDED_SIGNAL_FILE = "NBDIST_FORWARDED_SIGNAL_FILE"


def signal_name(signum: int) -> str:
    """The name of the signal that stopped this rank: for the launcher's SIGUSR1, the one
    the launcher was sent (FORWARDED_SIGNAL_FILE)."""
    name = signal.Signals(signum).name
    path = os.environ.get(FORWARDED_SIGNAL_FILE)
    if signum != signal.SIGUSR1 or not path:
        return name
    try:
        with open(path, encoding="ascii") as fh:
            forwarded = fh.read(32).strip()
    except (OSError, ValueError):
        return name  # another node (the file is on the launcher's), or no stop passed on
    return forwarded if forwarded in signal.Signals.__members__ else name


class StopFlag:
    """Set by SIGUSR1/SIGTERM (what `mpiexec` forwards, and what a notebook's job.stop()
    sends); the training loops read it at step boundaries and stop together."""

    __slots__ = ("requested", "_reason", "_signum")

    def __init__(self) -> None:
        self.requested = False
        self._reason = ""
        self._signum = 0

    def request(self, reason: str) -> None:
        if not self.requested:
            self.requested, self._reason = True, reason

    @property
    def reason(self) -> str:
        if not self._reason and self._signum:
            self._reason = f"stopped by {signal_name(self._signum)}"
        return self._reason

    def install(self) -> None:
        def handler(signum: int, _frame: object) -> None:
            # Only flags: the handler can run in the middle of an import (a rank still
            # starting), and anything that imports here, as opening a text file does
            # (its codec), breaks that import with a KeyError from importlib. The
            # signal's name is looked up when the reason is read.
            if not self.requested:
                self.requested, self._signum = True, signum

        for sig in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(sig, handler)
        if _CAUGHT_EARLY.requested:
            self.request(_CAUGHT_EARLY.reason)


# A stop signal that reaches a rank while it is still starting (importing torch, building
# its model) would kill it, since Python's default for SIGUSR1 and SIGTERM is to die: the
# job then ended with no run and no checkpoint. `python -m nbdist` catches them from its
# first line into this flag; the run's StopFlag takes the request over when it is
# installed, and the run stops at its first step boundary with a checkpoint.
_CAUGHT_EARLY = StopFlag()


def catch_stop_signals_early() -> None:
    _CAUGHT_EARLY.install()


def stop_caught_early() -> str:
    """The stop request caught before the run's own handlers were installed ('' if none)."""
    return _CAUGHT_EARLY.reason


@dataclass(slots=True)
class StopDecision:
    stop: bool
    reason: str = ""


class EarlyStopping:
    """Patience on a validation metric; minimised unless its name says accuracy."""

    __slots__ = ("monitor", "patience", "min_delta", "maximize", "best", "bad_rounds", "target")

    def __init__(self, monitor: str, patience: int | None, min_delta: float, target: Target | None):
        self.monitor, self.patience, self.min_delta, self.target = monitor, patience, min_delta, target
        self.maximize = "acc" in monitor or monitor.endswith("auc")
        self.best = -math.inf if self.maximize else math.inf
        self.bad_rounds = 0

    def update(self, metrics: dict[str, float]) -> StopDecision:
        if self.target is not None and self.target.reached(metrics):
            return StopDecision(True, f"target {self.target} reached")
        if self.patience is None or self.monitor not in metrics or VALIDATED_WITH in metrics:
            return StopDecision(False)
        value = metrics[self.monitor]
        improved = value > self.best + self.min_delta if self.maximize else value < self.best - self.min_delta
        if improved:
            self.best, self.bad_rounds = value, 0
            return StopDecision(False)
        self.bad_rounds += 1
        if self.bad_rounds >= self.patience:
            return StopDecision(True, f"early stopping: {self.monitor} did not improve for {self.patience} validations")
        return StopDecision(False)

    def to_json(self) -> dict:
        return {"best": self.best if math.isfinite(self.best) else None, "bad_rounds": self.bad_rounds}

    def load_json(self, data: dict) -> None:
        if data.get("best") is not None:
            self.best = float(data["best"])
        self.bad_rounds = int(data.get("bad_rounds", 0))


class TrialStopping(EarlyStopping):
    """A study's trial decides at each epoch's end, where early stopping does (every rank
    of an allreduce run, the top master): its own rules, then the pause its scheduler set
    (`pause_at`: a rung, a PBT interval), then the study's word on the epoch, which the
    run's leader asks for (`ask(epoch, metrics)`: '' to go on, else why to stop) and, where
    every rank decides, `share` hands to the others. The run thus stops right after the
    epoch the study judged, keeping its checkpoint there."""

    __slots__ = ("pause_at", "ask", "share")

    def __init__(
        self,
        monitor: str,
        patience: int | None,
        min_delta: float,
        target: Target | None,
        *,
        pause_at: int | None = None,
        ask: Callable[[int, dict], str] | None = None,
        share: Callable[[str], str] | None = None,
    ):
        super().__init__(monitor, patience, min_delta, target)
        self.pause_at, self.ask, self.share = pause_at, ask, share

    def update(self, metrics: dict[str, float]) -> StopDecision:
        decision = super().update(metrics)
        epoch = int(metrics.get("epoch", 0))
        word = self.ask(epoch, metrics) if self.ask is not None else ""
        if self.share is not None:
            word = self.share(word)
        if decision.stop:
            return decision
        if self.pause_at is not None and epoch >= self.pause_at:
            return StopDecision(True, pause_reason(epoch))
        return StopDecision(True, word) if word else decision
