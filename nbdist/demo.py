"""`make demo`: real distributed trainings on a local MPI job, on scikit-learn's digits,
with their live dashboard.

Runs the same CNN with three set-ups, each as its own `mpiexec` job, and prints the
comparison and where every run's results are:

- master/worker with asynchronous EASGD: 1 master + 4 workers;
- master/worker with GEM: 1 master + 4 workers (staleness-aware);
- allreduce (synchronous SGD with overlapped gradient buckets): 4 ranks.

(`--workers N` for another number of workers.)

While they train, the dashboard is served on localhost (its URL is printed: open it to
watch the runs live); at the end each run's dashboard is also saved as one HTML file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from nbdist.launch import mpi_env, mpiexec_command


def runs(workers: int) -> list[tuple[str, int, list[str]]]:
    """The set-ups: (title, ranks, options), each with `workers` workers."""
    return [
        (
            f"easgd, async, 1 master + {workers} workers",
            workers + 1,
            ["--topology", "master-worker", "--algorithm", "easgd"],
        ),
        (
            f"gem, async, 1 master + {workers} workers",
            workers + 1,
            ["--topology", "master-worker", "--algorithm", "gem(lr=0.05, momentum=0.9, kappa=1.0)"],
        ),
        (f"allreduce, {workers} ranks", workers, ["--topology", "allreduce"]),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--runs-dir", default="runs/demo")
    parser.add_argument("--model", default=str(Path(__file__).resolve().parent.parent / "examples" / "digits_cnn.py"))
    parser.add_argument("--no-dashboard", action="store_true", help="neither serve nor save the dashboard")
    # Fewer ranks start faster on a small machine: the test suite's run takes 2.
    parser.add_argument("--workers", type=int, default=4, help="workers of each set-up (default 4)")
    args = parser.parse_args(argv)

    stamp = time.strftime("%Y%m%d-%H%M%S")
    rows = []
    store = Path(args.runs_dir) / "nbdist.db"
    server = None if args.no_dashboard else _serve_dashboard(store)
    for title, ranks, extra in runs(args.workers):
        name = f"{stamp}-{extra[1]}-{extra[3].split('(')[0] if len(extra) > 3 else 'sgd'}"
        print(f"\n=== {title}: mpiexec -n {ranks} python -m nbdist train {' '.join(extra)}", flush=True)
        cmd = mpiexec_command(
            ranks,
            [
                "-m",
                "nbdist",
                "train",
                "--model",
                args.model,
                "--epochs",
                str(args.epochs),
                "--checkpoint-every",
                "5",
                "--runs-dir",
                args.runs_dir,
                "--run-name",
                name,
                *extra,
            ],
        )
        started = time.time()
        done = subprocess.run(cmd, env=mpi_env())
        if done.returncode != 0:
            print(f"demo: the run '{title}' failed (exit {done.returncode})", file=sys.stderr)
            _stop(server)
            return done.returncode
        summary = json.loads((Path(args.runs_dir) / name / "summary.json").read_text())
        final = summary["final"]
        rows.append(
            (
                title,
                final.get("val_acc", float("nan")),
                final.get("val_loss", float("nan")),
                time.time() - started,
                Path(args.runs_dir) / name,
            )
        )

    _stop(server)
    if not args.no_dashboard:
        from nbdist.dashboard import export_html

        print("\n=== saving each run's dashboard as one HTML file", flush=True)
        for *_, path in rows:
            export_html(store, path / "dashboard.html", run=path.name)

    print(f"\n=== digits CNN, {args.epochs} epochs")
    print(f"{'set-up':<38} {'val_acc':>8} {'val_loss':>9} {'wall s':>7}  results")
    for title, acc, loss, wall, path in rows:
        print(f"{title:<38} {acc:8.4f} {loss:9.4f} {wall:7.1f}  {path}")
    print(
        "\nEach results directory holds metrics/ (per-rank JSON-lines metric log), checkpoints/, "
        "final/model.safetensors, summary.json"
        + ("" if args.no_dashboard else " and dashboard.html")
        + f"; every run is in the run store {store}:\n  python -m nbdist dashboard --store {store}"
    )
    return 0


def _serve_dashboard(store: Path) -> subprocess.Popen | None:
    """The live dashboard of the demo's store, in the background; prints its URL."""
    from nbdist.store import RunStore

    RunStore(store).close()  # exists before the server opens it
    log = store.parent / "dashboard.log"  # a file, not a pipe: nothing here reads the server's chatter
    log.unlink(missing_ok=True)
    # Yours alone: the URL it holds carries the dashboard's token.
    with open(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "nbdist", "dashboard", "--store", str(store), "--port", "0"],
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and server.poll() is None:
        url = next(
            (
                line.split(" at ")[-1].strip()
                for line in log.read_text().splitlines()
                if line.startswith("nbdist: dashboard of")
            ),
            None,
        )
        if url:
            print(f"\n=== live dashboard: {url}  (open it to watch the runs)", flush=True)
            return server
        time.sleep(0.2)
    print(f"demo: the dashboard did not start (see {log}); training without it", file=sys.stderr)
    _stop(server)
    return None


def _stop(server: subprocess.Popen | None) -> None:
    if server is not None and server.poll() is None:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    sys.exit(main())
