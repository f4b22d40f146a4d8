"""What a scheduler decides, behind one small interface: which trial a free group of ranks
trains next, and for how many epochs.

A trial trains in segments. A segment starts a new trial (the searcher proposes its
parameters) or resumes a paused one from its checkpoint, and ends when the trial reaches
the epoch the scheduler named (`pause_at`: a rung, a PBT interval), keeping its checkpoint,
or at the trial's last epoch. Between segments a trial is paused: nothing of it runs.

    scheduler = SCHEDULERS.build("asha(min_epochs=1, reduction=3)")
    scheduler.bind(Setting(epochs=27, groups=3, ...))    # one clear error for what cannot fit
    work = scheduler.next(new_allowed=True)              # a free group: Work or None (wait)
    scheduler.started(number, work)                      # the trial it became
    scheduler.reached(number, epochs, value)             # a segment ended there, with that value

Schedulers hold no MPI and no framework: the runner (nbdist.hpo.runner) carries their
decisions out, and their state is JSON, saved with the searcher's so that a study resumes
where it stopped.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from nbdist.errors import UserError
from nbdist.hpo.space import Space
from nbdist.registry import Registry

__all__ = [
    "Scheduler",
    "SchedulerError",
    "Setting",
    "Work",
    "Exchange",
    "SCHEDULERS",
    "better",
    "PAUSED",
    "COMPLETE",
    "STOPPED",
    "FAILED",
]

# How a segment of a trial ended: paused where the scheduler said (it may go on), or done:
# trained to its end, stopped early (pruned, out of budget: its value is an earlier
# epoch's), or failed.
PAUSED, COMPLETE, STOPPED, FAILED = "paused", "complete", "stopped", "failed"


class SchedulerError(UserError, ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Setting:
    """The study a scheduler is bound to."""

    epochs: int  # the trials' epochs (--epochs)
    groups: int  # trials trained at once
    trials: int  # --trials
    space: Space
    maximize: bool
    seed: int = 0
    objectives: int = 1
    in_process: bool = False  # a Python function's study (nbdist.hpo.optimize): no ranks to copy state between
    # Whether a parameter may change while a trial trains (PBT's explore step): by the
    # name, what the run makes of it (nbdist.hpo.trial.changeable).
    changeable: Callable[[str], bool] = lambda name: False
    changeable_help: str = ""


@dataclass(frozen=True, slots=True)
class Exchange:
    """PBT's exploit: before training on, the trial takes trial `source`'s training state
    (weights, optimiser, rule) as it was at `epoch`."""

    source: int
    epoch: int


@dataclass(slots=True)
class Work:
    """What a free group does next: resume paused trial `trial` (None: start a new one)
    until `pause_at` (None: to its last epoch), with an `exchange` first (PBT); `params`:
    a new trial's parameters, once the searcher has given them. `tag` is the scheduler's own (a Hyperband bracket)."""

    trial: int | None
    pause_at: int | None
    params: dict[str, Any] | None = None
    exchange: Exchange | None = None
    tag: int | None = None
    send_to: list[int] = field(default_factory=list)  # PBT: trials that take this one's state first


def better(a: float, b: float, maximize: bool) -> bool:
    return a > b if maximize else a < b


class Scheduler(ABC):
    """Subclasses give `name`, `next`, and keep what they need in `reached`. Their constructor
    keywords are the user's parameters (`asha(min_epochs=1)`)."""

    name: ClassVar[str]
    parameter_help: ClassVar[Mapping[str, str]] = {}
    # The runs wait for the coordinator's word at each epoch (a pruner): it can stop a
    # trial right after the epoch it judged. Others decide at segment ends only.
    decides_each_epoch: ClassVar[bool] = False
    # Trials train in several segments: schedulers that pause trials and resume them.
    pauses: ClassVar[bool] = False

    setting: Setting

    def bind(self, setting: Setting) -> None:
        """Check the scheduler against the study (one SchedulerError naming what to change)."""
        self.setting = setting
        if setting.objectives > 1 and self.name != "fifo":
            raise SchedulerError(
                f"--scheduler {self.name} ranks trials by one value; a study of {setting.objectives} "
                f"objectives trains every trial to the end: use --scheduler fifo (or one --objective)"
            )

    @property
    def epochs(self) -> int:
        """How many epochs a trial trains in all when nothing stops it."""
        return self.setting.epochs

    def trials(self) -> int:
        """How many trials the study starts in all."""
        return self.setting.trials

    @abstractmethod
    def next(self, new_allowed: bool, epochs_left: float) -> Work | None:
        """What a free group trains next; `new_allowed`: the study's budget lets a new trial
        start; `epochs_left`: what is left of its budget of epochs (work that needs more
        must wait)."""

    def params_for(self, work: Work, source_params: Mapping[str, Any]) -> dict[str, Any]:
        """The parameters a trial trains with after `work.exchange` (PBT's explore step)."""
        return dict(source_params)

    def explore_note(self, work: Work) -> dict[str, Any]:
        """How `params_for` chose for `work`, recorded with its exploit (PB2's acquisition)."""
        return {}

    def started(self, number: int, work: Work) -> None:  # noqa: B027 - a hook: by default nothing
        """`work` became trial `number` on a group (a new trial: `work.params` are its parameters)."""

    def on_epoch(self, number: int, epoch: int, value: float) -> str:
        """A running trial's objective after `epoch` epochs: '' to go on, else why to stop it."""
        return ""

    def reached(self, number: int, epochs: int, value: float | None, outcome: str) -> None:  # noqa: B027 - a hook: by default nothing
        """A segment of trial `number` ended after `epochs` epochs with `value` (None: it
        failed); `outcome`: PAUSED, COMPLETE, STOPPED or FAILED."""

    def describe(self, number: int, epochs: int) -> str:
        """How a trial paused after `epochs` epochs is told: 'rung 1 (epoch 3)'."""
        return f"epoch {epochs}"

    def notes(self) -> list[str]:
        return []

    def state(self) -> dict[str, Any]:
        return {}

    def load_state(self, state: Mapping[str, Any]) -> None:  # noqa: B027 - a hook: by default nothing
        pass


SCHEDULERS: Registry[Scheduler] = Registry("scheduler")
