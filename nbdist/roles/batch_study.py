"""`python -m nbdist study` under mpiexec/srun: rank 0 coordinates, the other ranks train.

    mpiexec -n 9 python -m nbdist study --model examples/digits_mlp.py --space "lr=log(1e-3,0.3)" \\
        --searcher evolution --trials 12 --groups 2 --folds 2 --workers 1

The rank count must be 1 + groups x folds x (ranks of one training run); a wrong count
is an error that says which counts fit (nbdist.layout).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nbdist.errors import UserError
from nbdist.hpo.reads import check_space_is_read
from nbdist.hpo.runner import StudyResult, StudyRunner
from nbdist.hpo.trial import check_study, study_layout
from nbdist.options import StudyOptions, TrainOptions
from nbdist.roles.study import MPIGroups, serve_group
from nbdist.store import place_store
from nbdist.train.definition import ModelDefinition
from nbdist.train.stopping import StopFlag
from nbdist.transport.interfaces import launch_spans_hosts

__all__ = ["run_study"]


def run_study(
    study: StudyOptions,
    train: TrainOptions,
    definition: ModelDefinition | Callable[[], ModelDefinition],
    comm: Any = None,
    say: Callable[[str], None] = print,
) -> StudyResult | None:
    """Collective over `comm` (default COMM_WORLD): the StudyResult on rank 0, None elsewhere."""
    from nbdist.transport.agreement import agree
    from nbdist.transport.node import world

    comm = world() if comm is None else comm
    check_study(study, train)
    layout = study_layout(study, train, comm.Get_size())
    stop = StopFlag()
    stop.install()
    runner, error = None, None
    if comm.Get_rank() == 0:
        try:  # the searcher, the store and a resumed study's state: the coordinator's
            check_space_is_read(study, train, definition)
            # Its trials' leaders record their runs in the store too: from every host of the launch.
            database = place_store(train.store, train.runs_dir, several_hosts=launch_spans_hosts())
            runner = StudyRunner(study, train, MPIGroups(comm, layout), database, say)
        except UserError as exc:
            error = exc
    agree(comm, error)
    name = comm.bcast(runner.name if runner else None, root=0)
    comms = layout.split(comm)
    try:
        if runner is None:
            serve_group(comm, comms, layout, name, study, train, definition, stop)
            return None
        say(
            f"nbdist: study {name}: {layout.describe()}; {study.searcher}, {runner.scheduler_text}, "
            f"{runner.scheduler.trials()} trials, "
            f"{study.objective} ({study.resolved_direction})"
        )
        _stop_on_signal(stop, runner)
        return runner.run()
    finally:
        comms.free()


def _stop_on_signal(stop: StopFlag, runner: StudyRunner) -> None:
    """SIGUSR1/SIGTERM on the coordinator: stop the running trials, end the study
    (unfinished trials are trained again by --resume-study)."""
    import signal

    def handler(signum: int, _frame: object) -> None:
        stop.request(f"stopped by {signal.Signals(signum).name}")
        runner.stop(stop.reason)

    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, handler)
