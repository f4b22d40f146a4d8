"""The dashboard for real: served by `python -m nbdist dashboard` for a batch run that is
training under mpiexec, loaded in headless Chromium (Debian's chromium, driven by
Playwright), and asserted on what a person would see: the plots, points arriving while
the page is open, the run's status. Also the token on public interfaces, the
jupyter-server-proxy entry, the static export and the study view."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("panel")
from playwright.sync_api import sync_playwright  # noqa: E402

from nbdist.dashboard.serve import free_port  # noqa: E402
from nbdist.launch import mpi_env, mpiexec_command  # noqa: E402
from nbdist.store import RunStore  # noqa: E402

from conftest import ROOT  # noqa: E402

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]

CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = ROOT / "test-artifacts"
LIVE_PLOTS = ("throughput", "staleness", "loss-by-samples", "timeline", "cpu")
# Points drawn in a named figure: the rows of its renderers' data sources.
COUNT_POINTS = """(name) => {
  const doc = Bokeh.documents[0]; if (!doc) return null;
  const figs = [...doc._all_models.values()].filter(m => m.name === name);
  if (figs.length !== 1) return null;
  return figs[0].renderers.filter(r => !(r.name || "").endsWith("-reference"))  // a fixed line, not the run's
    .map(r => r.data_source ? r.data_source.get_length() : 0).reduce((a, b) => a + b, 0);
}"""


class Server:
    """A `python -m nbdist ...` server process and the URL it printed."""

    def __init__(self, argv: list[str], timeout: float = 120):
        self.proc = subprocess.Popen([sys.executable, "-m", "nbdist", *argv], cwd=ROOT, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in self.proc.stdout], daemon=True).start()
        self.output, deadline = "", time.monotonic() + timeout
        while True:
            try:
                line = lines.get(timeout=max(deadline - time.monotonic(), 0.1))
            except queue.Empty:
                self.stop()
                pytest.fail(f"the server printed no URL within {timeout} s:\n{self.output}")
            self.output += line
            match = re.search(r"nbdist: dashboard of .* at (http\S+)", line)
            if match:
                self.url = match.group(1)
                return

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        if os.environ.get("CI"):
            pytest.fail("Debian's chromium is missing: .ci/run installs it (apt-get install chromium)")
        pytest.skip("Debian's chromium is not installed (apt-get install chromium; .ci/run does)")
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        yield browser
        browser.close()


def _wait(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        time.sleep(0.25)


def _counts(page) -> dict[str, int | None]:
    return {name: page.evaluate(COUNT_POINTS, f"nbdist-{name}") for name in LIVE_PLOTS}


def _header(page) -> str:
    """The line above the plots: run, status, layout, latest metrics (Playwright's text
    search looks inside the shadow roots Panel renders into)."""
    header = page.get_by_text(re.compile(r"\d+ records$"))
    return header.first.inner_text() if header.count() else ""


def test_live_dashboard_of_a_training_run_in_chromium(tmp_path, browser):
    store = tmp_path / "nbdist.db"
    train = subprocess.Popen(
        mpiexec_command(3, ["-m", "nbdist", "train", "--model", "examples/digits_mlp.py", "--epochs", "100000",
                            "--runs-dir", str(tmp_path), "--quiet"]),
        cwd=ROOT, env=mpi_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    server = None
    try:
        server = Server(["dashboard", "--store", str(store), "--create", "--port", "0"])  # before the run made it
        page = browser.new_page(viewport={"width": 1150, "height": 2000})
        # A model sent to the browser out of order shows up here ("reference ... isn't
        # known"), and the plots it belongs to are never drawn.
        page_errors: list[str] = []
        page.on("pageerror", lambda error: page_errors.append(str(error)))
        page.goto(server.url, timeout=120_000)
        # The plots of the run appear (the dashboard may have started before the run).
        counts = _wait(lambda: (c := _counts(page)) and all(v for v in c.values()) and c, 120,
                       "the live plots never showed the run's points")
        # New points arrive while the page is open.
        for name in ("throughput", "staleness", "loss-by-samples"):
            _wait(lambda: (page.evaluate(COUNT_POINTS, f"nbdist-{name}") or 0) > counts[name], 60,
                  f"no new points reached the {name} plot")
        run_id = next(p.name for p in tmp_path.iterdir() if p.is_dir())
        header = _header(page)
        assert run_id in header and "running" in header and "1 master + 2 workers" in header
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "dashboard-live.png"), full_page=True)

        train.send_signal(signal.SIGUSR1)  # mpiexec forwards it: every rank stops at a step boundary
        train.communicate(timeout=120)
        _wait(lambda: "stopped" in _header(page), 60, "the page never showed the run as stopped")
        assert not page_errors, page_errors
        page.close()
    finally:
        if train.poll() is None:
            os.killpg(train.pid, signal.SIGKILL)
            train.communicate(timeout=60)
        if server is not None:
            server.stop()

    # The same run, exported as one HTML file, opens offline with its plots drawn.
    export = tmp_path / "dashboard.html"
    done = subprocess.run([sys.executable, "-m", "nbdist", "dashboard", "--store", str(store), "--export",
                           str(export)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    page = browser.new_page(viewport={"width": 1150, "height": 2000})
    page.route("**/*", lambda route: route.abort() if not route.request.url.startswith("file:") else route.continue_())
    page.goto(export.as_uri())
    exported = _wait(lambda: (c := _counts(page)) and all(v for v in c.values()) and c, 60,
                     "the exported page drew no plots")
    assert exported["throughput"] > 0 and exported["loss-by-samples"] > 0
    assert "stopped" in _header(page)
    page.screenshot(path=str(ARTIFACTS / "dashboard-export.png"), full_page=True)
    page.close()


def _get(url: str, cookie: str | None = None) -> tuple[int, str, str | None]:
    request = urllib.request.Request(url, headers={"Cookie": cookie} if cookie else {})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode(), response.headers.get("Set-Cookie")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(), None


def test_a_public_interface_needs_the_token(tmp_path):
    RunStore(tmp_path / "nbdist.db").close()
    server = Server(["dashboard", "--store", str(tmp_path / "nbdist.db"), "--address", "0.0.0.0", "--port", "0"])
    try:
        assert "(no runs yet)" in server.output
        token = re.search(r"\?token=(\S+)", server.url).group(1)
        local = re.sub(r"//[^:/]+:", "//127.0.0.1:", server.url)
        status, body, cookie = _get(local)
        assert status == 200 and "Bokeh" in body and cookie.startswith("nbdist-dashboard-token=")
        bare = local.split("?")[0]
        status, body, _ = _get(bare)
        assert status == 403 and "needs its token" in body and "Bokeh" not in body
        assert _get(bare + "?token=wrong")[0] == 403
        assert _get(bare, cookie=f"nbdist-dashboard-token={token}")[0] == 200
    finally:
        server.stop()


def test_the_jupyter_server_proxy_entry_serves_under_the_hub_prefix(tmp_path):
    from nbdist.dashboard.proxy import PROXY_NAME, server_process

    entry = server_process()
    port, base_url = free_port("127.0.0.1"), "/user/alice/"
    command = [part.replace("{port}", str(port)).replace("{base_url}", base_url) for part in entry["command"]]
    env = dict(os.environ, NBDIST_STORE=str(tmp_path / "nbdist.db"))
    RunStore(tmp_path / "nbdist.db").close()
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}{base_url}{PROXY_NAME}/nbdist"
        status = _wait(lambda: _get_or_none(url), 120, f"nothing answered at {url}")
        assert status == 200
        assert entry["launcher_entry"]["path_info"] == f"{PROXY_NAME}/nbdist"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def _get_or_none(url: str) -> int | None:
    try:
        return _get(url)[0]
    except (urllib.error.URLError, ConnectionError):
        return None


def test_the_study_view_shows_recorded_trials(tmp_path, browser):
    from nbdist.dashboard import dashboard, export_html

    store_path = tmp_path / "nbdist.db"
    with RunStore(store_path) as store:
        store.begin_study("digits-evo", searcher="evolution", space={"lr": "log(1e-4,1e-1)"}, options={},
                          objective="val_loss", direction="minimize")
        foms = [0.9, 0.7, 0.8, 0.5, 0.6, 0.4]
        for number, fom in enumerate(foms):
            store.record_trial("digits-evo", number, params={"lr": 10 ** -(1 + number % 3), "hidden": 16 * (number + 1),
                                                             "optimizer": ["adam", "sgd"][number % 2]},
                               state="complete", fom=fom, fom_std=0.05, folds=[fom - 0.05, fom + 0.05],
                               generation=number // 3, ended=float(number))
        store.record_trial("digits-evo", 6, params={"lr": 1.0, "hidden": 8, "optimizer": "sgd"}, state="failed",
                           error="the loss became nan")
        store.record_trial("digits-evo", 7, params={"lr": 0.01, "hidden": 8, "optimizer": "sgd"}, state="running")
    board = dashboard(store_path, study="digits-evo", live=False)
    data = board.study.trials.data
    # Finished trials with a figure of merit, once each; the best so far only improves.
    assert data["trial"].tolist() == [0, 1, 2, 3, 4, 5]
    assert data["best"].tolist() == [0.9, 0.7, 0.7, 0.5, 0.5, 0.4]
    assert data["generation"].tolist() == [0, 0, 0, 1, 1, 1]
    assert board.study.update() == 0  # nothing new: nothing sent again
    paths, axes = board.study.parallel.data
    assert axes == ["hidden", "lr", "optimizer", "val_loss"] and len(paths) == 6
    with RunStore(store_path) as store:
        store.record_trial("digits-evo", 7, params={"lr": 0.01, "hidden": 8, "optimizer": "sgd"}, state="complete",
                           fom=0.3, fom_std=0.01, generation=2, ended=99.0)
    assert board.study.update() == 1 and board.study.trials.data["best"].tolist()[-1] == 0.3

    export = export_html(store_path, tmp_path / "study.html", study="digits-evo")
    page = browser.new_page(viewport={"width": 1150, "height": 1200})
    page.goto(export.as_uri())
    points = _wait(lambda: page.evaluate(COUNT_POINTS, "nbdist-trials"), 60, "the study plots were not drawn")
    assert points > 0 and page.evaluate(COUNT_POINTS, "nbdist-population") == 7
    page.screenshot(path=str(ARTIFACTS / "dashboard-study.png"), full_page=True)
    page.close()
