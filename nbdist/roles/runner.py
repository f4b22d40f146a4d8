"""One rank's whole run: set up, train in its role, return the result (on the leader).

No rank may leave while others wait for it. A rank that cannot go on (an error in its
code, a peer it found dead or frozen) tells every other rank over the run's control
channel before it raises, and every wait of the others watches that channel: the whole
run ends within moments, with the message of the rank that failed first. The first rank
to record the failure in the run directory (`failure.json`) is the one that reports it.

When a rank died or froze (and was removed) and the user allowed restarts
(`--max-restarts N`), the survivors do not end: they agree on who is left (MPI's fault
tolerance, `Comm.Shrink`), lay the run out again on fewer ranks, and continue from the
last checkpoint, in the same run directory and the same row of the run store. The new
layout keeps the most masters that fit the ranks left (a sub-master's death leaves 5 of
6 ranks: 1 master + 4 workers) and fills them with workers; where workers come in units of
several processes (a pipeline's stages) and the ranks left are not a whole number of them,
it uses as many as it can and the others leave the job. What carries over to the new
layout: train/relayout.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nbdist.durable import private_fd
from nbdist.errors import DiskFull, UserError
from nbdist.layout import Layout
from nbdist.metrics.log import RecordSink
from nbdist.metrics.record import stopped_on_request
from nbdist.options import TrainOptions
from nbdist.train.checkpoint import Checkpoints
from nbdist.train.context import RankContext, TrialTag, prepare
from nbdist.train.definition import ModelDefinition
from nbdist.train.diskspace import disk_full, is_disk_full
from nbdist.train.measures import measure
from nbdist.train.progress import RunResult
from nbdist.train.stopping import StopFlag
from nbdist.transport.faults import RunFailure, first_ranks, survivors, ulfm_enabled
from nbdist.transport.node import world
from nbdist.transport.waiting import Abandoned, watch_with

__all__ = ["run_rank", "FAILURE_FILE"]


# How long the run leader waits for the other ranks' last records before it closes the
# run in the store: long after a run that ended well (every rank is about to get there),
# short after a failure (some ranks may never get there).
LAST_RECORDS_WAIT = 60.0
LAST_RECORDS_WAIT_AFTER_FAILURE = 2.0
FAILURE_FILE = "failure.json"


def run_rank(
    options: TrainOptions,
    definition: ModelDefinition | Callable[[], ModelDefinition],
    comm: Any = None,
    stop: StopFlag | None = None,
    sink: RecordSink | None = None,
    record: bool = True,
    trial: TrialTag | None = None,
) -> RunResult | None:
    """Collective over `comm` (default COMM_WORLD). Returns the RunResult on the run's
    leader (the top master, or rank 0 of an allreduce run), None elsewhere. `sink`
    also receives every batch of this rank's metric records (the notebook's live view);
    `record=False` leaves the run store to the caller (the notebook's collector); `trial`
    tags the run as a study's trial."""
    comm = world() if comm is None else comm
    if stop is None:
        stop = StopFlag()
        if threading.current_thread() is threading.main_thread():
            stop.install()
    given = _Given(definition, stop, sink, record, trial)
    if options.resume and comm.Get_rank() == 0:
        _forget_failure(Path(options.resume))
    warm = warm_start_phase(options)
    if warm is not None:
        # The synchronous first phase is a run of its own in the run's directory (whose
        # options.json keeps the whole run's options); the asynchronous phase resumes it
        # from its last checkpoint. A resume before the switch lands here again.
        phase = _PhaseEnd()
        result = _run_with_restarts(warm, comm, given, phase, written=options)
        if not phase.completed:
            return result  # stopped, or stopped early: the run ends with the warm phase
        options = options.replace(resume=str(phase.run_dir))
    return _run_with_restarts(options, comm, given, _PhaseEnd())


def _forget_failure(run_dir: Path) -> None:
    """A resumed run's failure.json of an earlier job goes: it is not this job's, and the
    rank that records this job's failure would take it for one another rank had recorded
    (and no rank would say the error). Before set-up, whose ranks record a failure only
    once this rank has joined them."""
    if (run_dir / "options.json").exists():
        with contextlib.suppress(OSError):
            (run_dir / FAILURE_FILE).unlink(missing_ok=True)


def warm_start_phase(options: TrainOptions) -> TrainOptions | None:
    """The options of the synchronous first phase still to train under --warm-start-epochs,
    or None (no warm start, or the checkpoint to resume from is past the switch)."""
    if not options.warm_start_epochs or options.synchronous or options.topology != "master-worker":
        return None
    if options.resume:
        latest, _ = Checkpoints(Path(options.resume)).latest_intact()
        if latest is not None and not Checkpoints.read_meta(latest).get("options", {}).get("synchronous", False):
            return None  # written after the switch: an asynchronous resume
    return options.replace(synchronous=True, epochs=options.warm_start_epochs, warm_start_epochs=0)


@dataclass
class _Given:
    """What run_rank was given that every attempt and phase of the run keeps."""

    definition: ModelDefinition | Callable[[], ModelDefinition]
    stop: StopFlag
    sink: RecordSink | None
    record: bool
    trial: TrialTag | None


@dataclass
class _PhaseEnd:
    """Where a phase's run went, on every rank, and whether it trained all its epochs."""

    run_dir: Path | None = None
    completed: bool = False


def _run_with_restarts(
    options: TrainOptions, comm: Any, given: _Given, phase: _PhaseEnd, written: TrainOptions | None = None
) -> RunResult | None:
    restart_of: Path | None = None
    # A bad --max-restarts (negative, not a number) still makes one attempt, whose set-up
    # rejects it with the options' own error: no attempt at all would report nothing.
    restarts = options.max_restarts if isinstance(options.max_restarts, int) else 0
    for attempt in range(max(restarts, 0) + 1):
        try:
            return _run_once(options, comm, given, restart_of, attempt, phase, written)
        except RunFailure as failure:
            if not _restartable(failure, options, attempt):
                raise
            restart_of = failure.run_dir
            comm = survivors(comm)
            # The same run on fewer ranks: let the layout fill them again, as many as it can.
            options = options.replace(workers=None)
            left, used = comm.Get_size(), _ranks_to_use(comm.Get_size(), options)
            if comm.Get_rank() == 0:
                where = f"the {left} ranks left" if used == left else f"{used} of the {left} ranks left"
                print(
                    f"nbdist: {failure}: restarting on {where} (restart {attempt + 1} of {options.max_restarts})"
                    + (
                        ""
                        if used == left
                        else f"; with {options.procs_per_worker} processes per worker the layout fits no more of them"
                    ),
                    file=sys.stderr,
                    flush=True,
                )
            if used < left:
                comm = first_ranks(comm, used)
                if comm is None:
                    return None
    raise AssertionError("unreachable")  # the last attempt returns or raises


def _ranks_to_use(left: int, options: TrainOptions) -> int:
    """How many of the `left` ranks the restart's layout uses: all of them unless the
    layout comes in larger units (pipeline stages, processes per worker), then the most it
    can (Layout.within). When none fits, all: the run's set-up then says why."""
    try:
        layout = Layout.within(
            left, masters=options.masters, procs_per_worker=options.procs_per_worker, topology=options.topology
        )
    except UserError:
        return left
    return layout.n_ranks


def _restartable(failure: RunFailure, options: TrainOptions, attempt: int) -> bool:
    return (
        failure.restartable
        and attempt < options.max_restarts
        and ulfm_enabled()
        and getattr(failure, "run_dir", None) is not None
    )


def _run_once(
    options: TrainOptions,
    comm: Any,
    given: _Given,
    restart_of: Path | None,
    attempt: int,
    phase: _PhaseEnd,
    written: TrainOptions | None = None,
) -> RunResult | None:
    ctx = prepare(
        options,
        given.definition,
        comm,
        given.stop,
        given.sink,
        given.record,
        given.trial,
        restart_of=restart_of,
        written=written,
    )
    ctx.attempt = attempt
    phase.run_dir = ctx.run_dir
    if restart_of is None:
        ctx.say(
            f"nbdist: {ctx.layout.describe()}, {ctx.options.topology}"
            + (f", {ctx.algorithm!r}" if ctx.algorithm else ", synchronous sgd")
            + (", synchronous" if options.synchronous and ctx.algorithm else "")
            + f"; run directory {ctx.run_dir}"
        )
    else:
        ctx.say(
            f"nbdist: restart {attempt} of {options.max_restarts} on {comm.Get_size()} ranks "
            f"({ctx.layout.describe()}), from "
            + (f"{ctx.resume_from.name}" if ctx.resume_from is not None else "the start")
        )
        ctx.log.emit(
            "restart",
            {
                "attempt": attempt,
                "ranks": comm.Get_size(),
                "layout": ctx.layout.describe(),
                "checkpoint": ctx.resume_from.name if ctx.resume_from is not None else None,
            },
        )
    result: RunResult | None = None
    failure: BaseException | None = None
    try:
        with watch_with(ctx.peers.control.check):
            result = _train_in_role(ctx)
            if result is not None and given.trial is not None:
                # A study's objectives measured on the trained model (params, the model file's functions).
                result.final.update(measure(ctx.backend, ctx.measures, [name for _, name in given.trial.watched]))
            if written is not None:
                # Every rank learns from the leader whether the phase trained all its epochs.
                done = np.array([result is not None and result.stop_reason == f"completed {options.epochs} epochs"])
                ctx.peers.collectives.bcast(ctx.comms.run, done.view(np.uint8), "the end of the warm start")
                phase.completed = bool(done[0])
        return result
    except RunFailure as exc:
        failure = exc
        exc.run_dir = ctx.run_dir
        if exc.origin:
            ctx.peers.control.tell_all(exc)
        if not _restartable(exc, options, attempt):
            _record_failure(ctx, exc, options, attempt)
        raise
    except (Abandoned, KeyboardInterrupt) as exc:
        failure = exc
        raise
    except BaseException as exc:
        # This rank's own failure (its code, its data, a bug): the others must not wait
        # for it. They hear it as this rank's message; the CLI shows its traceback here.
        # Any write of the run (a log, the history, the weights) on a full disk: one line.
        error = disk_full(exc) if is_disk_full(exc) else exc
        failure = error
        told = RunFailure(
            f"{ctx.peers.directory.describe(ctx.comms.world.Get_rank())} failed: {type(error).__name__}: {error}"
            if not isinstance(error, UserError)
            else str(error)
        )
        ctx.peers.control.tell_all(told)
        _record_failure(ctx, told, options, attempt, disk=isinstance(error, DiskFull))
        # Whatever the exception, the CLI asks it whether to print it (cli.py, _reports), and
        # after a traceback prints the failure's line with what to do next.
        setattr(error, "reported_here", bool(told.reported_here))  # noqa: B010
        setattr(error, "failure_line", str(told))  # noqa: B010
        if isinstance(error, DiskFull):
            error.args = told.args  # with the checkpoint to resume from
            ctx.checkpoints.discard_incomplete()  # what was written of the one that did not fit
        if error is not exc:
            raise error from None
        raise
    finally:
        restarting = isinstance(failure, RunFailure) and _restartable(failure, options, attempt)
        if ctx.store_path is not None:
            _close_run_in_store(ctx, result, failure, restarting)
        else:
            # What this attempt recorded last (the epoch it finished before a rank died)
            # reaches the log and the notebook before a restart goes on past it.
            ctx.log.close()
        ctx.peers.close()
        if failure is None:
            # After a failure they stay: a nonblocking collective that failed may still be
            # referenced by MPI's progress engine, which must not find them freed.
            ctx.comms.free()
        ctx.data.close()


def _record_failure(
    ctx: RankContext, failure: RunFailure, options: TrainOptions, attempt: int, disk: bool = False
) -> None:
    """The first rank to get here writes failure.json and reports the failure (the CLI
    prints it); the message says what to do next (`disk`: after freeing some space)."""
    if not failure.origin:
        return
    hint = _what_next(ctx, failure, options, attempt, disk)
    if hint and hint not in str(failure):
        failure.args = (f"{failure}; {hint}",)
    path = ctx.run_dir / FAILURE_FILE
    info = {
        "message": str(failure),
        "ranks": list(failure.ranks),
        "restartable": failure.restartable,
        "reported_by": ctx.peers.directory.describe(ctx.comms.world.Get_rank()),
        "time": failure.at,
        "attempt": attempt,
    }
    try:
        fd = private_fd(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except FileExistsError:
        if _same_attempt(path, attempt):
            return
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    except OSError:
        failure.reported_here = True  # no run directory to arbitrate in: say it here
        return
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(info, fh, indent=1)
    except OSError:
        pass  # a full disk: the file was made (this rank reports), its text did not fit
    failure.reported_here = True


def _same_attempt(path: Path, attempt: int) -> bool:
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("attempt") == attempt
    except (OSError, ValueError):
        return True


def _what_next(ctx: RankContext, failure: RunFailure, options: TrainOptions, attempt: int, disk: bool) -> str:
    latest = Checkpoints(ctx.run_dir).latest()
    if disk:
        if latest is None:
            return "no checkpoint was written yet: free some space there, then run it again"
        return (
            f"the last intact checkpoint is {latest.name}: free some space there, then continue with "
            f"--resume {ctx.run_dir}"
        )
    if failure.restartable and attempt < options.max_restarts and not ulfm_enabled():
        return (
            "restarts need MPI fault tolerance: start the run with python -m nbdist launch, or with "
            "mpiexec --with-ft ulfm"
        )
    if latest is None:
        # The other ranks may still commit one as they stop (their writers finish what was queued).
        every = "" if options.checkpoint_every == 1 else " (--checkpoint-every 1 checkpoints every epoch)"
        return (
            f"no checkpoint was committed when it failed: run it again{every}, or continue with --resume "
            f"{ctx.run_dir} if one was committed as the run stopped"
        )
    resume = f"its last checkpoint is {latest.name}: continue with --resume {ctx.run_dir}"
    if failure.restartable and options.max_restarts == 0:
        resume += " (or add --max-restarts 1 to restart automatically on the surviving ranks)"
    return resume


def _train_in_role(ctx: RankContext) -> RunResult | None:
    if ctx.options.topology == "allreduce":
        if ctx.options.worker_parallel == "pipeline":
            from nbdist.roles.pipeline import run_pipeline_replicas

            return run_pipeline_replicas(ctx)
        from nbdist.roles.allreduce import run_allreduce

        return run_allreduce(ctx)
    from nbdist.roles.master import run_master
    from nbdist.roles.worker import run_worker

    if ctx.role.is_sub_master:
        from nbdist.roles.hierarchy import run_sub_master

        run_sub_master(ctx)
        return None
    if ctx.role.kind == "master":
        return run_master(ctx)
    if ctx.options.worker_parallel == "pipeline":
        from nbdist.roles.pipeline import run_pipeline_worker

        run_pipeline_worker(ctx)
        return None
    run_worker(ctx)
    return None


def _close_run_in_store(
    ctx: RankContext, result: RunResult | None, failure: BaseException | None, restarting: bool
) -> None:
    """Every rank has closed its log when it gets here; the leader waits for the others
    (without blocking inside MPI), records what they wrote last, and ends the run (or,
    restarting, leaves it open for the restart to go on in)."""
    ctx.log.close()
    control = ctx.peers.control
    if ctx.recorder is None:
        control.say_ended()
        return
    control.await_ends(LAST_RECORDS_WAIT_AFTER_FAILURE if failure else LAST_RECORDS_WAIT)
    if restarting:
        ctx.recorder.pause()
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
