"""Serving the dashboard: on localhost by default; on any other interface only with a token.

    python -m nbdist dashboard --store runs/nbdist.db            # http://127.0.0.1:5006/nbdist
    python -m nbdist dashboard --store ... --address 0.0.0.0     # prints a URL with ?token=...

A shared login node has other users: a server on a public interface must not show
anyone's runs to anyone. With a token, the first request must carry `?token=...` (or
the cookie that request sets); everything else gets 403. Behind JupyterHub, use the
jupyter-server-proxy entry instead (nbdist.dashboard.proxy): the hub authenticates.
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
import socket
from pathlib import Path
from typing import Any

from bokeh.server.auth_provider import AuthProvider
from tornado.web import RequestHandler
from tornado.websocket import WebSocketHandler

__all__ = ["serve", "TokenAuth", "is_loopback", "free_port", "APP_PATH"]

APP_PATH = "nbdist"
COOKIE = "nbdist-dashboard-token"


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
          show: bool = False) -> Any:
    """Serve the dashboard of `store` until interrupted. Returns when the server stops."""
    import panel as pn

    from nbdist.dashboard.app import dashboard
    from nbdist.store import RunStore

    # An unreadable store is an error now, not on every page; a new one is created, so
    # that the dashboard can be started before the first run.
    with RunStore(store) as opened:
        empty = not opened.runs()
    if token is None and not is_loopback(address):
        token = secrets.token_urlsafe(24)
    if port == 0:
        port = free_port(address)
    options: dict[str, Any] = {}
    if token is not None:
        options["auth_provider"] = TokenAuth(token)
    # Panel adds what the factory returns to each session's page: return the page, not .servable().
    server = pn.serve({APP_PATH: lambda: dashboard(store, run=run).start().page}, address=address, port=port,
                      prefix=prefix, show=False, start=False, title="nbdist dashboard",
                      websocket_origin=allow_origin or _origins(address, port), **options)
    server.start()
    host = socket.gethostname() if address in ("0.0.0.0", "::") else address
    url = f"http://{host}:{server.port}{prefix.rstrip('/')}/{APP_PATH}" + (f"?token={token}" if token else "")
    print(f"nbdist: dashboard of {store}{' (no runs yet)' if empty else ''} at {url}", flush=True)
    if show:
        server.show(f"/{APP_PATH}")
    try:
        server.io_loop.start()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return server


def free_port(address: str) -> int:
    with socket.socket() as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


def _origins(address: str, port: int) -> list[str]:
    """The pages allowed to open the dashboard's websocket: those served by this server
    under any of the names it is reached by (Bokeh compares the Origin header)."""
    hosts = {"localhost", "127.0.0.1", address, socket.gethostname(), socket.getfqdn()}
    return [f"{host}:{port}" for host in sorted(hosts) if host]
