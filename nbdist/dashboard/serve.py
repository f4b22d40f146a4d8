"""Serving the dashboard: on localhost by default; on any other interface only with a token.

    python -m nbdist dashboard --store runs/nbdist.db            # http://127.0.0.1:5006/nbdist
    python -m nbdist dashboard --store ... --address 0.0.0.0     # prints a URL with ?token=...

A shared login node has other users: a server on a public interface must not show
anyone's runs to anyone. With a token, the first request must carry `?token=...` (or
the cookie that request sets); everything else gets 403. Behind JupyterHub, use the
jupyter-server-proxy entry instead (nbdist.dashboard.proxy): the hub authenticates.
"""

from __future__ import annotations

import errno
import hmac
import ipaddress
import secrets
import socket
from pathlib import Path
from typing import Any

from bokeh.server.auth_provider import AuthProvider
from tornado.web import RequestHandler
from tornado.websocket import WebSocketHandler

from nbdist.errors import UserError

__all__ = ["serve", "existing_store", "DashboardError", "TokenAuth", "is_loopback", "free_port", "APP_PATH"]

APP_PATH = "nbdist"
COOKIE = "nbdist-dashboard-token"


class DashboardError(UserError):
    pass


def existing_store(store: str | Path) -> str | Path:
    """`store` when it is a run store file; else one error naming it and where runs put
    theirs (a mistyped path would otherwise show a new, empty store)."""
    from nbdist.store import STORE_FILE, RunStore, is_url

    if is_url(store):  # a database: it must hold a store already (no tables: an error naming it)
        RunStore(store, create=False).close()
        return store
    path = Path(store)
    if path.is_dir():
        inside = " (it holds one: --store " + str(path / STORE_FILE) + ")" if (path / STORE_FILE).is_file() else ""
        raise DashboardError(f"--store {store} is a directory, not a run store file{inside}")
    if not path.exists():
        raise DashboardError(f"--store {store}: no such run store; runs record in RUNS_DIR/{STORE_FILE} "
                             f"(runs/{STORE_FILE} by default) or in the --store they were given "
                             f"(add --create to start the dashboard before the first run)")
    return path


def is_loopback(address: str) -> bool:
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


class _TokenRequired(RequestHandler):
    def get(self) -> None:
        self.set_status(403)
        self.finish("<html><title>nbdist dashboard: token required</title><body><p>This nbdist dashboard needs "
                    "its token: open the URL it printed when it started (ending in <code>?token=...</code>)."
                    "</p></body></html>")


class TokenAuth(AuthProvider):
    """Lets in requests that carry the token (query argument, or the cookie it sets)."""

    def __init__(self, token: str):
        self.token = token
        super().__init__()

    @property
    def get_user(self) -> Any:
        def user(handler: RequestHandler) -> str | None:
            cookie = handler.get_cookie(COOKIE)
            given = cookie if isinstance(handler, WebSocketHandler) else handler.get_argument("token", cookie)
            if not given or not hmac.compare_digest(given.encode(), self.token.encode()):
                return None
            if cookie != given and not isinstance(handler, WebSocketHandler):
                handler.set_cookie(COOKIE, given, httponly=True, samesite="Strict")
            return "nbdist"

        return user

    @property
    def login_url(self) -> str:
        return "/token-required"

    @property
    def login_handler(self) -> type[RequestHandler]:
        return _TokenRequired


def serve(store: str | Path, *, address: str = "127.0.0.1", port: int = 5006, prefix: str = "",
          token: str | None = None, run: str | None = None, allow_origin: list[str] | None = None,
          show: bool = False, create: bool = False) -> Any:
    """Serve the dashboard of `store` until interrupted. Returns when the server stops.
    `create`: start an empty store when there is none (the dashboard of runs to come)."""
    import panel as pn

    from nbdist.dashboard.app import dashboard
    from nbdist.store import RunStore, store_label

    if not create:
        existing_store(store)
    # An unreadable store is an error now, not on every page.
    with RunStore(store) as opened:
        empty = not opened.runs()
    if token is None and not is_loopback(address):
        token = secrets.token_urlsafe(24)
    options: dict[str, Any] = {}
    if token is not None:
        options["auth_provider"] = TokenAuth(token)
    try:
        if port == 0:
            port = free_port(address)
        # Panel adds what the factory returns to each session's page: return the page, not .servable().
        server = pn.serve({APP_PATH: lambda: dashboard(store, run=run).start().page}, address=address, port=port,
                          prefix=prefix, show=False, start=False, title="nbdist dashboard",
                          websocket_origin=allow_origin or _origins(address, port), **options)
    except OSError as exc:
        raise _cannot_listen(exc, address, port) from None
    server.start()
    host = socket.gethostname() if address in ("0.0.0.0", "::") else address
    url = f"http://{host}:{server.port}{prefix.rstrip('/')}/{APP_PATH}" + (f"?token={token}" if token else "")
    print(f"nbdist: dashboard of {store_label(store)}{' (no runs yet)' if empty else ''} at {url}", flush=True)
    if show:
        server.show(f"/{APP_PATH}")
    try:
        server.io_loop.start()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return server


def _cannot_listen(exc: OSError, address: str, port: int) -> DashboardError:
    if exc.errno == errno.EADDRINUSE:
        return DashboardError(f"port {port} on {address} is in use (another dashboard?): choose another with "
                              f"--port, or --port 0 for any free port")
    return DashboardError(f"cannot listen on {address} port {port}: {exc.strerror or exc}; --address takes an "
                          f"interface of this machine: 127.0.0.1 (the default), or 0.0.0.0 for all")


def free_port(address: str) -> int:
    with socket.socket() as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


def _origins(address: str, port: int) -> list[str]:
    """The pages allowed to open the dashboard's websocket: those served by this server
    under any of the names it is reached by (Bokeh compares the Origin header)."""
    hosts = {"localhost", "127.0.0.1", address, socket.gethostname(), socket.getfqdn()}
    return [f"{host}:{port}" for host in sorted(hosts) if host]
