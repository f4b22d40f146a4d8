"""The allreduce that nbdist's MPI environment chooses (launch.mpi_env): Open MPI's
nonblocking allreduce by Rabenseifner's algorithm instead of libnbc's binomial tree.

Open MPI takes the variable's value by name, and ignores a misspelt one with only a
warning: `ompi_info` says what the ranks will see. Under mpiexec, on 3 ranks (not a
power of two, which Rabenseifner's algorithm folds in) and buckets of every shape the
reducer makes (fewer elements than ranks, where it falls back to a ring; odd counts; a
large one), every rank ends with the same bits, and they are the sum.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, run_mpi

from nbdist.launch import mpi_env
from nbdist.transport.reducers import LIBNBC_IALLREDUCE, libnbc_note

pytestmark = pytest.mark.mpi

RANK_SCRIPT = """
import json, os, sys
import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
report = {"variable": os.environ.get(sys.argv[1]), "counts": {}}
for count in (1, 2, 3, 4, 7, 1000, 65537, 1_000_003):
    x = np.random.default_rng(comm.rank * 7919 + count).standard_normal(count).astype(np.float32)
    want = np.sum(np.stack(comm.allgather(x)).astype(np.float64), axis=0)
    buf = x.copy()
    comm.Iallreduce(MPI.IN_PLACE, buf, op=MPI.SUM).Wait()
    first = comm.bcast(buf.tobytes() if comm.rank == 0 else None)
    report["counts"][count] = {
        "error": float(np.max(np.abs(buf - want))),
        "same_bits": all(comm.allgather(buf.tobytes() == first)),
    }
if comm.rank == 0:
    print("REPORT " + json.dumps(report), flush=True)
"""


def test_open_mpi_reads_the_algorithm_nbdist_sets():
    ompi_info = Path(sys.executable).parent / "ompi_info"
    out = subprocess.run(
        [str(ompi_info), "--param", "coll", "libnbc", "--level", "9", "--parsable"],
        env=mpi_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "coll_libnbc_iallreduce_algorithm:value:rabenseifner" in out
    assert "coll_libnbc_iallreduce_algorithm:source:environment" in out


def test_a_users_own_choice_is_kept():
    assert mpi_env({LIBNBC_IALLREDUCE: "ring"})[LIBNBC_IALLREDUCE] == "ring"
    assert mpi_env({})[LIBNBC_IALLREDUCE] == "rabenseifner"


def test_in_place_iallreduce_gives_every_rank_the_same_sum(tmp_path):
    script = tmp_path / "iallreduce.py"
    script.write_text(RANK_SCRIPT)
    done = run_mpi(3, [str(script), LIBNBC_IALLREDUCE], timeout=120)
    assert done.returncode == 0, done.output
    [line] = [ln for ln in done.stdout.splitlines() if ln.startswith("REPORT ")]
    report = json.loads(line.removeprefix("REPORT "))
    assert report["variable"] == "rabenseifner"
    for count, result in report["counts"].items():
        assert result["same_bits"], count
        assert result["error"] < 1e-4, (count, result)


def test_a_job_started_without_nbdists_environment_is_told_how_to_get_it():
    by_open_mpi = {"OMPI_COMM_WORLD_SIZE": "2"}  # what Open MPI's mpiexec gives its ranks
    note = libnbc_note("mpi", 2, environ=by_open_mpi)
    assert "OMPI_MCA_coll_libnbc_iallreduce_algorithm is not set" in note
    assert "python -m nbdist launch" in note and "=rabenseifner" in note
    # Launched by nbdist, another MPI's launcher, one rank, or not MPI's reducer: nothing to say.
    assert libnbc_note("mpi", 2, environ=mpi_env(by_open_mpi)) == ""
    assert libnbc_note("mpi", 2, environ={}) == ""
    assert libnbc_note("mpi", 1, environ=by_open_mpi) == ""
    assert libnbc_note("gloo", 2, environ=by_open_mpi) == ""


def test_the_note_reaches_a_run_started_by_a_plain_mpiexec(tmp_path):
    env = {k: v for k, v in mpi_env().items() if k != LIBNBC_IALLREDUCE}
    argv = ["-m", "nbdist", "train", "--model", str(ROOT / "examples" / "digits_mlp.py"), "--topology", "allreduce"]
    done = run_mpi(2, [*argv, "--epochs", "1", "--runs-dir", str(tmp_path)], env=env)
    assert done.returncode == 0, done.output
    assert done.output.count("Open MPI picks its own algorithm for the allreduce buckets") == 1, done.output
