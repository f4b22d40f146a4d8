"""No internet needed in the browser (as on many HPC networks): every page is loaded in
headless Chromium that reaches this machine only; requests to any other host are refused
and recorded, and none may be attempted.

- In real JupyterLab, a notebook trains with `%%distnn train` and shows `job.dashboard()`,
  then runs a study and shows `study.dashboard()`: the plots are drawn from what the
  Jupyter server sends, gain points while the job and the study run, a study tab opened
  under the cell draws every trial, and nothing logs an error.
- The served dashboard takes everything from its own server.
- The exported HTML file names nothing outside this machine for the browser to load."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlparse

import pytest

pytest.importorskip("panel")
from conftest import ROOT, OutputLines
from test_dashboard import Server, _wait  # the same server and waits

from nbdist.dashboard import export_html
from nbdist.dashboard.serve import free_port
from nbdist.launch import mpi_env
from nbdist.layout import Layout
from nbdist.store import RunStore

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]

ARTIFACTS = ROOT / "test-artifacts"
LOCAL_HOSTS = {"127.0.0.1", "localhost", "[::1]", "::1"}

MODEL = """import torch.nn as nn
model = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))"""
# The study's first two trials (one per group) run at once; the others wait in
# build_model until the test has seen those two drawn, so that the page is seen to gain
# trials while the study runs, however slow this machine is.
BUILD_MODEL = """import os, time
import torch.nn as nn

