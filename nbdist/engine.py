"""What runs on the engines of a notebook's cluster (each engine is one MPI rank).

The client sends these functions by reference (they live in this module), with the
options and the cell's source text: every rank then runs the cell itself, builds its own
model and loads its own shard. Models and datasets never travel between client and
engines.

A rank never raises into ipyparallel: it returns an `EngineOutcome`, so the client can
show one error naming the rank instead of one remote traceback per engine.
"""

from __future__ import annotations

import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nbdist.backends.base import ModelError
from nbdist.errors import UserError
from nbdist.transport.faults import RunFailure

__all__ = [
    "EngineOutcome",
    "describe_engine",
    "install_idle_stop_handler",
    "run_training",
    "open_study",
    "close_study",
    "run_trial",
    "run_scaling",
    "CELL_FILENAME",
    "LIVE_PREFIX",
]

CELL_FILENAME = "<distnn cell>"
LIVE_PREFIX = "nbdist-records-"  # keys of the record batches published to the client


@dataclass(slots=True)
class EngineOutcome:
    rank: int
    result: Any = None  # the RunResult on the run's leader
    error: str = ""  # one line for the user; empty when the rank finished
    user_error: bool = False  # bad input (no traceback needed) vs a failure
    detail: str = ""  # the traceback of an unexpected failure
    abandoned: bool = False  # stopped because another rank failed
    failed_at: float | None = None  # time.time() of the failure: the job's error leads with the first

    def __post_init__(self) -> None:
        # An outcome with an error is made where the error was caught: that is its time.
        if self.error and self.failed_at is None:
            self.failed_at = time.time()


def describe_engine() -> dict[str, Any]:
    from mpi4py import MPI

    from nbdist.transport.faults import ulfm_enabled

    world = MPI.COMM_WORLD
    return {
        "rank": world.Get_rank(),
        "size": world.Get_size(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "fault_tolerant": ulfm_enabled(),
    }


def install_idle_stop_handler() -> None:
    """A stop that arrives between jobs must not kill the engine (the default action of
    SIGUSR1 and SIGUSR2)."""
    for sig in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, lambda *_: None)


def _user_namespace() -> dict[str, Any]:
    # The engine's interactive namespace: what the cell defines stays there, as it does
    # for %px, so a later cell on the engines can use it.
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:
        shell = None
    return shell.user_ns if shell is not None else {}


def definition_from_cell(source: str) -> Any:
    """Run the cell's source in this engine's namespace; collect what it defined."""
    from nbdist.train.definition import definition_from_namespace, prefer_fresh

    namespace = _user_namespace()
    before = dict(namespace)
    try:
        code = compile(source, CELL_FILENAME, "exec")
    except SyntaxError as exc:
        raise ModelError(f"the cell has a syntax error on line {exc.lineno}: {exc.msg}") from None
    try:
        exec(code, namespace)  # the user's own cell, on the user's own engines
    except Exception as exc:
        raise ModelError(f"the cell failed: {_where(exc)}") from exc
    # An earlier cell may have left e.g. a build_model(params) on this engine; what this
    # cell defines (a ready `model`, say) must win over it.
    return definition_from_namespace(prefer_fresh(namespace, before), "the cell")


def _where(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == CELL_FILENAME]
    line = f" (cell line {frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{line}"


def _definition(cell: str | None, model: Callable[..., Any] | str | None, loss: Any, metric: Any, data: Any) -> Any:
    """What the job trains, built on this engine: the cell's names, a model file, or functions."""
    from nbdist.train.definition import definition_of

    if cell is not None:
        return lambda: definition_from_cell(cell)
    return definition_of(model, loss=loss, metric=metric, data=data)


def _as_outcome(work: Callable[[Any, Any], Any], live: bool) -> EngineOutcome:
    """Run `work(stop, sink)` on this rank with the job's signals in place; whatever
    happens becomes this rank's one outcome (never an exception into ipyparallel)."""
    from mpi4py import MPI

    from nbdist.metrics.publish import DataPublisher
    from nbdist.train.stopping import StopFlag
    from nbdist.transport import waiting

    rank = MPI.COMM_WORLD.Get_rank()
    stop = StopFlag()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)}
    stop.install()

    def give_up(signum: int, frame: object) -> None:
        # SIGUSR2: another rank failed where this one cannot hear of it, and the client
        # gave up on the job. Only flags here: the training loop stops at its next step
        # boundary, and a wait for the failed rank raises Abandoned from inside its own
        # polling loop. (An exception raised from this handler could land in the middle
        # of zmq or ipykernel code, and leave a lock held that the engine's reply needs.)
        stop.request("abandoned: another rank failed")
        waiting.abandon()

    waiting.forget_abandon()
    waiting.release_completed()  # what an earlier job left in flight and MPI has finished since
    signal.signal(signal.SIGUSR2, give_up)
    publisher = DataPublisher(LIVE_PREFIX) if live else None
    try:
        return EngineOutcome(rank, result=work(stop, publisher))
    except waiting.Abandoned:
        return EngineOutcome(rank, error="abandoned: another rank failed", abandoned=True)
    except RunFailure as exc:
        # A rank that only heard of another's failure says nothing new (abandoned).
        return EngineOutcome(rank, error=str(exc), user_error=True, abandoned=not exc.origin)
    except UserError as exc:
        return EngineOutcome(rank, error=str(exc), user_error=True)
    except Exception as exc:  # reported to the client, named by rank
        return EngineOutcome(rank, error=f"{type(exc).__name__}: {exc}", detail=traceback.format_exc())
    finally:
        signal.signal(signal.SIGUSR2, lambda *_: None)  # a late SIGUSR2 is for this job only
        waiting.forget_abandon()
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        if publisher is not None:
            publisher.close()


