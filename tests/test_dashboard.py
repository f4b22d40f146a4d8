"""The dashboard for real: served by `python -m nbdist dashboard` for a batch run that is
training under mpiexec, loaded in headless Chromium (Debian's chromium, driven by
Playwright), and asserted on what a person would see: the plots, points arriving while
the page is open, the run's status. Also the token every server wants, the
jupyter-server-proxy entry under a real Jupyter server, the static export and the study view."""

from __future__ import annotations

import concurrent.futures
import http.client
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("panel")
from conftest import ROOT, OutputLines, listening

from nbdist.dashboard.serve import free_port
from nbdist.launch import mpi_env, mpiexec_command
from nbdist.store import RunStore

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(600)]

ARTIFACTS = ROOT / "test-artifacts"
LIVE_PLOTS = ("throughput", "staleness", "loss-by-samples", "timeline", "cpu", "bytes-sent")
# Points drawn in a named figure: the rows of its renderers' data sources.
COUNT_POINTS = """(name) => {
  const doc = Bokeh.documents[0]; if (!doc) return null;
  const figs = [...doc._all_models.values()].filter(m => m.name === name);
  if (figs.length !== 1) return null;
  return figs[0].renderers.filter(r => !(r.name || "").endsWith("-reference"))  // a fixed line, not the run's
    .map(r => r.data_source ? r.data_source.get_length() : 0).reduce((a, b) => a + b, 0);
}"""


