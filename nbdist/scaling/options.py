"""The options of a scaling study: one typed config behind `python -m nbdist scale`,
`%distnn scale` and `nbdist.scale(...)` (the same flags as TrainOptions use: add_arguments)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, fields
from typing import Any

from nbdist.errors import OptionsError
from nbdist.options import _opt, check_types
from nbdist.scaling.network import DEFAULT_NETWORK, MEASURED, NETWORKS, network
from nbdist.scaling.setups import SetUp, master_worker_rules
from nbdist.specs import SpecError, parse_spec, unknown_name

__all__ = ["ScaleOptions", "DEFAULT_SETUPS", "parse_setups", "parse_ranks", "default_ranks", "SCALINGS"]

DEFAULT_SETUPS = "allreduce downpour easgd gem adag dynsgd downpour(masters=2) downpour(sync_every=4)"
SCALINGS = ("weak", "strong")
# The ranks write a record every 0.5 s (train/loop.py, REPORT_EVERY) and a point's first
# and last records are left out (measure.py): a shorter point can leave nothing to
# measure on a loaded node, where its steps run faster than the calibration timed them.
MIN_POINT_SECONDS = 1.5
_SETUP_KEYS = ("masters", "sync_every", "synchronous")


@dataclass
class ScaleOptions:
    model: str | None = _opt(None, "Python file defining build_model() (and optionally loss, metric, data)")
    train: str | None = _opt(
        None, "training data: HDF5 files, comma-separated paths or globs (replaces the model's load_data)"
    )
    val: str | None = _opt(None, "validation data: HDF5 files or globs, like --train")
    data_keys: str = _opt("features,labels", "names of the features and labels datasets in the HDF5 files")
    ranks: str | None = _opt(
        None,
        "rank counts to measure, e.g. '1,2,4' (default: each up to 8, 4 with --quick, then doubling, "
        "and the job's ranks)",
    )
    setups: str = _opt(
        DEFAULT_SETUPS,
        "set-ups to measure and predict, separated by spaces: allreduce, a master/worker rule (downpour, easgd, "
        "gem, adag, dynsgd, eamsgd, diloco, async_local_sgd, or a registered one), a rule with masters=M "
        "(sub-masters), sync_every=K or synchronous=True, e.g. 'allreduce gem downpour(masters=2)'",
    )
    scaling: str = _opt(
        "weak,strong",
        "weak (--batch-size per worker, the total batch grows with the workers), strong (the total batch of "
        "the largest point, shared by the workers) or both",
    )
    batch_size: int = _opt(32, "samples per batch per worker (weak scaling), and what the calibration times")
    quick: bool = _opt(False, "shorter points, and the rules other than downpour at the largest rank count only")
    seconds: float | None = _opt(
        None, f"seconds each measured point trains (default 3; {MIN_POINT_SECONDS} with --quick, the least)"
    )
    repeats: int = _opt(1, "runs of each point; the fastest is kept (background load only slows a run)")
    network: str | None = _opt(
        None,
        f"network between nodes for the predictions: {MEASURED} (what the calibration measured between two of "
        f"the job's nodes) or a preset, {', '.join(NETWORKS)} (default: {MEASURED} where the job spans nodes, "
        f"else {DEFAULT_NETWORK})",
        choices=(MEASURED, *NETWORKS),
    )
    cores_per_node: int | None = _opt(None, "cores per node of the predicted allocation (default: this node's)")
    cores: int | None = _opt(None, "cores the job's ranks share on this node (default: what this process may use)")
    max_ranks: int = _opt(1024, "predict up to this many ranks")
    target_epochs: float = _opt(
        10.0, "epochs of the training set one worker of --batch-size needs to reach your target (time to target)"
    )
    noise_scale: float | None = _opt(None, "the gradient noise scale to assume (default: measured on the model)")
    runs_dir: str = _opt("runs", "where the study's directory is created")
    store: str | None = _opt(None, "run store the study is recorded in (default: RUNS_DIR/nbdist.db; 'off': none)")
    run_name: str | None = _opt(None, "name of the study (default: time and model)")
    seed: int = _opt(0, "seed for weights and data")
    threads: int = _opt(1, "framework threads per rank")
    keep_runs: bool = _opt(False, "keep the measured points' run directories")

    def validate(self) -> ScaleOptions:
        check_types(self)
        if not self.model:
            raise OptionsError("--model is required: a Python file that defines build_model()")
        for name in ("batch_size", "repeats", "max_ranks"):
            if getattr(self, name) < 1:
                raise OptionsError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("cores_per_node", "cores"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise OptionsError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        if self.seconds is not None and not self.seconds >= MIN_POINT_SECONDS:
            raise OptionsError(
                f"--seconds {self.seconds}: a measured point needs at least {MIN_POINT_SECONDS} s (its ranks "
                f"record twice a second, and its first and last records are left out); give "
                f"--seconds {MIN_POINT_SECONDS} or more"
            )
        if not self.target_epochs > 0:
            raise OptionsError(f"--target-epochs must be above 0, got {self.target_epochs}")
        if self.noise_scale is not None and not self.noise_scale > 0:
            raise OptionsError(f"--noise-scale must be above 0, got {self.noise_scale}")
        if self.network not in (None, MEASURED):
            network(self.network)
        self.scalings()
        parse_setups(self.setups)
        if self.ranks is not None:
            parse_ranks(self.ranks)
        if bool(self.train) != bool(self.val):
            raise OptionsError("--train and --val go together: the HDF5 files to train and to validate on")
        if self.run_name is not None and "/" in self.run_name:
            raise OptionsError(f"--run-name {self.run_name!r}: a directory name inside --runs-dir, without '/'")
        return self

    def scalings(self) -> list[str]:
        chosen = [s.strip() for s in self.scaling.split(",") if s.strip()]
        wrong = [s for s in chosen if s not in SCALINGS]
        if wrong or not chosen:
            raise OptionsError(f"--scaling {self.scaling!r}: choose weak, strong or weak,strong")
        return chosen

    @property
    def point_seconds(self) -> float:
        return self.seconds if self.seconds is not None else (MIN_POINT_SECONDS if self.quick else 3.0)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_args(cls, args: Any) -> ScaleOptions:
        """The options of `scale`'s parsed command line (argparse), its defaults where not given."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None})

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ScaleOptions:
        unknown = sorted(set(values) - {f.name for f in fields(cls)})
        if unknown:
            raise OptionsError(f"unknown scale option(s): {', '.join(unknown)}")
        return cls(**values)

    def replace(self, **changes: Any) -> ScaleOptions:
        return dataclasses.replace(self, **changes)


