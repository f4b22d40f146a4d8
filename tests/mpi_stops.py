"""A batch job whose long runs are stopped by SIGUSR1 to `mpiexec`, as a batch system's
signal would stop them, for the tests that read such runs (tests/test_train_mpi.py,
tests/test_hierarchy_mpi.py): one job trains them among its other runs, so that no job
of its own starts the ranks again."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import ROOT, Completed

from nbdist.launch import mpi_env, mpiexec_command

# How long a job may go on after the SIGUSR1 to its last stopped run.
AFTER_STOP_SECONDS = 90


def epoch_logged(run_dir: Path) -> bool:
    """Whether a rank of the run in `run_dir` has written an epoch record."""
    metrics = run_dir / "metrics"
    return metrics.exists() and any(
        '"kind":"epoch"' in p.read_text(errors="replace") for p in metrics.glob("rank-*.jsonl")
    )


def run_and_stop(n: int, argv: list[str], stops: list[Path], out_dir: Path, timeout: float) -> Completed:
    """`mpiexec -n n python <argv>` (stdout and stderr kept in `out_dir`), and SIGUSR1 to
    mpiexec, which forwards it to every rank, each time the next run directory of `stops`
    holds an epoch record. A job that ends first is left to the tests (they name the run
    that failed); one that runs past `timeout`, or AFTER_STOP_SECONDS past the last
    signal, fails the test."""
    out, err = out_dir / "job.stdout", out_dir / "job.stderr"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(
            mpiexec_command(n, argv), cwd=ROOT, env=mpi_env(), stdout=stdout, stderr=stderr, start_new_session=True
        )
        try:
            deadline = time.monotonic() + timeout
            for run_dir in stops:
                while not epoch_logged(run_dir) and proc.poll() is None:
                    if time.monotonic() > deadline:
                        pytest.fail(f"no epoch of {run_dir.name} within {timeout} s:\n{out.read_text()[-3000:]}")
                    time.sleep(0.2)
                if proc.poll() is None:
                    proc.send_signal(signal.SIGUSR1)
            try:
                proc.wait(timeout=AFTER_STOP_SECONDS)
            except subprocess.TimeoutExpired:
                pytest.fail(f"still running {AFTER_STOP_SECONDS} s after SIGUSR1:\n{out.read_text()[-3000:]}")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
    return Completed(proc.returncode, out.read_text(), err.read_text())