class Server:
    """A `python -m nbdist ...` server process and the URL it printed. With wait=False the
    process starts and `started()` waits for its URL later: two servers start side by side
    (each spends seconds importing before it listens)."""

    def __init__(self, argv: list[str], timeout: float = 120, env: dict | None = None, wait: bool = True):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nbdist", *argv],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        self.lines = OutputLines(self.proc)
        if wait:
            self.started(timeout)

    def started(self, timeout: float = 120) -> Server:
        match = self.lines.wait_for(r"nbdist: dashboard of .* at (http\S+)", timeout)
        if match is None:
            self.stop()
            pytest.fail(f"the server printed no URL within {timeout} s:\n{self.lines.text}")
        self.url = match.group(1)
        return self

    @property
    def output(self) -> str:
        return self.lines.text

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)


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
    # One master and one worker: every live plot (staleness included) has a rank to draw,
    # and a third rank would only compete with the browser and the server for the CPU.
    train = subprocess.Popen(
        mpiexec_command(
            2,
            [
                "-m",
                "nbdist",
                "train",
                "--model",
                "examples/digits_mlp.py",
                "--epochs",
                "100000",
                "--runs-dir",
                str(tmp_path),
                "--quiet",
            ],
        ),
        cwd=ROOT,
        env=mpi_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
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
        counts = _wait(
            lambda: (c := _counts(page)) and all(v for v in c.values()) and c,
            120,
            "the live plots never showed the run's points",
        )
        # New points arrive while the page is open.
        for name in ("throughput", "staleness", "loss-by-samples"):
            _wait(
                lambda name=name: (page.evaluate(COUNT_POINTS, f"nbdist-{name}") or 0) > counts[name],
                60,
                f"no new points reached the {name} plot",
            )
        run_id = next(p.name for p in tmp_path.iterdir() if p.is_dir())
        header = _header(page)
        assert run_id in header and "running" in header and "1 master + 1 worker" in header
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

    # The same run, exported as one HTML file by the command line (in this process: the
    # command's own process is tested in test_run_privacy_mpi), opens offline with its plots drawn.
    from nbdist.cli import main

    export = tmp_path / "dashboard.html"
    assert main(["dashboard", "--store", str(store), "--export", str(export)]) == 0
    page = browser.new_page(viewport={"width": 1150, "height": 2000})
    page.route("**/*", lambda route: route.abort() if not route.request.url.startswith("file:") else route.continue_())
    page.goto(export.as_uri())
    exported = _wait(
        lambda: (c := _counts(page)) and all(v for v in c.values()) and c, 60, "the exported page drew no plots"
    )
    assert exported["throughput"] > 0 and exported["loss-by-samples"] > 0
    assert "stopped" in _header(page)
    page.screenshot(path=str(ARTIFACTS / "dashboard-export.png"), full_page=True)
    page.close()


def _get(url: str, cookie: str | None = None, headers: dict | None = None) -> tuple[int, str, str | None]:
    request = urllib.request.Request(url, headers={**({"Cookie": cookie} if cookie else {}), **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read().decode(), response.headers.get("Set-Cookie")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(), None


def _unfollowed(url: str, headers: dict | None = None, unix_socket: str | None = None) -> tuple[int, dict, str]:
    """One request, redirects not followed (on a Unix socket when given): its status,
    headers and body (none after a 101)."""
    parts = urllib.parse.urlsplit(url)
    if unix_socket is None:
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    else:
        connection = _UnixHTTPConnection(unix_socket)
    try:
        connection.request("GET", parts.path + (f"?{parts.query}" if parts.query else ""), headers=headers or {})
        response = connection.getresponse()
        return response.status, dict(response.headers), "" if response.status == 101 else response.read().decode()
    finally:
        connection.close()


def _handshake(url: str, headers: dict, unix_socket: str | None = None) -> int:
    """The HTTP status a websocket handshake gets (101: the socket opened)."""
    return _unfollowed(
        url,
        {
            "Connection": "Upgrade",
            "Upgrade": "websocket",
            "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
            "Sec-WebSocket-Protocol": "bokeh, token",
            **headers,
        },
        unix_socket,
    )[0]


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, socket_path: str):
        super().__init__("localhost", timeout=60)
        self.socket_path = socket_path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(60)
        self.sock.connect(self.socket_path)


def _bokeh_session(page: str) -> str:
    """The Bokeh session token a served page carries (what its websocket presents)."""
    return re.search(r'"token":"([\w.-]+)"', page).group(1)


def _first_bokeh_message(url: str, headers: dict, session: str) -> str | None:
    """Open the dashboard's websocket as the page does and return the first message the
    server sends (Bokeh's ACK): the socket works end to end, not just its handshake.
    None: it was closed first."""
    import asyncio

    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect

    async def first() -> str:
        request = HTTPRequest(url, headers=headers, connect_timeout=60, request_timeout=60)
        connection = await websocket_connect(request, subprotocols=["bokeh", session])
        try:
            message = await asyncio.wait_for(connection.read_message(), 60)
        finally:
            connection.close()
        return message.decode() if isinstance(message, bytes) else message

    # In a thread of its own: Playwright's sync API keeps an event loop running in this one.
    with concurrent.futures.ThreadPoolExecutor(1) as thread:
        return thread.submit(lambda: asyncio.run(first())).result(timeout=180)


def test_the_dashboard_needs_its_token_on_localhost_too(tmp_path):
    RunStore(tmp_path / "nbdist.db").close()
    # Two servers, started side by side and looked at one after the other: on loopback with
    # the token from the environment; on a public interface (plain HTTP: only with
    # --insecure, and said) with the token from a file only its owner reads.
    token_file = tmp_path / "token"
    token_file.write_text("from-the-file\n")
    token_file.chmod(0o600)
    loopback = Server(
        ["dashboard", "--store", str(tmp_path / "nbdist.db"), "--port", "0"],
        env={"NBDIST_DASHBOARD_TOKEN": "from-the-environment"},
        wait=False,
    )
    public = Server(
        [
            "dashboard",
            "--store",
            str(tmp_path / "nbdist.db"),
            "--address",
            "0.0.0.0",
            "--insecure",
            "--port",
            "0",
            "--token-file",
            str(token_file),
        ],
        env={"NBDIST_DASHBOARD_TOKEN": "from-the-environment"},
        wait=False,
    )
    try:
        server = loopback.started()
        assert "(no runs yet)" in server.output and "Launching server" not in server.output
        assert server.url.startswith("http://127.0.0.1:") and server.url.endswith("/nbdist?token=from-the-environment")
        bare, port = server.url.split("?")[0], urllib.parse.urlsplit(server.url).port
        status, body, _ = _get(bare)
        assert status == 403 and "token required" in body and "Bokeh" not in body
        assert _get(bare + "?token=wrong")[0] == 403
        status, body, cookie = _get(server.url)
        # A cookie named after its port: a second dashboard in the same browser does not overwrite
        # it (the browser still sends it to every port of this host: access.cookie_name).
        assert status == 200 and "Bokeh" in body and cookie.startswith(f"nbdist-dashboard-token-{port}=")
        assert _get(bare, cookie=f"nbdist-dashboard-token-{port}=from-the-environment")[0] == 200
        assert _get(bare, cookie="nbdist-dashboard-token=from-the-environment")[0] == 403
        assert _get(bare, headers={"Authorization": "token from-the-environment"})[0] == 200
        # Websockets: refused without the token (Bokeh's own session token is not enough).
        socket_url, origin = bare + "/ws", {"Origin": f"http://127.0.0.1:{port}"}
        assert _handshake(socket_url, origin) == 403
        assert _handshake(socket_url, {**origin, "Cookie": f"nbdist-dashboard-token-{port}=wrong"}) == 403
        assert (
            _handshake(socket_url, {**origin, "Cookie": f"nbdist-dashboard-token-{port}=from-the-environment"}) == 101
        )
        # A page of another site may not use a visitor's cookie to read the runs.
        assert (
            _handshake(
                socket_url,
                {"Origin": "http://elsewhere.example", "Cookie": f"nbdist-dashboard-token-{port}=from-the-environment"},
            )
            == 403
        )
        loopback.stop()

        server = public.started()
        assert server.url.endswith("/nbdist?token=from-the-file")
        assert "nbdist: warning: serving on 0.0.0.0 over plain HTTP (--insecure)" in server.output
        local = re.sub(r"//[^:/]+:", "//127.0.0.1:", server.url)
        assert _get(local)[0] == 200
        assert _get(local.split("?")[0])[0] == 403
        assert _get(local.split("?")[0] + "?token=from-the-environment")[0] == 403
    finally:
        loopback.stop()
        public.stop()


class PanelServe:
    """`panel serve dashboards/nbdist_dashboard.py` on a free local port, with the token
    auth module or without it."""

    def __init__(self, store: Path, *, auth_module: bool, env: dict[str, str]):
        port = free_port("127.0.0.1")
        auth = ["--auth-module", "dashboards/token_auth.py"] if auth_module else []
        environment = {k: v for k, v in os.environ.items() if k != "NBDIST_DASHBOARD_TOKEN"}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "panel",
                "serve",
                "dashboards/nbdist_dashboard.py",
                "--port",
                str(port),
                *auth,
                "--args",
                "--store",
                str(store),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
            env={**environment, **env},
        )
        self.lines = OutputLines(self.proc)
        self.url = f"http://127.0.0.1:{port}/nbdist_dashboard"

    def started(self) -> PanelServe:
        if self.lines.wait_for(r"Bokeh app running at", 120) is None:
            self.stop()
            pytest.fail(f"panel serve did not start within 120 s:\n{self.lines.text}")
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=30)


