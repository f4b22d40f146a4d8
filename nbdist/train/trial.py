"""What a run knows of the study it trains for: the trial's tag, and the check that the
metrics its options name are ones the run reports."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from nbdist.errors import OptionsError
from nbdist.options import TrainOptions, parse_target
from nbdist.specs import did_you_mean

__all__ = ["TrialTag", "MetricNameError", "check_metric_names"]


class MetricNameError(OptionsError):
    """A metric named by an option (--monitor, --target, a study's --objective) that the
    run does not report: the same mistake for every run with these options."""


@dataclass(frozen=True, slots=True)
class TrialTag:
    """The study and trial a run trains for. `watched`: the metrics the study reads from
    the run's epochs, each with the option that names it, e.g. (("--objective val_acc", "val_acc"),).
    `pause_at`: the epoch after which the run stops, keeping its checkpoint, for the study
    to resume it (a rung, a PBT interval). `asks`: the run's leader tells the study each
    epoch and takes its word (`ask`, on the leader only: train/stopping.TrialStopping).
    `keep`: called with each share of a checkpoint this rank writes (label, arrays, scalars)."""

    study: str
    number: int
    watched: tuple[tuple[str, str], ...] = ()
    pause_at: int | None = None
    asks: bool = False
    ask: Callable[[int, dict], str] | None = None
    keep: Callable[[str, dict, dict], None] | None = None


def check_metric_names(options: TrainOptions, trial: TrialTag | None, reported: list[str]) -> None:
    """Every metric an option names is one the run reports, or one error listing those."""
    named = [(f"--monitor {options.monitor}", options.monitor)]
    if options.target:
        named.append((f"--target {options.target!r}", parse_target(options.target).metric))
    named += trial.watched if trial else ()
    for given, name in named:
        if name not in reported:
            raise MetricNameError(f"{given}: this run reports {', '.join(reported)}{did_you_mean(name, reported)}")
