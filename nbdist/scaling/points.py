"""Measuring one configuration for real: a short training run on some of the job's ranks.

A scaling study runs inside one MPI job. For a point of k ranks, ranks 0..k-1 split off a
communicator and train on it with nbdist's own run (roles/runner.py: Layout, the master,
worker and allreduce loops, the transport), exactly as `python -m nbdist train` on k ranks
would, for a bounded number of steps: one epoch of a training set cut (or repeated) to
that many batches per worker. The other ranks sit out in a barrier that sleeps between
looks, so the point has the cores to itself. Each rank's waits poll without sleeping only
where the point's ranks fit the node's cores, as --busy-poll auto would decide for a job
of k ranks. The run's records are then read back (measure.py).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nbdist.data.base import Data
from nbdist.options import TrainOptions
from nbdist.roles.runner import run_rank
from nbdist.scaling.measure import MeasureError, measure_run
from nbdist.scaling.setups import Point, SetUp
from nbdist.train.definition import ModelDefinition
from nbdist.train.stopping import StopFlag
from nbdist.transport.collectives import Collectives
from nbdist.transport.probe import free, idle_barrier, split

__all__ = ["BoundedData", "PointRunner", "PointFailed", "Measured", "bounded"]

VALIDATION_SAMPLES = 256  # a point validates once, at its end: a few batches are enough


class PointFailed(RuntimeError):
    """A point's run failed; the message is the run's."""


class BoundedData(Data):
    """A model's data with `n_train` training samples: its own, cut short or repeated
    (sample i is its sample i mod n), so that one epoch is the number of steps a point
    trains; and at most VALIDATION_SAMPLES validation samples."""

    __slots__ = ("inner", "_n_train")

    def __init__(self, inner: Data, n_train: int):
        self.inner, self._n_train = inner, n_train

    @property
    def n_train(self) -> int:
        return self._n_train

    @property
    def n_val(self) -> int:
        return min(self.inner.n_val, VALIDATION_SAMPLES)

    def train_batch(self, indices: np.ndarray) -> tuple[Any, Any]:
        return self.inner.train_batch(np.sort(np.asarray(indices) % self.inner.n_train))

    def val_batch(self, indices: np.ndarray) -> tuple[Any, Any]:
        return self.inner.val_batch(indices)

    def close(self) -> None:
        self.inner.close()


def bounded(definition: ModelDefinition, n_train: int) -> ModelDefinition:
    """The same model, its data bounded to `n_train` training samples."""
    made: dict[str, Data] = {}

    def data() -> Data:
        made["inner"] = definition.make_data()
        return BoundedData(made["inner"], n_train)

    return ModelDefinition(
        build_model=definition.build_model,
        loss=definition.loss,
        metric=definition.metric,
        data=data,
        source=definition.source,
        build_stages=definition.build_stages,
    )


@dataclass
class Measured:
    """What rank 0 learns of a point: its figures, or why there are none."""

    point: Point | None = None
    error: str | None = None
    run_dir: Path | None = None


@dataclass
class PointRunner:
    """Runs points on the ranks of `comm` (every rank calls `run` with the same arguments)."""

    comm: Any
    definition: ModelDefinition
    base: TrainOptions  # seed, threads, peer timeout, ... of every point's run
    runs_dir: Path
    cores: int
    timeout: float = 600.0
    keep: bool = False

    def run(self, setup: SetUp, ranks: int, batch: int, steps: int, scaling: str = "weak", name: str = "") -> Measured:
        """Train `setup` on ranks 0..ranks-1 for `steps` batches per worker; the measured
        point on rank 0 (an empty Measured elsewhere). PointFailed on every rank if the
        run failed; a run too short to measure is an error in rank 0's Measured."""
        workers = setup.workers(ranks)
        if workers is None or ranks > self.comm.Get_size():
            raise ValueError(f"{setup.label} does not fit {ranks} of {self.comm.Get_size()} ranks")
        member = self.comm.Get_rank() < ranks
        sub = split(self.comm, member)
        run_dir, failure = None, None
        try:
            if member:
                options = self.base.replace(
                    **setup.train_options(),
                    workers=None,
                    epochs=1,
                    batch_size=batch,
                    validate_every=1,
                    checkpoint_every=0,
                    busy_poll="on" if ranks <= self.cores else "off",
                    store="off",
                    runs_dir=str(self.runs_dir),
                    run_name=name or f"{setup.label.replace(', ', '-').replace(' ', '')}-{ranks}r",
                    quiet=True,
                    resume=None,
                    max_restarts=0,
                )
                try:
                    result = run_rank(
                        options, bounded(self.definition, workers * batch * steps), comm=sub, stop=StopFlag()
                    )
                    if result is not None:
                        run_dir = result.run_dir
                except Exception as exc:  # noqa: BLE001 - every rank must hear of it, then go on or stop together
                    failure = f"{type(exc).__name__}: {exc}" if not str(exc).startswith("nbdist") else str(exc)
        finally:
            free(sub)
            idle_barrier(self.comm, self.timeout)
        said = Collectives(lambda: self.timeout).allgather(self.comm, failure, "a scaling point's outcome")
        failures = [f for f in said if f]
        if failures:
            raise PointFailed(f"{setup.label} on {ranks} ranks failed: {failures[0]}")
        if run_dir is None:
            return Measured()
        try:
            return Measured(measure_run(run_dir, setup, ranks, batch, self.cores, scaling), run_dir=run_dir)
        except MeasureError as exc:
            return Measured(error=f"{setup.label} on {ranks} ranks: {exc}")
        finally:
            if not self.keep:
                shutil.rmtree(run_dir, ignore_errors=True)