# Whether any model of the page's Bokeh documents holds a text in a property (a run's id
# in the run picker, say).
PAGE_HOLDS = """(text) => {
  if (typeof Bokeh === "undefined") return false;
  const holds = (value, depth) => depth < 6 && (typeof value === "string" ? value.includes(text)
    : Array.isArray(value) ? value.some(v => holds(v, depth + 1))
    : value instanceof Map ? [...value.values()].some(v => holds(v, depth + 1)) : false);
  return Bokeh.documents.some(doc => [...doc._all_models.values()].some(
    m => Object.values(m.properties).some(p => holds(p.get_value(), 0))));
}"""


def _store_with_a_named_run(path: Path, run_id: str) -> Path:
    with RunStore(path) as store:
        store.begin_run(run_id, run_dir=None, options={"topology": "allreduce", "epochs": 5}, layout={})
    return path


@pytest.fixture(scope="module")
def panel_serves(tmp_path_factory):
    """Both `panel serve` set-ups, each with its own store holding one run, started side by
    side (each spends seconds importing before it listens): with the token auth module (a
    random token, printed by the module), and without it, the token in the environment."""
    directory = tmp_path_factory.mktemp("panel-serve")
    servers = {
        "auth module": PanelServe(
            _store_with_a_named_run(directory / "auth-module.db", "run-of-the-owner"), auth_module=True, env={}
        ),
        "environment": PanelServe(
            _store_with_a_named_run(directory / "environment.db", "run-of-the-owner"),
            auth_module=False,
            env={"NBDIST_DASHBOARD_TOKEN": "t0ken"},
        ),
    }
    try:
        yield {name: server.started() for name, server in servers.items()}
    finally:
        for server in servers.values():
            server.stop()


