"""From a calibration and the measured points to what a study reports: each measured
point's prediction and error, the predicted curves to many ranks, the master's saturation,
goodput and time to target per set-up, and the recommended set-up. Pure: no MPI."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from nbdist.errors import OptionsError
from nbdist.scaling.goodput import goodput
from nbdist.scaling.inputs import Calibration
from nbdist.scaling.model import PerformanceModel
from nbdist.scaling.network import DEFAULT_NETWORK, MEASURED, NETWORKS, Machine, Network, measured_network, network
from nbdist.scaling.setups import Point, SetUp
from nbdist.scaling.simulator import Simulator

__all__ = [
    "Comparison",
    "Analysis",
    "analyse",
    "predicted_point",
    "STALENESS_CYCLES",
    "curve_ranks",
    "machine_of",
    "between_nodes",
    "WITHIN_BEST",
]

# The recommendation: the fewest ranks whose time to target is within this share of the
# fastest predicted (beyond it, more ranks buy little).
WITHIN_BEST = 0.10


@dataclass(slots=True)
class Comparison:
    """A measured point beside the model's prediction for it (and the simulator's staleness)."""

    measured: Point
    predicted: Point

    @property
    def error(self) -> float:
        """(predicted - measured) / measured samples/s."""
        return self.predicted.samples_per_s / self.measured.samples_per_s - 1.0

    @property
    def staleness_error(self) -> float | None:
        m, p = self.measured.staleness_mean, self.predicted.staleness_mean
        if m is None or p is None or not self.measured.setup.asynchronous or m <= 0:
            return None
        return p / m - 1.0

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Comparison:
        """What a study recorded of a point ('measured' records: its measurement and prediction)."""
        return cls(Point.from_dict(values["measured"]), Point.from_dict(values["predicted"]))

    def to_dict(self) -> dict[str, Any]:
        return {
            "measured": self.measured.to_dict(),
            "predicted": self.predicted.to_dict(),
            "error": self.error,
            "staleness_error": self.staleness_error,
        }


@dataclass
class Analysis:
    comparisons: list[Comparison]
    curves: list[Point]
    saturation: dict[str, float]
    goodput: list[dict[str, Any]]
    recommendation: dict[str, Any]
    machine: str
    notes: list[str] = field(default_factory=list)

    @property
    def median_error(self) -> float | None:
        errors = [abs(c.error) for c in self.comparisons]
        return statistics.median(errors) if errors else None

    @property
    def worst_error(self) -> float | None:
        errors = [abs(c.error) for c in self.comparisons]
        return max(errors) if errors else None


# The simulator's cycles for a measured point's predicted staleness: enough that its mean
# does not move with the draws, as it does over the few cycles a curve's point plays.
STALENESS_CYCLES = 2000

# The least of the node's cores a point is taken to have had, however busy the others kept it.
MIN_CORES = 0.2


def machine_of(point: Point, cores: int, network_name: str | Network) -> Machine:
    """The node a measured point ran on: `cores` of its own, less what other processes used
    of them meanwhile (`extra["others"]`, load.py)."""
    others = (point.extra or {}).get("others", 0.0)
    return Machine(max(cores - others, MIN_CORES), network(network_name), nodes=1, physical=cores)


def predicted_point(model: PerformanceModel, point: Point) -> Point:
    """The model's prediction for a measured point. An asynchronous set-up's staleness, its
    mean and 99th percentile, is the simulator's: how many updates meet at the master in
    one pass (and so how stale each is) depends on the spread of the workers' step times,
    which the mean-value model does not see."""
    predicted = model.predict(point.setup, point.ranks, point.batch, point.scaling)
    if point.setup.asynchronous:
        played = Simulator(model).run(point.setup, point.ranks, point.batch, cycles=STALENESS_CYCLES)
        predicted.staleness_mean, predicted.staleness_p99 = played.staleness_mean, played.staleness_p99
    return predicted


def between_nodes(calibration: Calibration, name: str | None) -> Network:
    """--network: `name`'s preset, or the link the calibration measured between two of the
    job's nodes (`measured`, and the default where it measured one)."""
    if name is None:
        name = MEASURED if calibration.between_nodes else DEFAULT_NETWORK
    if name != MEASURED:
        return network(name)
    if calibration.between_nodes is None:
        raise OptionsError(
            f"--network {MEASURED}: the calibration's ranks were all on one node, so it measured no network "
            f"between nodes; name a preset: {', '.join(NETWORKS)}"
        )
    return measured_network(*calibration.between_nodes)


def curve_ranks(most: int) -> list[int]:
    """1, 2, 4, ... up to `most` (and `most` itself)."""
    counts = [2**k for k in range(int(math.log2(most)) + 1)]
    return counts if counts[-1] == most else counts + [most]


