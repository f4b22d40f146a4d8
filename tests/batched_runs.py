"""Several `python -m nbdist ...` command lines in ONE mpiexec job (tests/mpi_scripts/
train_many.py), each cut back out of the job's output: its exit status and what it printed.
Starting Python, torch and MPI costs seconds per rank; a run that fails on bad input costs
next to nothing, so one job for a batch of them keeps such tests affordable."""

from __future__ import annotations

import json
import re
from pathlib import Path

from conftest import ROOT, Completed, run_mpi

__all__ = ["cut_at_markers", "run_many"]


def cut_at_markers(text: str, count: int) -> tuple[list[str], list[int]]:
    """Split a stream of train_many.py's job at its `nbdist-test: run I rc=RC` markers:
    what each of the first `count` runs printed on it, and their exit statuses."""
    parts, codes = [], []
    for i in range(count):
        marker = re.search(rf"^nbdist-test: run {i} rc=(-?\d+)$", text, re.MULTILINE)
        assert marker, f"no end marker for run {i}:\n{text}"
        parts.append(text[: marker.start()])
        codes.append(int(marker.group(1)))
        text = text[marker.end() :]
    return parts, codes


def run_many(ranks: int, argvs: list[list[str]], spec: Path, *, timeout: float = 240) -> list[Completed]:
    """Every command line of `argvs` (what follows `python -m nbdist`; `train` may be left
    out), in order, in one `mpiexec -n ranks` job; `spec` is where their list is written."""
    spec.write_text(json.dumps(argvs))
    done = run_mpi(ranks, [str(ROOT / "tests" / "mpi_scripts" / "train_many.py"), str(spec)], timeout=timeout)
    assert "Traceback" not in done.output, done.output
    outs, codes = cut_at_markers(done.stdout, len(argvs))
    errs, codes_err = cut_at_markers(done.stderr, len(argvs))
    assert codes == codes_err
    return [Completed(codes[i], outs[i], errs[i]) for i in range(len(argvs))]
