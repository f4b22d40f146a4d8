"""Training throughput with the live dashboard on vs off, in one run.

A notebook's cluster of 4 MPI engines trains the digits CNN (allreduce, 4 ranks) several
times, alternating: dashboard off, dashboard on, off, on, ... "On" is the real thing: the
job's dashboard served from the client process (as `job.dashboard()` is in a notebook)
and open in headless Chromium, so every poll streams new points to a browser that draws
them. Throughput is nbdist's own samples/s per epoch over the middle epochs (for "on",
only the epochs that ended after the page had drawn its first points: loading Bokeh's
JavaScript is a one-off); the ratio compares the medians of the "on" and "off" runs. The
table also shows where the dashboard's CPU goes: the client's (Panel's server, the polls)
and Chromium's, per second of training.

    .venv/bin/python bench/dashboard_overhead.py [--quick]

The dashboard's cost lands on the client (the notebook) and the browser, not on the
ranks: on a cluster they run on other nodes. On this 2-core machine the 4 ranks, the
client and Chromium share the same two cores, which is the worst case for this ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, aim, header, table

CHROMIUM = "/usr/bin/chromium"
# Points drawn in the throughput figure: the rows of its renderers' data sources.
THROUGHPUT_POINTS = """() => {
    const doc = Bokeh.documents[0]; if (!doc) return 0;
    const figs = [...doc._all_models.values()].filter(m => m.name === 'nbdist-throughput');
    if (!figs.length) return 0;
    return figs[0].renderers.reduce((n, r) => n + (r.data_source ? r.data_source.get_length() : 0), 0);
}"""


def cpu_seconds(processes) -> float:
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
            total += times.user + times.system
        except Exception:  # a renderer that exited meanwhile
            pass
    return total


def chromium_processes() -> list:
    import psutil

    return [p for p in psutil.Process().children(recursive=True) if "chrom" in p.name()]


def middle_throughput(job, after: float = 0.0) -> float:
    """Median samples/s of the epochs that ended after `after` (time.time()), leaving out
    the first (warm-up) and the last (final validation) where there are enough."""
    epochs = [r["values"]["samples_per_s"] for r in job.records if r["kind"] == "epoch" and r["time"] > after]
    middle = epochs[1:-1] if len(epochs) > 3 else epochs
    return statistics.median(middle)


def train(cluster, epochs: int, runs_dir: str):
    import nbdist

    return nbdist.train(
        str(ROOT / "examples" / "digits_cnn.py"),
        cluster=cluster,
        topology="allreduce",
        epochs=epochs,
        quiet=True,
        runs_dir=runs_dir,
    )


def with_dashboard(cluster, epochs: int, runs_dir: str, browser) -> tuple[float, int, float, float]:
    """Train while the job's dashboard is served and open in the browser; returns the
    throughput, how many points the browser's throughput plot received, and the client's
    and Chromium's CPU seconds per second of training while the page was drawing."""
    import panel as pn
    import psutil
    from playwright.sync_api import Error as PlaywrightError

    from nbdist.dashboard import dashboard
    from nbdist.dashboard.access import TokenAuth, dashboard_token
    from nbdist.dashboard.serve import free_port

    job = train(cluster, epochs, runs_dir)
    board = dashboard(job=job)
    port, token = free_port("127.0.0.1"), dashboard_token()
    server = pn.serve(
        {"job": lambda: board.start().page},
        port=port,
        address="127.0.0.1",
        show=False,
        threaded=True,
        auth_provider=TokenAuth(token),
    )
    page = browser.new_page(viewport={"width": 1150, "height": 2000})
    deadline = time.monotonic() + 60
    while True:  # the server thread starts listening a moment later
        try:
            page.goto(f"http://127.0.0.1:{port}/job?token={token}", timeout=120_000)
            break
        except PlaywrightError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    while not page.evaluate(THROUGHPUT_POINTS):  # Bokeh loaded, the first points drawn
        if time.monotonic() > deadline + 120:
            raise RuntimeError("the dashboard drew no throughput points within 3 minutes")
        time.sleep(0.2)
    # The "on" epochs are those that ended while the page was drawing.
    opened, client, browser_cpu = time.time(), psutil.Process(), chromium_processes()
    client_before, browser_before = cpu_seconds([client]), cpu_seconds(browser_cpu)
    job.wait(timeout=1800)
    trained = time.time() - opened
    client_cpu, browser_used = cpu_seconds([client]) - client_before, cpu_seconds(browser_cpu) - browser_before
    time.sleep(2 * board.period_ms / 1000)  # the last poll reaches the page
    points = page.evaluate(THROUGHPUT_POINTS)
    page.close()
    server.stop()
    board.close()
    return middle_throughput(job, after=opened), points, client_cpu / trained, browser_used / trained


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer epochs and rounds")
    parser.add_argument("--rounds", type=int, default=None, help="off/on pairs (default 3, quick 2)")
    args = parser.parse_args()
    epochs = 60 if args.quick else 150
    rounds = args.rounds or (2 if args.quick else 3)

    import tempfile

    from playwright.sync_api import sync_playwright

    import nbdist

    header("dashboard overhead: digits CNN, allreduce on a 4-engine notebook cluster, dashboard off vs on")
    off, on, received, costs = [], [], [], []
    with tempfile.TemporaryDirectory() as runs_dir, nbdist.Cluster(n=4) as cluster, sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
            ],
        )
        train(cluster, 2, runs_dir).wait()  # warm-up: imports and first-touch on every engine
        for _ in range(rounds):
            off.append(middle_throughput(train(cluster, epochs, runs_dir).wait()))
            speed, points, client_cpu, browser_cpu = with_dashboard(cluster, epochs, runs_dir, browser)
            on.append(speed)
            received.append(points)
            costs.append((client_cpu, browser_cpu))
        browser.close()
    ratio = statistics.median(on) / statistics.median(off)
    table(
        [
            [f"round {i + 1}", f"{a:,.0f}", f"{b:,.0f}", f"{b / a:.3f}", n, f"{c:.2f}", f"{w:.2f}"]
            for i, (a, b, n, (c, w)) in enumerate(zip(off, on, received, costs, strict=True))
        ],
        ["", "off samples/s", "on samples/s", "on/off", "points drawn", "client cpu/s", "chromium cpu/s"],
    )
    print(f"median: off {statistics.median(off):,.0f} samples/s, on {statistics.median(on):,.0f} samples/s")
    aim("dashboard on vs off, training throughput", 0.98, ratio)
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    sys.exit(main())