def _best_masters(model: PerformanceModel, setup: SetUp, ranks: int, batch: int) -> Point | None:
    """Sub-masters on `ranks` ranks with the number of masters that predicts the most samples/s."""
    best = None
    for masters in range(2, ranks // 2 + 1):
        candidate = setup.with_masters(masters)
        if candidate.workers(ranks) is None:
            continue
        point = model.predict(candidate, ranks, batch)
        if best is None or point.samples_per_s > best.samples_per_s:
            best = point
    return best


def analyse(
    calibration: Calibration,
    measured: list[Point],
    setups: list[SetUp],
    *,
    cores: int,
    cores_per_node: int,
    network_name: str | Network,
    max_ranks: int,
    target_samples: float,
    noise_scale: float | None = None,
    simulate: bool = True,
) -> Analysis:
    """Everything a study reports after its measurements (`measured` may be empty)."""
    there = PerformanceModel(calibration, Machine(cores_per_node, network(network_name)))
    comparisons = []
    for point in measured:
        here = PerformanceModel(calibration, machine_of(point, cores, network_name))
        if simulate:
            predicted = predicted_point(here, point)
        else:
            predicted = here.predict(point.setup, point.ranks, point.batch, point.scaling)
        comparisons.append(Comparison(point, predicted))
    notes = []
    rule = next(
        (s for s in setups if not s.allreduce and s.masters == 1 and not s.synchronous),
        SetUp("master-worker", "downpour"),
    )
    flat = SetUp("master-worker", rule.rule, 1, rule.sync_every)
    curves: list[Point] = []
    sim_there = Simulator(there)
    batch = calibration.batch_size
    for ranks in curve_ranks(max_ranks):
        curves.append(there.predict(SetUp("allreduce"), ranks, batch))
        if ranks >= 2:
            point = there.predict(flat, ranks, batch)
            if simulate:
                point.staleness_p99 = sim_there.run(flat, ranks, batch, cycles=12).staleness_p99
            curves.append(point)
        if ranks >= 4:
            best = _best_masters(there, flat, ranks, batch)
            if best is not None:
                curves.append(best)
    saturation = {
        s.label: there.saturation(s)
        for s in {SetUp("master-worker", s.rule, 1, s.sync_every) for s in setups if not s.allreduce}
    }
    scale = noise_scale or calibration.noise_scale
    rows: list[dict[str, Any]] = []
    recommendation: dict[str, Any] = {}
    if scale is None:
        notes.append("no gradient noise scale: goodput and time to target need one (give --noise-scale)")
    else:
        error = statistics.median([abs(c.error) for c in comparisons]) if comparisons else 0.0
        noise_range = None if noise_scale else calibration.noise_range
        per_epoch = calibration.train_samples or target_samples
        candidates = [
            (p, f"{p.setup.rule}, sub-masters (best M)" if p.setup.family == "sub-masters" else p.setup.label)
            for p in curves
        ]
        for setup in setups:
            if setup.allreduce or setup == flat:
                continue  # on the curves already
            for ranks in curve_ranks(max_ranks):
                if setup.workers(ranks) is not None:
                    candidates.append((there.predict(setup, ranks, batch), setup.label))
        for point, group in candidates:
            good = goodput(
                point,
                scale,
                target_samples,
                noise_range=noise_range,
                model_error=error,
                checkpoint_s=calibration.checkpoint_s,
                samples_per_checkpoint=per_epoch,
            )
            rows.append(
                {
                    "family": point.setup.family,
                    "group": group,
                    "label": point.setup.label,
                    "ranks": point.ranks,
                    "samples_per_s": point.samples_per_s,
                    "goodput": good.samples_per_s,
                    "ratio": good.ratio,
                    "seconds": good.seconds_to_target,
                    "low": good.low,
                    "high": good.high,
                    "staleness": point.staleness_mean,
                }
            )
        recommendation = _recommend(rows, error, scale, noise_range)
    return Analysis(
        comparisons, curves, saturation, rows, recommendation, there.machine.describe(), notes + calibration.notes
    )


def _recommend(
    rows: list[dict[str, Any]], model_error: float, scale: float, noise_range: tuple[float, float] | None
) -> dict[str, Any]:
    """The fewest ranks within WITHIN_BEST of the fastest time to target, and its set-up."""
    if not rows:
        return {}
    fastest = min(rows, key=lambda r: r["seconds"])
    enough = [r for r in rows if r["seconds"] <= fastest["seconds"] * (1 + WITHIN_BEST)]
    chosen = min(enough, key=lambda r: (r["ranks"], r["seconds"]))
    return {
        **chosen,
        "fastest": fastest,
        "model_error": model_error,
        "noise_scale": scale,
        "noise_range": list(noise_range) if noise_range else None,
    }
