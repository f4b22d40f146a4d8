"""One rank's whole run: set up, train in its role, return the result (on the leader)."""

from __future__ import annotations

import threading
from typing import Any, Callable

from nbdist.metrics.log import RecordSink
from nbdist.options import TrainOptions
from nbdist.train.context import prepare
from nbdist.train.definition import ModelDefinition
from nbdist.train.progress import RunResult
from nbdist.train.stopping import StopFlag

__all__ = ["run_rank"]


def run_rank(options: TrainOptions, definition: ModelDefinition | Callable[[], ModelDefinition],
             comm: Any = None, stop: StopFlag | None = None,
             sink: RecordSink | None = None) -> RunResult | None:
    """Collective over `comm` (default COMM_WORLD). Returns the RunResult on the run's
    leader (the top master, or rank 0 of an allreduce run), None elsewhere. `sink`
    also receives every batch of this rank's metric records (the notebook's live view)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD if comm is None else comm
    if stop is None:
        stop = StopFlag()
        if threading.current_thread() is threading.main_thread():
            stop.install()
    ctx = prepare(options, definition, comm, stop, sink)
    ctx.say(f"nbdist: {ctx.layout.describe()}, {ctx.options.topology}"
            + (f", {ctx.algorithm!r}" if ctx.algorithm else ", synchronous sgd")
            + (", synchronous" if options.synchronous and ctx.algorithm else "")
            + f"; run directory {ctx.run_dir}")
    try:
        if options.topology == "allreduce":
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
    finally:
        ctx.comms.free()
        ctx.data.close()
