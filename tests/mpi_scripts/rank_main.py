"""Entry point for the test scripts run under mpiexec: a failing rank prints its
traceback and aborts the job, so the others never wait for it until the test's timeout."""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable

from mpi4py import MPI


def run_or_abort(main: Callable[[], None]) -> None:
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
