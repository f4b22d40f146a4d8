"""The fixed cost of an nbdist job: everything but the training, from launch to exit.

Every mpiexec job of the test suite (and every short job of a user) pays, on each rank,
the interpreter, nbdist's and the framework's imports, MPI's start, the model and data
set-up with its checks, and the end of the job; the training of a small model is a
fraction of it. This script runs the same short job (the digits MLP, one epoch, on
`--ranks` ranks, master-worker and allreduce) as the test suite launches it (nbdist's
`mpi_env()`, `mpiexec_command()`), and a peer in the same rounds:

  floor   `mpiexec -n R python -c "import torch, torch.optim; from mpi4py import MPI"`:
          what any PyTorch job on MPI pays before it does anything (no nbdist at all)
  REV     with `--against REV` (e.g. main before a change): the same jobs with the
          nbdist package of git revision REV (exported to a temporary directory and put
          first on PYTHONPATH), this tree's model file and launcher

Each round runs the floor, then each job with this tree's code and with REV's, so that the
load of the box falls alike on all. Wall time is the launcher's; CPU time is the job's
processes' (user + system, getrusage of the children). The table gives medians and the
ratios (job / floor: how much nbdist adds to the bare imports; this tree / REV). A second
table splits a rank's time into phases (bench/_startup_rank.py marks them; medians over
the rounds, rank 0 and rank 1 of this tree's jobs); `exit` is from a rank's return from
main() to the end of mpiexec.

Usage: python bench/startup.py [--rounds N] [--ranks R] [--against REV]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ROOT, header, table  # noqa: E402

from nbdist.launch import mpi_env, mpiexec_command  # noqa: E402

MODEL = "examples/digits_mlp.py"
JOBS = {
    "master-worker": ["--topology", "master-worker"],
    "allreduce": ["--topology", "allreduce"],
}
FLOOR = "import torch, torch.optim; from mpi4py import MPI"
TIMEOUT = 300


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, float, float]:
    """(wall s, CPU s of the job's processes, end time) of one run; a failure stops the script."""
    cpu0, t0 = children_cpu(), time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    wall, end = time.perf_counter() - t0, time.time()
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
    return wall, children_cpu() - cpu0, end


def export_revision(rev: str, into: Path) -> Path:
    """The nbdist package of git revision `rev`, unpacked under `into` (for PYTHONPATH)."""
    into.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "nbdist"], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def job_command(ranks: int, job: str, runs_dir: Path) -> list[str]:
    argv = [str(ROOT / "bench" / "_startup_rank.py"), "train", "--model", MODEL, "--epochs", "1", "--quiet"]
    return mpiexec_command(ranks, [*argv, *JOBS[job], "--runs-dir", str(runs_dir)])


def phases(marks_dir: Path, launched: float, ended: float) -> dict[int, dict[str, tuple[float, float]]]:
    """Per rank: phase -> (wall s, CPU s) spent in it, from the launch to the job's end."""
    out = {}
    for file in marks_dir.glob("rank-*.json"):
        got = json.loads(file.read_text())
        rows, last_t, last_cpu = {}, launched, 0.0
        for name, t, cpu in got["marks"]:
            rows[name] = (t - last_t, cpu - last_cpu)
            last_t, last_cpu = t, cpu
        rows["exit (after main)"] = (ended - last_t, float("nan"))
        out[got["rank"]] = rows
        file.unlink()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=3)
    parser.add_argument("--against", default=None, help="a git revision whose nbdist is measured too, e.g. main")
    parser.add_argument("--jobs", default=",".join(JOBS), help=f"which of {', '.join(JOBS)}")
    args = parser.parse_args()
    jobs = [j.strip() for j in args.jobs.split(",") if j.strip()]
    for job in jobs:
        if job not in JOBS:
            raise SystemExit(f"bench/startup.py: error: --jobs {job!r}: choose from {', '.join(JOBS)}")
    header(f"start-up and end of a {args.ranks}-rank nbdist job ({MODEL}, 1 epoch)")
    with tempfile.TemporaryDirectory(prefix="nbdist-startup-") as tmp:
        tmp_path = Path(tmp)
        variants = {"this tree": str(ROOT)}
        if args.against:
            variants[args.against] = str(export_revision(args.against, tmp_path / "against"))
        marks = tmp_path / "marks"
        marks.mkdir()
        base = mpi_env()
        walls: dict[str, list[float]] = {}
        cpus: dict[str, list[float]] = {}
        split: dict[tuple[str, str, int], list[tuple[float, float]]] = {}
        for round_ in range(args.rounds):
            env = dict(base, PYTHONPATH=str(ROOT))
            wall, cpu, _ = timed(mpiexec_command(args.ranks, ["-c", FLOOR]), env)
            walls.setdefault("floor", []).append(wall)
            cpus.setdefault("floor", []).append(cpu)
            for job in jobs:
                for variant, path in variants.items():
                    env = dict(base, PYTHONPATH=path, NBDIST_STARTUP_MARKS=str(marks))
                    launched = time.time()
                    wall, cpu, ended = timed(job_command(args.ranks, job, tmp_path / "runs"), env)
                    walls.setdefault(f"{job}, {variant}", []).append(wall)
                    cpus.setdefault(f"{job}, {variant}", []).append(cpu)
                    for rank, rows in phases(marks, launched, ended).items():
                        for name, value in rows.items():
                            split.setdefault((f"{job}, {variant}", name, rank), []).append(value)
            print(f"   round {round_ + 1} of {args.rounds} done", file=sys.stderr, flush=True)
        report(walls, cpus, split, jobs, list(variants), args)


def report(walls, cpus, split, jobs, variants, args) -> None:
    floor_wall, floor_cpu = statistics.median(walls["floor"]), statistics.median(cpus["floor"])
    rows = [["floor (import torch, torch.optim, mpi4py)", floor_wall, floor_cpu, 1.0, 1.0, "", ""]]
    for job in jobs:
        for variant in variants:
            key = f"{job}, {variant}"
            wall, cpu = statistics.median(walls[key]), statistics.median(cpus[key])
            vs = ["", ""]
            if variant != "this tree":
                mine = f"{job}, this tree"
                vs = [statistics.median(walls[mine]) / wall, statistics.median(cpus[mine]) / cpu]
            rows.append([key, wall, cpu, wall / floor_wall, cpu / floor_cpu, *vs])
    print(f"medians of {args.rounds} rounds; CPU: all processes of the job, user + system")
    table(
        rows,
        ["job", "wall s", "CPU s", "wall / floor", "CPU / floor", "this tree / REV wall", "this tree / REV CPU"],
    )
    for job in jobs:
        for variant in variants:
            key = f"{job}, {variant}"
            names = [name for (k, name, rank) in split if k == key and rank == 0]
            out = []
            for name in names:
                row: list = [name]
                for rank in (0, 1):
                    values = split.get((key, name, rank), [])
                    row += [
                        statistics.median(v[0] for v in values) if values else float("nan"),
                        statistics.median(v[1] for v in values) if values else float("nan"),
                    ]
                out.append(row)
            print(f"phases of one rank, {key} (medians; wall from the previous mark, CPU of that rank)")
            table(out, ["phase (ends at)", "rank 0 wall s", "rank 0 CPU s", "rank 1 wall s", "rank 1 CPU s"])


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
