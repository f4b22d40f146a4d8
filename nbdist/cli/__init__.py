"""`python -m nbdist ...`: the batch command line, with the same options as the magics.

    python -m nbdist launch -n 4 train --model examples/digits_mlp.py --algorithm easgd
    python -m nbdist slurm-script -n 8 --time 02:00:00 --write job.sh -- train --model model.py   # sbatch job.sh
    mpiexec -n 4 python -m nbdist train --model examples/digits_mlp.py --algorithm easgd
    python -m nbdist launch -n 4 scale --model examples/digits_cnn.py --quick    # a scaling study
    mpiexec -n 9 python -m nbdist study --model examples/digits_mlp.py --space "lr=log(1e-3,0.3)" --groups 2 --folds 2
    python -m nbdist layout --workers 4 --masters 2
    python -m nbdist dashboard --store runs/nbdist.db        # live, on localhost
    python -m nbdist store import runs/<run>                 # a run directory into the store
    mpiexec -n 4 python -m nbdist datasets jet-images --signal top --events 20000 --out data/jets/

Errors in the user's input print one line, `nbdist: error: ...`, on the first rank only,
and every rank exits with status 2; a failure while training exits with status 1.

The modules: parser.py (every command's options and help), commands.py (the commands that
run here, or on each rank of a job), launching.py (launch and slurm-script, which start one).
"""

from __future__ import annotations

import sys
import time
import traceback

from nbdist.cli.commands import _dashboard, _datasets, _layout, _scale, _store, _study, _train, world_rank
from nbdist.cli.launching import _launch, _slurm_script
from nbdist.cli.parser import DEFAULT_RUNS_DIR as DEFAULT_RUNS_DIR
from nbdist.cli.parser import DEFAULT_STORE as DEFAULT_STORE
from nbdist.cli.parser import LAUNCHABLE as LAUNCHABLE
from nbdist.cli.parser import build_parser
from nbdist.errors import DiskFull, UserError
from nbdist.train.diskspace import disk_full, is_disk_full
from nbdist.transport.faults import RunFailure, ulfm_enabled

__all__ = ["main", "run", "build_parser"]

# How long a rank leaving without MPI_Finalize with a failure status waits first (run()).
LAST_WORDS_SECONDS = 0.5

# Each command and the function that runs it (the functions live in commands.py and launching.py).
COMMANDS = {
    "train": _train,
    "study": _study,
    "scale": _scale,
    "launch": _launch,
    "slurm-script": _slurm_script,
    "layout": _layout,
    "dashboard": _dashboard,
    "store": _store,
    "datasets": _datasets,
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv[0] if argv and argv[0] in COMMANDS else None).parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except RunFailure as exc:
        # Every rank of the run raises it; the one that recorded it first says it.
        if _reports(exc):
            print(f"nbdist: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except UserError as exc:
        # Raised in a run: the rank that recorded it first says it (a worker's full disk);
        # before one (bad options, every rank alike): rank 0.
        if getattr(exc, "reported_here", world_rank() == 0):
            print(f"nbdist: error: {exc}", file=sys.stderr, flush=True)
        # A full disk ends the run as a failed rank does (status 1, as on the other ranks).
        return 1 if isinstance(exc, DiskFull) else 2
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bug or a failure inside user code while training
        rank = world_rank()
        if is_disk_full(exc):  # set-up's own files, before there is a run to report it in
            if rank == 0:
                print(f"nbdist: error: {disk_full(exc)}", file=sys.stderr, flush=True)
            return 1
        # The run's other ranks were told over its control channel and end on their own.
        sys.stderr.write(f"nbdist: rank {rank} failed:\n{traceback.format_exc()}")
        line = getattr(exc, "failure_line", None)  # recorded in the run directory, with what to do next
        if line and getattr(exc, "reported_here", False):
            sys.stderr.write(f"nbdist: error: {line}\n")
        sys.stderr.flush()
        return 1


def run() -> None:
    """`python -m nbdist` and the `nbdist` command: main(), then exit with its status.

    With MPI fault tolerance on, every rank leaves without MPI_Finalize: after a rank died
    or was removed, finalizing can wait forever for it (1 job in 6 did, here), and it
    must be all ranks or none (a rank that finalizes waits for one that did not). There
    is nothing left to finalize for: the run's files are written and closed, and its last
    messages were received (the run leader waits for every rank's end).

    A rank that leaves so with a failure status ends the whole job: mpiexec takes the
    other ranks down, with the error line the reporting rank has yet to write or mpiexec
    yet to forward. Such a rank waits LAST_WORDS_SECONDS first. A rank that leaves with
    status 0 ends nothing, and mpiexec reads its output to the end: it leaves at once
    (bench/results/2026-11-28-test-suite.md, "A rank's last words")."""
    import os

    status = main()
    if ulfm_enabled():
        sys.stdout.flush()
        sys.stderr.flush()
        if status != 0:
            time.sleep(LAST_WORDS_SECONDS)
        os._exit(status)
    sys.exit(status)


def _reports(failure: RunFailure) -> bool:
    """Whether this rank is the one to print `failure`: the first to record it in the run
    directory, or, before there is one, the lowest rank that did not fail."""
    if failure.reported_here is not None:
        return failure.reported_here
    if failure.run_dir is not None:
        return False
    try:
        from mpi4py import MPI

        size = MPI.COMM_WORLD.Get_size()
    except Exception:  # no MPI: a single process
        return True
    alive = [r for r in range(size) if r not in failure.ranks]
    return bool(alive) and world_rank() == alive[0]
