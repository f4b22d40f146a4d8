"""Per-epoch bookkeeping shared by the topologies: tallies, the epoch line, the decision."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors.numpy import save

from nbdist.backends.base import BatchStats
from nbdist.durable import make_dir, replace_file, write_json
from nbdist.errors import TrainingError

if TYPE_CHECKING:
    from nbdist.options import TrainOptions

__all__ = [
    "EpochTally",
    "epoch_metrics",
    "validation_due",
    "validation_values",
    "sample_validation",
    "reported_metrics",
    "format_epoch",
    "RunResult",
    "write_final",
]


@dataclass(slots=True)
class EpochTally:
    """Sums over one epoch's training updates (from every worker).

    Asynchronous, an epoch may end before a late worker (one silent for a whole epoch of
    the others: roles/master/state.py) has ended it: that worker's share of it is counted, when it
    comes, in the epoch open then (`late` of its samples), and `behind` says how many
    clients had not ended the epoch when it ended."""

    train: BatchStats = field(default_factory=BatchStats)
    ended: set = field(default_factory=set)  # the master's clients that finished this epoch
    updates: int = 0
    staleness_sum: int = 0
    staleness_max: int = 0
    started: float = field(default_factory=time.time)
    late: int = 0  # samples in `train` of epochs that had ended without them
    behind: int = 0  # clients that had not ended this epoch when it ended

    def add_staleness(self, value: int) -> None:
        self.updates += 1
        self.staleness_sum += value
        self.staleness_max = max(self.staleness_max, value)

    def to_json(self) -> list:
        t = self.train
        return [
            t.loss_sum,
            t.metric_sum,
            t.n,
            sorted(self.ended),
            self.updates,
            self.staleness_sum,
            self.staleness_max,
            self.late,
        ]

    @classmethod
    def from_json(cls, values: list) -> EpochTally:
        loss_sum, metric_sum, n, ended, updates, staleness_sum, staleness_max, *late = values
        return cls(
            BatchStats(float(loss_sum), float(metric_sum), int(n)),
            {int(c) for c in ended},
            int(updates),
            int(staleness_sum),
            int(staleness_max),
            late=int(late[0]) if late else 0,  # checkpoints written before `late` lack it
        )


def validation_due(options: TrainOptions, epoch: int) -> bool:
    """Whether the end of `epoch` (counted from 0) is validated: every --validate-every
    epochs, and the last epoch."""
    return (epoch + 1) % options.validate_every == 0 or epoch + 1 == options.epochs


def epoch_metrics(
    epoch: int,
    tally: EpochTally,
    val: BatchStats | None,
    seconds: float,
    metric_name: str | None,
    samples_seen: int | None = None,
) -> dict[str, Any]:
    """One epoch's record. `samples_seen`: the training samples, over all workers and
    from the start of the run, that the validated weights have learnt from (at the
    epoch's end where it was not validated)."""
    m: dict[str, Any] = {
        "epoch": epoch + 1,
        "train_loss": tally.train.loss,
        "samples": tally.train.n,
        "seconds": seconds,
        "samples_per_s": tally.train.n / seconds if seconds > 0 else float("nan"),
    }
    if metric_name:
        m[f"train_{metric_name}"] = tally.train.metric
    if samples_seen is not None:
        m["samples_seen"] = int(samples_seen)
    if val is not None:
        if not val.n:
            raise TrainingError(
                f"the validation set is empty (epoch {epoch + 1} validated on 0 samples): "
                f"give the model's data validation samples, or --val files that hold some"
            )
        m.update(validation_values(val, metric_name))
        if not math.isfinite(val.loss):
            raise TrainingError(
                f"the validation loss is {val.loss} after epoch {epoch + 1}: the weights diverged; "
                f"lower the learning rate"
            )
    if tally.updates:
        m["staleness_mean"] = tally.staleness_sum / tally.updates
        m["staleness_max"] = tally.staleness_max
    return m


def validation_values(val: BatchStats, metric_name: str | None) -> dict[str, float]:
    """val_loss and val_<metric> of one validation."""
    values = {"val_loss": val.loss}
    if metric_name:
        values[f"val_{metric_name}"] = val.metric
    return values


def sample_validation(samples_seen: int, val: BatchStats, metric_name: str | None) -> dict[str, Any]:
    """The values of a 'val' record (--validate-every-samples): the validation of the
    weights after `samples_seen` training samples. Not checked for divergence: the
    epoch's own validation decides that, as it decides early stopping and --target."""
    return {"samples_seen": int(samples_seen), **validation_values(val, metric_name)}


def reported_metrics(metric_name: str | None, *, staleness: bool) -> list[str]:
    """The names of the epoch metrics a run reports (what --monitor, --target and a
    study's --objective may name): those `epoch_metrics` writes, validation first.
    `staleness`: the run has a master, which counts how stale each update was."""
    tally = EpochTally(BatchStats(1.0, 1.0, 1))
    if staleness:
        tally.add_staleness(0)
    names = list(epoch_metrics(0, tally, BatchStats(1.0, 1.0, 1), 1.0, metric_name))
    return sorted(names, key=lambda name: (not name.startswith("val_"), not name.startswith("train_")))


def format_epoch(m: dict[str, Any], epochs: int) -> str:
    parts = [f"epoch {m['epoch']:>3}/{epochs}"]
    for key in m:
        if key.startswith(("train_", "val_")):
            parts.append(f"{key} {m[key]:.4f}")
    parts.append(f"{m['samples_per_s']:8.0f} samples/s")
    if "staleness_mean" in m:
        parts.append(f"staleness {m['staleness_mean']:.2f} (max {m['staleness_max']})")
    parts.append(f"{m['seconds']:.2f}s")
    return "  ".join(parts)


@dataclass(slots=True)
class RunResult:
    run_dir: Path
    history: list[dict[str, Any]]
    stop_reason: str
    seconds: float
    final: dict[str, Any]

    @property
    def weights_path(self) -> Path:
        return self.run_dir / "final" / "model.safetensors"

    @property
    def run_id(self) -> str:
        return self.run_dir.name


def write_final(
    run_dir: Path,
    named_arrays: dict[str, Any],
    history: list[dict[str, Any]],
    stop_reason: str,
    seconds: float,
    faults: dict[str, Any] | None = None,
) -> RunResult:
    """Final weights (safetensors, loadable with load_state_dict) and summary.json.
    `faults`: what the run lost on its way (dropped workers, samples, restarts), if anything."""
    final_dir = run_dir / "final"
    make_dir(final_dir)
    replace_file(final_dir / "model.safetensors", save(dict(named_arrays)))
    final = dict(history[-1]) if history else {}
    summary = {
        "stop_reason": stop_reason,
        "seconds": seconds,
        "epochs_run": len(history),
        "final": final,
        **(faults or {}),
        "history": history,
    }
    write_json(run_dir / "summary.json", summary, default=lambda v: None)
    return RunResult(run_dir, history, stop_reason, seconds, final)
