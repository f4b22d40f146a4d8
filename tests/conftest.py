"""Shared fixtures: real `mpiexec` runs with a timeout on every wait."""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from nbdist.launch import mpi_env, mpiexec_command

ROOT = Path(__file__).resolve().parent.parent

# The markers a test gets from the fixtures it uses (directly or through other fixtures),
# so that a new test is marked without anyone thinking of it: `make check` leaves out
# whatever these mark (pyproject.toml lists the markers).
FIXTURE_MARKS = {
    "mpirun": ("mpi",),
    "jet_sample": ("mpi", "slow"),
    "slurm": ("slurm",),
    "postgres": ("postgres",),
    "browser": ("browser",),
}


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        for name in getattr(item, "fixturenames", ()):
            for mark in FIXTURE_MARKS.get(name, ()):
                item.add_marker(mark)


@dataclass
class Completed:
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


@dataclass
class BatchedRuns:
    """The runs of one mpiexec job that trained several configurations: their exit codes
    (by run name), their directories and the job's output."""

    output: str
    returncode: int
    runs_dir: Path
    codes: dict

    def run(self, name: str) -> Path:
        assert self.codes.get(name) == 0, (
            f"run {name!r}: exit status {self.codes.get(name)} (job status {self.returncode})\n{self.output[-6000:]}"
        )
        return self.runs_dir / name

    def summary(self, name: str) -> dict:
        return json.loads((self.run(name) / "summary.json").read_text())


def listening(processes) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket these processes listen on (psutil)."""
    import psutil

    found = set()
    for process in processes:
        try:
            connections = process.net_connections(kind="inet")
        except psutil.Error:
            continue
        found |= {(c.laddr.ip, c.laddr.port) for c in connections if c.status == psutil.CONN_LISTEN}
    return found


def run_mpi(
    n: int, argv: list[str], *, timeout: float = 120, cwd: Path | None = None, env: dict[str, str] | None = None
) -> Completed:
    """Run `mpiexec -n n python <argv>` (in `env`, by default nbdist's MPI environment); a
    run that outlives `timeout` fails the test."""
    cmd = mpiexec_command(n, argv)
    try:
        proc = subprocess.run(
            cmd, cwd=cwd or ROOT, env=mpi_env() if env is None else env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = (exc.stderr or b"").decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        pytest.fail(f"mpiexec -n {n} {' '.join(argv)} hung for {timeout}s\n{out}\n{err}")
    return Completed(proc.returncode, proc.stdout, proc.stderr)


def run_python(argv: list[str], *, timeout: float = 120, cwd: Path | None = None) -> Completed:
    """Run `python <argv>` (one process, no mpiexec) with the MPI environment."""
    try:
        proc = subprocess.run(
            [sys.executable, *argv],
            cwd=cwd or ROOT,
            env=mpi_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"python {' '.join(argv)} hung for {timeout}s")
    return Completed(proc.returncode, proc.stdout, proc.stderr)


def kill_when(n: int, argv: list[str], ready, *, timeout: float, what: str) -> None:
    """Start `mpiexec -n n python <argv>` in a session of its own, look every 0.1 s until
    `ready()` says so, then kill the whole job with SIGKILL: no handler runs, it vanishes.
    The job ending first, or `timeout` s without `ready()`, fails the test (`what` says
    what was awaited)."""
    import os
    import signal

    job = subprocess.Popen(
        mpiexec_command(n, argv),
        cwd=ROOT,
        env=mpi_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + timeout
        while not ready():
            assert job.poll() is None, job.communicate()[0][-3000:]
            assert time.monotonic() < deadline, f"{what} within {timeout} s"
            time.sleep(0.1)
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.communicate(timeout=60)


@pytest.fixture
def mpirun():
    return run_mpi


@pytest.fixture
def pyrun():
    return run_python


# -- a headless browser for the page tests ----------------------------------------------------
CHROMIUM = "/usr/bin/chromium"


@pytest.fixture(scope="module")
def browser():
    """Debian's Chromium driven by Playwright, for the tests that load pages (dashboard,
    notebooks offline)."""
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
    if not Path(CHROMIUM).exists():
        if os.environ.get("CI"):
            pytest.fail("Debian's chromium is missing: .ci/run installs it (apt-get install chromium)")
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run does)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
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
        yield browser
        browser.close()


# -- one generated jet sample for the whole session ----------------------------------------
# The settings of notebooks/02_jet_tagging.ipynb's sample: its test hands these files to
# the notebook, which then finds them made and generates nothing (see test_notebooks).
JET_SAMPLE = dict(events=2000, files=6, underlying_event=False, seed=7)


@pytest.fixture(scope="session")
def jet_sample(tmp_path_factory):
    """2000 top and QCD jet images made by `python -m nbdist datasets jet-images` on two
    MPI ranks, as a user would make them."""
    pytest.importorskip("pythia8mc")
    out = tmp_path_factory.mktemp("jets") / "jets"
    done = run_mpi(
        2,
        [
            "-m",
            "nbdist",
            "datasets",
            "jet-images",
            "--signal",
            "top",
            "--out",
            str(out),
            "--events",
            str(JET_SAMPLE["events"]),
            "--files",
            str(JET_SAMPLE["files"]),
            "--no-underlying-event",
            "--seed",
            str(JET_SAMPLE["seed"]),
        ],
        timeout=300,
    )
    assert done.returncode == 0, done.output
    from nbdist.datasets import jet_images

    sample = jet_images(out, **JET_SAMPLE)  # the files are there: nothing is generated
    assert sample.made == 0 and sample.reused == 8, sample
    return sample


class OutputLines:
    """A server process's standard output, read on a thread so that a wait for one line
    has a deadline: every line is kept in `lines`, in order."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self._queue: queue.Queue = queue.Queue()
        threading.Thread(
            target=lambda: [self._queue.put(line) or self.lines.append(line) for line in proc.stdout], daemon=True
        ).start()

    def wait_for(self, pattern: str, timeout: float) -> re.Match | None:
        """The match of the first line (not yet waited past) that matches `pattern`; None
        when none came within `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._queue.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue.Empty:
                return None
            match = re.search(pattern, line)
            if match:
                return match

    @property
    def text(self) -> str:
        return "".join(self.lines)
