"""`make demo`: real distributed trainings on a local MPI job, on scikit-learn's digits.

Runs the same CNN with three set-ups, each as its own `mpiexec` job, and prints the
comparison and where every run's results are:

- master/worker with asynchronous EASGD: 1 master + 4 workers;
- master/worker with GEM: 1 master + 4 workers (staleness-aware);
- allreduce (synchronous SGD with overlapped gradient buckets): 4 ranks.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from nbdist.launch import mpi_env, mpiexec_command

RUNS = [
    ("easgd, async, 1 master + 4 workers", 5,
     ["--topology", "master-worker", "--algorithm", "easgd"]),
    ("gem, async, 1 master + 4 workers", 5,
     ["--topology", "master-worker", "--algorithm", "gem(lr=0.05, momentum=0.9, kappa=1.0)"]),
    ("allreduce, 4 ranks", 4, ["--topology", "allreduce"]),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--runs-dir", default="runs/demo")
    parser.add_argument("--model", default=str(Path(__file__).resolve().parent.parent / "examples" / "digits_cnn.py"))
    args = parser.parse_args(argv)

    stamp = time.strftime("%Y%m%d-%H%M%S")
    rows = []
    for title, ranks, extra in RUNS:
        name = f"{stamp}-{extra[1]}-{extra[3].split('(')[0] if len(extra) > 3 else 'sgd'}"
        print(f"\n=== {title}: mpiexec -n {ranks} python -m nbdist train {' '.join(extra)}", flush=True)
        cmd = mpiexec_command(ranks, ["-m", "nbdist", "train", "--model", args.model,
                                      "--epochs", str(args.epochs), "--checkpoint-every", "5",
                                      "--runs-dir", args.runs_dir, "--run-name", name, *extra])
        started = time.time()
        done = subprocess.run(cmd, env=mpi_env())
        if done.returncode != 0:
            print(f"demo: the run '{title}' failed (exit {done.returncode})", file=sys.stderr)
            return done.returncode
        summary = json.loads((Path(args.runs_dir) / name / "summary.json").read_text())
        final = summary["final"]
        rows.append((title, final.get("val_acc", float("nan")), final.get("val_loss", float("nan")),
                     time.time() - started, Path(args.runs_dir) / name))

    print("\n=== digits CNN, {} epochs".format(args.epochs))
    print(f"{'set-up':<38} {'val_acc':>8} {'val_loss':>9} {'wall s':>7}  results")
    for title, acc, loss, wall, path in rows:
        print(f"{title:<38} {acc:8.4f} {loss:9.4f} {wall:7.1f}  {path}")
    print("\nEach results directory holds metrics/ (per-rank JSON-lines metric log), "
          "checkpoints/, final/model.safetensors and summary.json.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