def test_panel_serve_with_the_token_auth_module_wants_the_token(panel_serves, browser):
    server = panel_serves["auth module"]
    page = browser.new_page()
    try:
        token = re.search(r"nbdist: the dashboard's token \(add \?token=\.\.\. to the URL\): (\S+)", server.lines.text)
        assert token is not None, server.lines.text
        assert _wait(lambda: _get_or_none(server.url), 120, f"nothing answered at {server.url}") == 403
        status, body, _ = _get(f"{server.url}?token={token.group(1)}")
        assert status == 200 and "Bokeh" in body
        # The app's own check takes the auth module's token: the page shows the run.
        page.goto(f"{server.url}?token={token.group(1)}")
        _wait(lambda: page.evaluate(PAGE_HOLDS, "run-of-the-owner"), 60, "the page never showed the run")
    finally:
        page.close()


def test_panel_serve_without_the_auth_module_shows_no_run_without_the_token(panel_serves, browser):
    server = panel_serves["environment"]
    page = browser.new_page()
    try:
        page.goto(server.url)
        page.get_by_text("nbdist dashboard: token required").wait_for(timeout=60_000)
        assert page.get_by_text("--auth-module dashboards/token_auth.py").count() == 1
        assert not page.evaluate(PAGE_HOLDS, "run-of-the-owner")
        page.goto(f"{server.url}?token=wrong")
        page.get_by_text("nbdist dashboard: token required").wait_for(timeout=60_000)
        assert not page.evaluate(PAGE_HOLDS, "run-of-the-owner")
        page.goto(f"{server.url}?token=t0ken")
        _wait(lambda: page.evaluate(PAGE_HOLDS, "run-of-the-owner"), 60, "the page never showed the run")
    finally:
        page.close()


def test_a_served_session_needs_the_token_the_server_knows():
    from bokeh.server.contexts import _RequestProxy

    from nbdist.dashboard.access import session_has_token

    def request(arguments=None, cookies=None, headers=None):
        return _RequestProxy(None, arguments=arguments or {}, cookies=cookies or {}, headers=headers or {})

    assert session_has_token(request(arguments={"token": [b"t0ken"]}), "t0ken")
    assert session_has_token(request(cookies={"nbdist-dashboard-token": "t0ken"}), "t0ken")
    assert session_has_token(request(headers={"Authorization": "token t0ken"}), "t0ken")
    assert not session_has_token(request(arguments={"token": [b"wrong"]}), "t0ken")
    # panel serve without the auth module and without $NBDIST_DASHBOARD_TOKEN: no token
    # to compare with, no session shows the runs, whatever it gives.
    assert not session_has_token(request(arguments={"token": [b""]}), None)
    assert not session_has_token(request(arguments={"token": [b"anything"]}), None)