def parse_ranks(text: str) -> list[int]:
    """'1,2,4' or '1-4' -> sorted rank counts, or one error."""
    counts: set[int] = set()
    for part in (p.strip() for p in text.split(",") if p.strip()):
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not match:
            raise OptionsError(f"--ranks {text!r}: write rank counts like 1,2,4 or 1-4")
        low, high = int(match.group(1)), int(match.group(2) or match.group(1))
        if low < 1 or high < low:
            raise OptionsError(f"--ranks {text!r}: {part} is not a range of rank counts of at least 1")
        counts.update(range(low, high + 1))
    if not counts:
        raise OptionsError(f"--ranks {text!r}: give at least one rank count")
    return sorted(counts)


def default_ranks(size: int, quick: bool = False) -> list[int]:
    """The rank counts a study of `size` ranks measures when --ranks is not given: each one
    up to 8 (4 with --quick), where the small counts and the first oversubscribed ones
    are, then doubling, and `size` itself; a 64-rank job measures 10 counts, not 64."""
    every = 4 if quick else 8
    counts = set(range(1, min(size, every) + 1)) | {size}
    doubled = every * 2
    while doubled < size:
        counts.add(doubled)
        doubled *= 2
    return sorted(counts)


def parse_setups(text: str) -> list[SetUp]:
    """'allreduce downpour(masters=2) gem' -> SetUps, or one error naming the bad one."""
    items = re.findall(r"[^\s(]+(?:\([^)]*\))?", text)
    if not items:
        raise OptionsError("--setups is empty: give e.g. 'allreduce downpour'")
    setups = []
    for item in items:
        try:
            spec = parse_spec(item, what="set-up")
        except SpecError as exc:
            raise OptionsError(str(exc)) from None
        if spec.name == "allreduce":
            if spec.kwargs:
                raise OptionsError(f"set-up {item!r}: allreduce takes no parameters")
            setups.append(SetUp("allreduce"))
            continue
        rules = master_worker_rules()
        if spec.name not in rules:
            raise unknown_name("set-up", spec.name, ["allreduce", *rules])
        wrong = sorted(set(spec.kwargs) - set(_SETUP_KEYS))
        if wrong:
            raise OptionsError(f"set-up {item!r}: {', '.join(wrong)} unknown; a rule takes {', '.join(_SETUP_KEYS)}")
        default_every = rules[spec.name].default_sync_every
        masters, every = spec.kwargs.get("masters", 1), spec.kwargs.get("sync_every", default_every)
        synchronous = spec.kwargs.get("synchronous", False)
        if not (isinstance(masters, int) and masters >= 1 and isinstance(every, int) and every >= 1):
            raise OptionsError(f"set-up {item!r}: masters and sync_every are whole numbers of at least 1")
        if not isinstance(synchronous, bool):
            raise OptionsError(f"set-up {item!r}: synchronous is True or False")
        setups.append(SetUp("master-worker", spec.name, masters, every, synchronous))
    return setups