def run_training(
    options: dict[str, Any],
    *,
    cell: str | None = None,
    model: Callable[[], Any] | str | None = None,
    loss: Any = None,
    metric: Any = "accuracy",
    data: Any = None,
    live: bool = True,
) -> EngineOutcome:
    """One rank's part of a notebook job: collective over COMM_WORLD."""
    from mpi4py import MPI

    from nbdist.options import TrainOptions
    from nbdist.roles.runner import run_rank

    opts = TrainOptions.from_dict(options)
    definition = _definition(cell, model, loss, metric, data)
    # The notebook records the run in the store (the Job), not the engines.
    return _as_outcome(
        lambda stop, sink: run_rank(opts, definition, MPI.COMM_WORLD, stop, sink=sink, record=False), live
    )


# The communicators of the studies open on this engine: split once when the study starts
# (collective over every engine), used by each trial the engine's group trains.
_STUDIES: dict[str, Any] = {}


def open_study(study: str, layout: dict[str, Any]) -> None:
    from mpi4py import MPI

    from nbdist.layout import Layout
    from nbdist.roles.exchange import Kept

    close_study(study)
    whole = Layout.from_dict(layout)
    # The layout, this engine's communicators, and its share of the last checkpoint its
    # group's trial wrote (PBT sends it to another group over MPI).
    _STUDIES[study] = (whole, whole.split(MPI.COMM_WORLD), Kept())


def close_study(study: str) -> None:
    opened = _STUDIES.pop(study, None)
    if opened is not None:
        opened[1].free()


def run_trial(
    study: str,
    number: int,
    params: dict[str, Any],
    train: dict[str, Any],
    options: dict[str, Any],
    *,
    cell: str | None = None,
    model: Callable[..., Any] | str | None = None,
    loss: Any = None,
    metric: Any = "accuracy",
    data: Any = None,
    live: bool = True,
    segment: dict[str, Any] | None = None,
) -> EngineOutcome:
    """One rank's part of a segment of a study's trial: collective over this engine's group
    (its fold runs in parallel), PBT's copies between groups first. The outcome's result
    is a FoldOutcome on each fold's leader."""
    from mpi4py import MPI

    from nbdist.hpo.trial import Segment
    from nbdist.options import StudyOptions, TrainOptions
    from nbdist.roles.exchange import exchange
    from nbdist.roles.fold import train_fold
    from nbdist.transport.collectives import Collectives

    opened = _STUDIES.get(study)
    if opened is None:
        return EngineOutcome(MPI.COMM_WORLD.Get_rank(), error=f"study {study!r} is not open on this engine")
    layout, comms, kept = opened
    definition = _definition(cell, model, loss, metric, data)
    train_options, study_options = TrainOptions.from_dict(train), StudyOptions.from_dict(options)
    part = Segment.from_dict(segment) if segment else None

    def work(stop: Any, sink: Any) -> Any:
        if part is not None:
            collectives = Collectives(lambda: EXCHANGE_WAIT)
            exchange(
                MPI.COMM_WORLD, comms, layout, collectives, kept, number, train_options.runs_dir, part, EXCHANGE_WAIT
            )
        return train_fold(
            study,
            number,
            params,
            train_options,
            study_options,
            definition,
            comms.run,
            comms.role.fold,
            stop,
            sink=sink,
            record=False,
            segment=part,
            keep=kept.keeper(number),
        )

    return _as_outcome(work, live)


def run_scaling(options: dict[str, Any]) -> EngineOutcome:
    """One rank's part of a scaling study (`%distnn scale`, nbdist.scale(cluster=...)):
    collective over COMM_WORLD; the ScaleResult on rank 0. Its progress lines stay on
    the engines; the notebook shows the report."""
    from mpi4py import MPI

    from nbdist.scaling.options import ScaleOptions
    from nbdist.scaling.sweep import run_scale

    opts = ScaleOptions.from_dict(options)
    return _as_outcome(lambda stop, sink: run_scale(opts, comm=MPI.COMM_WORLD, say=lambda _text: None), False)


EXCHANGE_WAIT = 600.0  # how long a group waits for another in PBT's copy of a training state