def build_model(params):
    while params["hidden"] > 24 and not os.path.exists({release!r}):
        time.sleep(0.2)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, params["hidden"]), nn.ReLU(), nn.Linear(params["hidden"], 10))"""
TRIALS = 6


def _cells(release: Path) -> list[str]:
    return [
        "%load_ext nbdist\n%distnn cluster start -n 2",
        f"%%distnn train --topology allreduce --epochs 5000 --quiet\n{MODEL}",
        "job = %distnn last\njob.dashboard()",
        "job.stop(timeout=60)",
        f'%%distnn study --space "hidden=cat(16,24,32,40,48,56)" --searcher grid --trials {TRIALS} --groups 2 \\\n'
        f"    --topology allreduce --epochs 2 --quiet\n{BUILD_MODEL.format(release=str(release))}",
        "study = %distnn last\nstudy.dashboard()",
        "study.wait(timeout=240)\nprint(study.status)\n%distnn cluster stop",
    ]


# The points each named figure draws, over every Bokeh document on the page (one per
# displayed dashboard): the rows of its renderers' data sources.
COUNT_POINTS = """(name) => {
  if (typeof Bokeh === "undefined") return null;
  const counts = [];
  for (const doc of Bokeh.documents) {
    for (const m of doc._all_models.values()) {
      if (m.name !== name || !m.renderers) continue;
      counts.push(m.renderers.filter(r => !(r.name || "").endsWith("-reference"))
        .map(r => r.data_source ? r.data_source.get_length() : 0).reduce((a, b) => a + b, 0));
    }
  }
  return counts.length ? Math.max(...counts) : null;
}"""
# Run one cell of the open notebook through JupyterLab's own command (as Shift+Enter).
RUN_CELL = """async (index) => {
  const app = window.jupyterapp;
  const panel = app.shell.currentWidget;
  await panel.sessionContext.ready;
  panel.content.activeCellIndex = index;
  await app.commands.execute("notebook:run-cell");
}"""
CELL_TEXT = """(index) => {
  const panel = window.jupyterapp.shell.currentWidget;
  const cell = panel.content.widgets[index];
  return cell.outputArea ? cell.outputArea.node.innerText : "";
}"""
KERNEL_IDLE = """() => {
  const panel = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const kernel = panel && panel.sessionContext && panel.sessionContext.session && panel.sessionContext.session.kernel;
  return kernel ? kernel.status : null;
}"""


def _is_local(url: str) -> bool:
    parsed = urlparse(url)
    return parsed.scheme in ("data", "blob", "about", "file") or parsed.hostname in LOCAL_HOSTS


class JupyterLab:
    """`jupyter lab` on loopback, with its token, in a directory of its own."""

    def __init__(self, directory: Path, timeout: float = 120):
        self.token, port = secrets.token_hex(16), free_port("127.0.0.1")
        env = mpi_env(
            dict(
                os.environ,
                PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                JUPYTER_CONFIG_DIR=str(directory / ".jupyter"),
                JUPYTER_RUNTIME_DIR=str(directory / ".runtime"),
            )
        )
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyterlab",
                "--no-browser",
                "--allow-root",
                "--ip",
                "127.0.0.1",
                "--port",
                str(port),
                f"--IdentityProvider.token={self.token}",
                "--LabApp.expose_app_in_browser=True",
                f"--LabApp.user_settings_dir={directory / '.settings'}",
                f"--LabApp.workspaces_dir={directory / '.workspaces'}",
                f"--ServerApp.root_dir={directory}",
            ],
            cwd=directory,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.url = f"http://127.0.0.1:{port}"
        self.output = OutputLines(self.proc)
        if self.output.wait_for(rf"127\.0\.0\.1:{port}/lab", timeout) is None:
            self.stop()
            pytest.fail(f"JupyterLab did not start within {timeout} s:\n{self.output.text}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # the server shuts its kernels down
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)


class OfflinePage:
    """A browser page that reaches this machine only, and remembers what it tried
    elsewhere and every error it logged."""

    def __init__(self, browser, viewport=(1300, 2400)):
        self.page = browser.new_page(viewport={"width": viewport[0], "height": viewport[1]})
        self.outside: list[str] = []
        self.errors: list[str] = []
        self.page.route("**/*", self._route)
        self.page.on("pageerror", lambda error: self.errors.append(f"page error: {error}"))
        self.page.on("console", self._console)

    def _console(self, msg) -> None:
        if msg.type != "error":
            return
        if "ERR_INTERNET_DISCONNECTED" in msg.text and msg.location.get("url") in self.outside:
            return  # a refused request: recorded in self.outside
        self.errors.append(f"console: {msg.text}")

    def _route(self, route) -> None:
        url = route.request.url
        if _is_local(url):
            route.continue_()
        else:
            self.outside.append(url)
            route.abort("internetdisconnected")

    def points(self, name: str) -> int | None:
        return self.page.evaluate(COUNT_POINTS, f"nbdist-{name}")


def _write_notebook(path: Path, cells: list[str]) -> None:
    path.write_text(
        json.dumps(
            {
                "cells": [
                    {
                        "cell_type": "code",
                        "execution_count": None,
                        "id": f"cell-{i}",
                        "metadata": {},
                        "outputs": [],
                        "source": source,
                    }
                    for i, source in enumerate(cells)
                ],
                "metadata": {
                    "kernelspec": {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
                },
                "nbformat": 4,
                "nbformat_minor": 5,
            }
        )
    )


def _drawn_trials(n: int) -> dict[str, int]:
    """The points the study page's first tab (History) draws for n complete trials: in
    the optimisation history, per trial its fold spread, its value and the best so far;
    one per trial in the population. (The other tabs are drawn when opened.)"""
    return {"population": n, "history": 3 * n}


def _study_points(offline: OfflinePage) -> dict[str, int | None]:
    return {name: offline.points(name) for name in ("population", "history")}


def _drawn_plots(page, cell: int) -> int:
    """Plots (canvases of non-zero size) under a cell."""
    canvases = page.locator(".jp-Notebook .jp-Cell").nth(cell).locator("canvas")
    return sum(
        1
        for i in range(canvases.count())
        if (box := canvases.nth(i).bounding_box()) and box["width"] > 0 and box["height"] > 0
    )


def test_dashboards_under_notebook_cells_draw_without_the_internet(tmp_path, browser):
    pytest.importorskip("jupyterlab")
    release = tmp_path / "release-the-trials"
    cells = _cells(release)
    _write_notebook(tmp_path / "offline.ipynb", cells)
    lab = JupyterLab(tmp_path)
    offline = OfflinePage(browser)
    page = offline.page
    ARTIFACTS.mkdir(exist_ok=True)

    def run(index: int, shows: str | None = None, timeout: float = 120) -> None:
        page.evaluate(RUN_CELL, index)
        if shows is not None:
            _wait(lambda: shows in page.evaluate(CELL_TEXT, index), timeout, f"cell {index} never showed {shows!r}")

    try:
        page.goto(f"{lab.url}/lab/tree/offline.ipynb?token={lab.token}", timeout=120_000)
        _wait(lambda: page.evaluate(KERNEL_IDLE) == "idle", 120, "the notebook's kernel never started")
        run(0, "2 MPI engines")
        run(1)
        run(2)
        # job.dashboard(): the plots are drawn under the cell and gain points while the job trains.
        names = ("throughput", "loss-by-samples", "cpu")
        counts = _wait(
            lambda: (c := {n: offline.points(n) for n in names}) and all(c.values()) and c,
            120,
            f"the job's dashboard drew no points (errors: {offline.errors})",
        )
        for name in names:
            _wait(
                lambda name=name: (offline.points(name) or 0) > counts[name],
                60,
                f"no new points reached the {name} plot",
            )
        assert _drawn_plots(page, 2) >= 8
        page.screenshot(path=str(ARTIFACTS / "notebook-offline-job.png"), full_page=True)
        run(3, "stopped")

        # study.dashboard(): the first two trials are drawn, then the rest as they end, in
        # every plot of the tab in view.
        run(4)
        run(5)
        _wait(
            lambda: _study_points(offline) == _drawn_trials(2),
            120,
            f"the study's dashboard did not show its first two trials (errors: {offline.errors})",
        )
        assert _drawn_plots(page, 5) >= 3
        release.touch()
        _wait(
            lambda: _study_points(offline) == _drawn_trials(TRIALS),
            180,
            f"the study's plots did not all show its {TRIALS} trials (errors: {offline.errors})",
        )
        # Another tab, opened under the cell, draws its view of every trial: computed when
        # opened, on the browser's message, and sent from there.
        page.locator(".jp-Notebook .jp-Cell").nth(5).get_by_text("Parallel coordinates", exact=True).first.click()
        _wait(
            lambda: offline.points("parallel-coordinates") == TRIALS,
            60,
            f"the opened tab's parallel coordinates did not show the {TRIALS} trials (errors: {offline.errors})",
        )
        page.screenshot(path=str(ARTIFACTS / "notebook-offline-study.png"), full_page=True)
        page.evaluate(RUN_CELL, 6)  # the study's end, the cluster stopped (else JupyterLab's shutdown stops it)
        _wait(lambda: page.evaluate(KERNEL_IDLE) == "idle", 240, "the last cell did not end")

        # Everything the page loaded came from the Jupyter server: scripts, stylesheets, all.
        assert not offline.outside, f"the notebook asked for resources outside this machine: {offline.outside}"
        assert not offline.errors, offline.errors
    except BaseException:
        page.screenshot(path=str(ARTIFACTS / "notebook-offline-failed.png"), full_page=True)
        for index in range(len(cells)):
            print(f"--- cell {index}:\n{page.evaluate(CELL_TEXT, index)}")
        drawn = {name: offline.points(name) for name in ("throughput", "parallel-coordinates")}
        print("--- points:", {**drawn, **_study_points(offline)})
        print("--- JupyterLab's log:\n" + "".join(lab.output.lines[-200:]))
        raise
    finally:
        release.touch()  # a study that is still running goes on to its end
        page.close()
        lab.stop()


def _store_with_a_run(path: Path) -> Path:
    """A run store holding one finished two-worker run of five epochs."""
    with RunStore(path) as store:
        store.begin_run(
            "r1",
            run_dir=None,
            options={"topology": "allreduce", "epochs": 5},
            layout=Layout.for_world(2, topology="allreduce").to_dict(),
        )
        store.add_records(
            [
                {
                    "run": "r1",
                    "trial": None,
                    "rank": 0,
                    "role": "worker",
                    "kind": "epoch",
                    "step": e,
                    "epoch": e,
                    "time": 1.0 + e,
                    "seq": e,
                    "values": {
                        "epoch": e + 1,
                        "train_loss": 1.0 / (e + 1),
                        "val_loss": 1.1 / (e + 1),
                        "val_acc": 0.5,
                        "samples": 100,
                        "samples_seen": 100 * (e + 1),
                        "seconds": 1.0,
                        "samples_per_s": 100.0,
                    },
                }
                for e in range(5)
            ]
        )
        store.end_run("r1", "completed")
    return path


def test_the_served_dashboard_takes_everything_from_its_server(tmp_path, browser):
    store = _store_with_a_run(tmp_path / "nbdist.db")
    server = Server(["dashboard", "--store", str(store), "--port", "0"])
    offline = OfflinePage(browser)
    try:
        offline.page.goto(server.url, timeout=120_000)
        _wait(lambda: offline.points("loss-by-samples"), 60, f"the served page drew nothing ({offline.errors})")
        assert not offline.outside, f"the served page asked for resources outside this machine: {offline.outside}"
        assert not offline.errors, offline.errors
    finally:
        offline.page.close()
        server.stop()


class _Links(HTMLParser):
    """Every address an HTML page makes the browser load: src and href attributes."""

    def __init__(self):
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.urls += [value for name, value in attrs if name in ("src", "href") and value]


def test_the_exported_page_names_nothing_outside_this_machine(tmp_path, browser):
    store = _store_with_a_run(tmp_path / "nbdist.db")
    export = export_html(store, tmp_path / "dashboard.html")
    text = export.read_text()
    links = _Links()
    links.feed(text)
    assert links.urls and not [u for u in links.urls if not _is_local(u)], links.urls
    # Stylesheets travel in the page's Bokeh document: inline, not linked from Panel's CDN.
    assert "cdn.holoviz.org" not in text and "cdn.bokeh.org" not in text
    offline = OfflinePage(browser)
    try:
        offline.page.goto(export.as_uri())
        _wait(lambda: offline.points("loss-by-samples"), 60, f"the exported page drew nothing ({offline.errors})")
        assert not offline.outside, f"the exported page asked for resources outside this machine: {offline.outside}"
        assert not offline.errors, offline.errors
    finally:
        offline.page.close()
