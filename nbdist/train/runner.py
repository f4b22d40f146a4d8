"""One rank's whole run: set up, train in its role, return the result (on the leader)."""

from __future__ import annotations

import threading
from typing import Any, Callable

from nbdist.errors import UserError
from nbdist.metrics.log import RecordSink
from nbdist.options import TrainOptions
from nbdist.train.context import RankContext, TrialTag, prepare
from nbdist.train.definition import ModelDefinition
from nbdist.train.progress import RunResult, stopped_on_request
from nbdist.train.stopping import StopFlag

__all__ = ["run_rank"]


# How long the run leader waits for the other ranks' last records before it closes the
# run in the store: long after a run that ended well (every rank is about to get there),
# short after a failure (some ranks may never get there).
LAST_RECORDS_WAIT = 60.0
LAST_RECORDS_WAIT_AFTER_FAILURE = 2.0


def run_rank(options: TrainOptions, definition: ModelDefinition | Callable[[], ModelDefinition],
             comm: Any = None, stop: StopFlag | None = None,
             sink: RecordSink | None = None, record: bool = True, trial: TrialTag | None = None) -> RunResult | None:
    """Collective over `comm` (default COMM_WORLD). Returns the RunResult on the run's
    leader (the top master, or rank 0 of an allreduce run), None elsewhere. `sink`
    also receives every batch of this rank's metric records (the notebook's live view);
    `record=False` leaves the run store to the caller (the notebook's collector); `trial`
    tags the run as a study's trial."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    if stop is None:
        stop = StopFlag()
        if threading.current_thread() is threading.main_thread():
            stop.install()
    ctx = prepare(options, definition, comm, stop, sink, record, trial)
    ctx.say(f"nbdist: {ctx.layout.describe()}, {ctx.options.topology}"
            + (f", {ctx.algorithm!r}" if ctx.algorithm else ", synchronous sgd")
            + (", synchronous" if options.synchronous and ctx.algorithm else "")
            + f"; run directory {ctx.run_dir}")
    result: RunResult | None = None
    failure: BaseException | None = None
    try:
        result = _train_in_role(ctx)
        return result
    except BaseException as exc:
        failure = exc
        raise
    finally:
        if ctx.store_path is not None:
            _close_run_in_store(ctx, result, failure)
        ctx.comms.free()
        ctx.data.close()


def _train_in_role(ctx: RankContext) -> RunResult | None:
    if ctx.options.topology == "allreduce":
        from nbdist.topology.allreduce import run_allreduce

        return run_allreduce(ctx)
    from nbdist.topology.master_worker import run_master, run_worker

    if ctx.role.is_sub_master:
        from nbdist.topology.hierarchy import run_sub_master

        run_sub_master(ctx)
        return None
    if ctx.role.kind == "master":
        return run_master(ctx)
    run_worker(ctx)
    return None


def _close_run_in_store(ctx: RankContext, result: RunResult | None, failure: BaseException | None) -> None:
    """Every rank has closed its log when it gets here; the leader waits for the others
    (without blocking inside MPI), records what they wrote last, and ends the run."""
    from nbdist.topology.waiting import wait_until

    ctx.log.close()
    arrived = ctx.comms.run.Ibarrier()
    wait_until(arrived, LAST_RECORDS_WAIT_AFTER_FAILURE if failure else LAST_RECORDS_WAIT)
    if ctx.recorder is None:
        return
    if failure is not None:
        status, reason, final = "failed", _describe_failure(failure), None
    elif result is not None:
        status = "stopped" if stopped_on_request(result.stop_reason) else "completed"
        reason, final = result.stop_reason, result.final
    else:  # the leader always has the result of a run that ended well
        status, reason, final = "failed", "the run leader ended without a result", None
    ctx.recorder.finish(status, reason, final)


def _describe_failure(exc: BaseException) -> str:
    if isinstance(exc, KeyboardInterrupt):
        return "interrupted"
    if isinstance(exc, UserError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