JUPYTER_TOKEN = "the-jupyter-servers-own"


def test_behind_jupyter_server_proxy_the_dashboard_works_and_opens_no_port(tmp_path):
    """The jupyter-server-proxy entry under a real Jupyter server: the page and its
    websocket work through the proxy URL; the dashboard listens on no TCP port, only on a
    Unix socket its owner alone reaches, and even there it wants its token."""
    import psutil

    from nbdist.dashboard.proxy import PROXY_NAME

    _needs("jupyter_server_proxy", "pip install jupyter-server-proxy==4.6.0 (in the notebook extra)")
    RunStore(tmp_path / "nbdist.db").close()
    port = free_port("127.0.0.1")
    env = dict(
        os.environ,
        JUPYTER_TOKEN=JUPYTER_TOKEN,
        NBDIST_STORE=str(tmp_path / "nbdist.db"),
        JUPYTER_CONFIG_DIR=str(tmp_path / "config"),
        JUPYTER_RUNTIME_DIR=str(tmp_path / "runtime"),
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    env.pop("NBDIST_DASHBOARD_TOKEN", None)
    jupyter = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyter_server",
            "--no-browser",
            "--allow-root",
            "--ServerApp.ip=127.0.0.1",
            f"--ServerApp.port={port}",
            "--ServerApp.port_retries=0",
            f"--ServerApp.root_dir={tmp_path}",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    output: list[str] = []
    threading.Thread(target=lambda: output.extend(jupyter.stdout), daemon=True).start()
    base, hub = f"http://127.0.0.1:{port}", {"Authorization": f"token {JUPYTER_TOKEN}"}
    try:
        _wait(lambda: _get_or_none(f"{base}/api/status", hub) == 200, 120, "the Jupyter server did not answer")
        page_url = f"{base}/{PROXY_NAME}/nbdist"
        status, page, _ = _get(page_url, headers=hub)  # starts the dashboard (jupyter-server-proxy waits for it)
        assert status == 200 and "Bokeh" in page and "<title>nbdist dashboard</title>" in page, (
            status,
            "".join(output),
        )
        # Jupyter's own authentication stands in front of it.
        status, headers, _ = _unfollowed(page_url)
        assert status == 302 and "/login" in headers["Location"], (status, headers)

        # The page's websocket, through the proxy, from the page's own origin: Bokeh answers.
        socket_url = f"ws://127.0.0.1:{port}/{PROXY_NAME}/nbdist/ws"
        session = _bokeh_session(page)
        assert "ACK" in _first_bokeh_message(socket_url, {**hub, "Origin": base}, session)
        # From another site's page, the dashboard closes it. (Jupyter checks the origin
        # itself unless, as here, the request carries Jupyter's token in a header, which a
        # page of another site cannot add: then the proxy accepts the socket and passes it on.)
        assert _first_bokeh_message(socket_url, {**hub, "Origin": "http://elsewhere.example"}, session) is None

        servers = [
            p
            for p in psutil.Process(jupyter.pid).children(recursive=True)
            if "dashboard" in p.cmdline() and "nbdist" in p.cmdline()
        ]
        assert len(servers) == 1, [p.cmdline() for p in psutil.Process(jupyter.pid).children(recursive=True)]
        dashboard = servers[0]
        assert listening([dashboard]) == set(), "the dashboard listens on a TCP port"
        command = dashboard.cmdline()
        unix_socket = command[command.index("--unix-socket") + 1]
        assert stat.S_IMODE(os.stat(os.path.dirname(unix_socket)).st_mode) == 0o700
        assert "--token" not in command and not any(JUPYTER_TOKEN in part for part in command)
        # On the socket itself: no token, no page; the token but another site's page: no websocket.
        status, _, body = _unfollowed(page_url, unix_socket=unix_socket)
        assert status == 403 and "token required" in body
        token = dashboard.environ()["NBDIST_DASHBOARD_TOKEN"]
        assert (
            _handshake(
                f"http://127.0.0.1:{port}/{PROXY_NAME}/nbdist/ws",
                {"Authorization": f"token {token}", "Origin": "http://elsewhere.example"},
                unix_socket=unix_socket,
            )
            == 403
        )
    finally:
        os.killpg(jupyter.pid, signal.SIGTERM)
        try:
            jupyter.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(jupyter.pid, signal.SIGKILL)
            jupyter.wait(timeout=30)


def _needs(module: str, install: str) -> None:
    try:
        __import__(module)
    except ImportError:
        if os.environ.get("CI"):
            pytest.fail(f"{module} is missing: {install}")
        pytest.skip(f"{module} is not installed ({install})")


def _get_or_none(url: str, headers: dict | None = None) -> int | None:
    try:
        return _get(url, headers=headers)[0]
    except (urllib.error.URLError, ConnectionError):
        return None


def test_the_study_view_shows_recorded_trials(tmp_path, browser):
    from nbdist.dashboard import dashboard, export_html

    store_path = tmp_path / "nbdist.db"
    with RunStore(store_path) as store:
        store.begin_study(
            "digits-evo",
            searcher="evolution",
            space={"lr": "log(1e-4,1e-1)"},
            options={},
            objective="val_loss",
            direction="minimize",
        )
        foms = [0.9, 0.7, 0.8, 0.5, 0.6, 0.4]
        for number, fom in enumerate(foms):
            store.record_trial(
                "digits-evo",
                number,
                params={
                    "lr": 10 ** -(1 + number % 3),
                    "hidden": 16 * (number + 1),
                    "optimizer": ["adam", "sgd"][number % 2],
                },
                state="complete",
                fom=fom,
                fom_std=0.05,
                folds=[fom - 0.05, fom + 0.05],
                generation=number // 3,
                ended=float(number),
            )
        store.record_trial(
            "digits-evo",
            6,
            params={"lr": 1.0, "hidden": 8, "optimizer": "sgd"},
            state="failed",
            error="the loss became nan",
        )
        store.record_trial("digits-evo", 7, params={"lr": 0.01, "hidden": 8, "optimizer": "sgd"}, state="running")
    board = dashboard(store_path, study="digits-evo", live=False)
    history = board.study.history
    # Finished trials with a figure of merit, once each; the best so far only improves.
    assert history.points.data["trial"] == [0, 1, 2, 3, 4, 5]
    assert history.best.data["best"] == [0.9, 0.7, 0.7, 0.5, 0.5, 0.4]
    assert board.study.population.source.data["generation"] == [0, 0, 0, 1, 1, 1]
    assert board.study.update() == 0  # nothing new: nothing sent again
    assert dict(board.study.parallel.figure.xaxis.major_label_overrides) == dict(
        enumerate(["lr", "hidden", "optimizer", "val_loss"])
    )
    assert len(board.study.parallel.source.data["trial"]) == 6
    with RunStore(store_path) as store:
        store.record_trial(
            "digits-evo",
            7,
            params={"lr": 0.01, "hidden": 8, "optimizer": "sgd"},
            state="complete",
            fom=0.3,
            fom_std=0.01,
            generation=2,
            ended=99.0,
        )
    assert board.study.update() == 1 and history.best.data["best"][-1] == 0.3

    export = export_html(store_path, tmp_path / "study.html", study="digits-evo")
    page = browser.new_page(viewport={"width": 1150, "height": 1200})
    page.goto(export.as_uri())
    points = _wait(lambda: page.evaluate(COUNT_POINTS, "nbdist-history"), 60, "the study plots were not drawn")
    assert points > 0 and page.evaluate(COUNT_POINTS, "nbdist-population") == 7
    page.screenshot(path=str(ARTIFACTS / "dashboard-study.png"), full_page=True)
    page.close()
