"""`nbdist scale`: a scaling study on the ranks of one MPI job.

Collective over the job's ranks (COMM_WORLD or `comm`):

1. calibrate the performance model on them (calibrate.py);
2. measure a sweep of points, set-up by set-up and rank count by rank count, each a short
   real run on ranks 0..k-1 (points.py), weak scaling (--batch-size per worker) and strong
   scaling (the total batch of the largest point, shared); each point says how many cores
   it had, and one with more ranks than cores is marked oversubscribed;
3. on rank 0: the model's prediction beside every measured point, the predicted curves to
   --max-ranks on nodes of --cores-per-node cores joined by --network, the master's
   saturation, goodput and time to target, the recommended set-up (analysis.py); printed,
   written to the study's directory (report.md, calibration.json) and to the run store as
   a run of kind "scale" (store.py), point by point as they are measured.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbdist.durable import make_dir, write_json, write_text
from nbdist.errors import OptionsError, UserError
from nbdist.options import TrainOptions
from nbdist.scaling.analysis import Analysis, analyse, between_nodes, machine_of, predicted_point
from nbdist.scaling.calibrate import calibrate
from nbdist.scaling.inputs import Calibration
from nbdist.scaling.load import CpuMeter, window_load
from nbdist.scaling.model import PerformanceModel
from nbdist.scaling.network import MEASURED, Machine
from nbdist.scaling.options import ScaleOptions, default_ranks, parse_ranks, parse_setups
from nbdist.scaling.points import PointRunner
from nbdist.scaling.report import report
from nbdist.scaling.setups import Point, SetUp
from nbdist.scaling.store import ScaleRecorder
from nbdist.store import store_path
from nbdist.train.definition import ModelDefinition, load_model_file
from nbdist.transport.collectives import Collectives
from nbdist.transport.node import world

__all__ = ["run_scale", "ScaleResult", "plan_points"]

TIMEOUT = 600.0
MIN_STEPS, MAX_STEPS = 20, 5000


@dataclass
class ScaleResult:
    """What a study found (on rank 0)."""

    name: str
    directory: Path
    calibration: Calibration
    measured: list[Point]
    analysis: Analysis
    text: str
    store: str | None


def plan_points(
    setups: list[SetUp], counts: list[int], scalings: list[str], quick: bool, batch: int
) -> list[tuple[SetUp, int, int, str]]:
    """(set-up, ranks, batch per worker, scaling) of every point to measure. The rules but
    the first asynchronous one are measured at the largest rank count only with --quick;
    strong scaling shares the total batch of the largest point, for allreduce and (without
    --quick) the first rule."""
    first = next((s for s in setups if s.asynchronous and s.masters == 1), None)
    points = []
    for setup in setups:
        fits = [r for r in counts if setup.workers(r) is not None]
        if quick and setup != first and not setup.allreduce:
            fits = fits[-1:]
        if "weak" in scalings:
            points += [(setup, r, batch, "weak") for r in fits]
        if "strong" in scalings and fits and (setup.allreduce or (setup == first and not quick)):
            total = batch * (setup.workers(fits[-1]) or 1)
            shares = [(r, total // (setup.workers(r) or 1)) for r in fits]
            points += [(setup, r, share, "strong") for r, share in shares if share >= 1]
    return points


def scaled_definition(options: ScaleOptions, definition: ModelDefinition | None = None) -> ModelDefinition:
    """The model the study times (`definition`, or --model's file), with --train/--val's
    HDF5 files as its data, read where each rank runs."""
    definition = definition or load_model_file(str(options.model))
    if not options.train:
        return definition
    from nbdist.data.files import HDF5Data

    keys = [k.strip() for k in options.data_keys.split(",")]
    train, val = options.train, options.val
    return dataclasses.replace(definition, data=lambda: HDF5Data(train, val, keys=keys))


def _cores(options: ScaleOptions) -> int:
    return options.cores or len(os.sched_getaffinity(0))


def check_rank_counts(options: ScaleOptions, size: int) -> list[int]:
    """The rank counts the study measures on a job of `size` ranks, or one error."""
    counts = parse_ranks(options.ranks) if options.ranks else default_ranks(size, options.quick)
    if size < 2:
        raise UserError(
            "nbdist scale needs at least 2 MPI ranks (it measures messages between two): run it with "
            "python -m nbdist launch -n N scale ..."
        )
    too_many = [r for r in counts if r > size]
    if too_many:
        raise UserError(
            f"--ranks {options.ranks}: {', '.join(map(str, too_many))} "
            f"{'is' if len(too_many) == 1 else 'are'} more than the {size} MPI ranks of this job; run with "
            f"python -m nbdist launch -n {max(too_many)} scale ..., or give rank counts up to {size}"
        )
    return counts


def run_scale(
    options: ScaleOptions,
    definition: ModelDefinition | None = None,
    comm: Any = None,
    say: Any = None,
) -> ScaleResult | None:
    """Collective: the study on the ranks of `comm`; its ScaleResult on rank 0, None elsewhere."""
    comm = world() if comm is None else comm
    options = options.validate()
    size, rank = comm.Get_size(), comm.Get_rank()
    counts = check_rank_counts(options, size)
    setups = parse_setups(options.setups)
    definition = scaled_definition(options, definition)
    cores = _cores(options)
    collectives = Collectives(lambda: TIMEOUT)

    def tell(text: str) -> None:
        if rank == 0:
            (say or print)(text)

    name, directory = _study_dir(options, rank, collectives, comm)
    pids = collectives.allgather(comm, os.getpid(), "the scaling study's processes")
    hosts = collectives.allgather(comm, socket.gethostname(), "the scaling study's nodes")
    if options.network == MEASURED and len(set(hosts)) < 2:
        raise OptionsError(
            f"--network {MEASURED}: all {size} ranks are on {hosts[0]}, so there is no network between nodes to "
            "measure; name a preset (--network ib-hdr) or run the job on two nodes or more"
        )
    meter = CpuMeter(pids) if rank == 0 else None
    base = TrainOptions(seed=options.seed, threads=options.threads)
    database = store_path(options.store, options.runs_dir)
    recorder = ScaleRecorder(database, name, str(directory), options.to_dict()) if rank == 0 and database else None
    try:
        calibration, calibration_points = calibrate(
            comm,
            definition,
            base,
            batch=options.batch_size,
            model=str(options.model),
            runs_dir=directory / "points",
            cores=cores,
            quick=options.quick,
            run_seconds=options.point_seconds,
            repeats=options.repeats,
            meter=meter,
            say=tell,
        )
        plan = plan_points(setups, counts, options.scalings(), options.quick, options.batch_size)
        # calibrate() gives the Calibration to rank 0 alone: rank 0's work tests for it
        steps = _steps(calibration, plan, cores, options) if calibration is not None else []
        steps = collectives.allgather(comm, steps, "the scaling study's plan")[0]
        measured: list[Point] = []
        if calibration is not None:
            tell(f"nbdist: calibrated in {calibration.seconds:.0f} s; measuring {len(plan)} points")
            write_json(directory / "calibration.json", calibration.to_dict())
            if recorder is not None:
                recorder.add("calibration", calibration.to_dict())
            for point in calibration_points:
                point.extra = {**(point.extra or {}), "calibration": True}
                if recorder is not None:
                    model = PerformanceModel(
                        calibration, machine_of(point, cores, between_nodes(calibration, options.network))
                    )
                    predicted = predicted_point(model, point)
                    recorder.add("measured", {"measured": point.to_dict(), "predicted": predicted.to_dict()})
            measured += calibration_points
        runner = PointRunner(comm, definition, base, directory / "points", cores, TIMEOUT, options.keep_runs)
        done = {(p.setup, p.ranks, p.batch, p.scaling) for p in calibration_points}
        done = collectives.allgather(comm, [list(map(str, d)) for d in done], "the scaling study's plan")[0]
        for (setup, ranks, batch, scaling), count in zip(plan, steps, strict=True):
            if [str(setup), str(ranks), str(batch), scaling] in done:
                continue  # the calibration's runs measured it
            best = None
            for _ in range(options.repeats):
                outcome = runner.run(setup, ranks, batch, count, scaling)
                if rank == 0 and outcome.error:
                    tell(f"nbdist: warning: {outcome.error}")
                if outcome.point is not None and (best is None or outcome.point.samples_per_s > best.samples_per_s):
                    best = outcome.point
            if best is not None and calibration is not None:
                best.extra = {**(best.extra or {}), **window_load(meter, (best.extra or {}).get("window"), ranks)}
                measured.append(best)
                model = PerformanceModel(
                    calibration, machine_of(best, cores, between_nodes(calibration, options.network))
                )
                predicted = predicted_point(model, best)
                tell(
                    f"nbdist: {setup.label} on {ranks} ranks ({scaling}, batch {batch}): "
                    f"{best.samples_per_s:,.0f} samples/s (predicted {predicted.samples_per_s:,.0f}, "
                    f"{predicted.samples_per_s / best.samples_per_s - 1:+.0%})"
                    + (f"; oversubscribed, {ranks} ranks on {cores} cores" if best.oversubscribed else "")
                    + (f"; other processes used {best.extra['others']:.1f} cores" if best.extra["others"] > 0.1 else "")
                )
                if recorder is not None:
                    recorder.add("measured", {"measured": best.to_dict(), "predicted": predicted.to_dict()})
        if calibration is None:
            return None
        result = _conclude(options, calibration, measured, setups, cores, name, directory, recorder, database, tell)
        recorder = None
        return result
    except BaseException as exc:
        if recorder is not None:
            recorder.finish("failed", f"{type(exc).__name__}: {exc}")
        raise
    finally:
        if meter is not None:
            meter.stop()


def _conclude(
    options: ScaleOptions,
    calibration: Calibration,
    measured: list[Point],
    setups: list[SetUp],
    cores: int,
    name: str,
    directory: Path,
    recorder: ScaleRecorder | None,
    database: str | None,
    tell: Any,
) -> ScaleResult:
    target = options.target_epochs * max(1, calibration.train_samples)
    compared = [p for p in measured if not (p.extra or {}).get("calibration")]
    analysis = analyse(
        calibration,
        compared,
        setups,
        cores=cores,
        cores_per_node=options.cores_per_node or cores,
        network_name=between_nodes(calibration, options.network),
        max_ranks=options.max_ranks,
        target_samples=target,
        noise_scale=options.noise_scale,
    )
    reference = {p.scaling: p.samples_per_s for p in measured if p.setup.allreduce and p.ranks == 1}
    text = report(calibration, measured, reference, analysis, target)
    tell(text)
    write_text(directory / "report.md", text + "\n")
    if recorder is not None:
        recorder.add("predicted", [p.to_dict() for p in analysis.curves])
        recorder.add("saturation", [{"label": k, "workers": v} for k, v in analysis.saturation.items()])
        recorder.add("goodput", analysis.goodput)
        summary = {
            "recommendation": analysis.recommendation,
            "median_error": analysis.median_error,
            "worst_error": analysis.worst_error,
            "reference": reference,
        }
        recorder.add("summary", summary)
        recorder.finish("completed", f"{len(measured)} points measured", summary)
    tell(f"nbdist: the study is in {directory}" + (f" and in the run store {database}" if database else ""))
    return ScaleResult(name, directory, calibration, measured, analysis, text, database)


def _steps(
    calibration: Calibration, plan: list[tuple[SetUp, int, int, str]], cores: int, options: ScaleOptions
) -> list[int]:
    """Batches per worker for each point to train about --seconds (by the model's step time)."""
    model = PerformanceModel(calibration, Machine(cores, between_nodes(calibration, options.network), nodes=1))
    out = []
    for setup, ranks, batch, scaling in plan:
        step = model.predict(setup, ranks, batch, scaling).step_s / (1 if setup.allreduce else max(1, setup.sync_every))
        out.append(int(min(MAX_STEPS, max(MIN_STEPS, options.point_seconds / max(step, 1e-6)))))
    return out


def _study_dir(options: ScaleOptions, rank: int, collectives: Collectives, comm: Any) -> tuple[str, Path]:
    """The study's directory under --runs-dir (rank 0 makes it; every rank learns its name)."""
    made = None
    if rank == 0:
        root = Path(options.runs_dir)
        make_dir(root)
        stem = options.run_name or f"{time.strftime('%Y%m%d-%H%M%S')}-scale-{Path(str(options.model)).stem}"
        candidate, n = root / stem, 1
        while True:
            try:
                make_dir(candidate, exclusive=True)
                break
            except FileExistsError:
                n += 1
                candidate = root / f"{stem}-{n}"
        made = str(candidate)
    made = collectives.allgather(comm, made, "the scaling study's directory")[0]
    return Path(made).name, Path(made)
