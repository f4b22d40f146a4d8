"""Who may read the dashboard: whoever has its token, on every interface, localhost too.

A shared login node has other users, and all of them reach 127.0.0.1: a server that
answers without a token shows everyone's runs (options, paths, host names, metrics) to
everyone. So the server always asks for a token, as Jupyter does. It comes from

    NBDIST_DASHBOARD_TOKEN=...            the environment (readable only by its owner), or
    --token-file PATH                     a file only its owner can read (chmod 600), else
    a fresh random one                    printed in the URL the server shows at start,

and never from the command line: every user of the machine sees command lines in `ps`.

A request carries it as `?token=...` (which sets a cookie for the pages and websockets
that follow), as that cookie, or as the header `Authorization: token ...` (what the
jupyter-server-proxy entry adds). Anything else gets 403, websockets included.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from bokeh.server.auth_provider import AuthProvider
from panel.io.server import WSHandler as PanelWSHandler
from tornado.web import HTTPError, RequestHandler
from tornado.websocket import WebSocketHandler

from nbdist.errors import UserError

__all__ = [
    "TOKEN_ENV",
    "TokenError",
    "TokenAuth",
    "dashboard_token",
    "token_on_command_line",
    "SameOriginWebsocket",
    "cookie_name",
    "session_has_token",
    "TOKEN_REQUIRED_PAGE",
]

TOKEN_ENV = "NBDIST_DASHBOARD_TOKEN"


class TokenError(UserError):
    pass


def dashboard_token(token_file: str | Path | None = None) -> str:
    """The token from `token_file` when given, else from $NBDIST_DASHBOARD_TOKEN, else a
    fresh random one."""
    if token_file is not None:
        return _read_token_file(Path(token_file))
    if TOKEN_ENV in os.environ:
        token = os.environ[TOKEN_ENV].strip()
        if not token:
            raise TokenError(f"{TOKEN_ENV} is set but empty: give it a token, or unset it for a random one")
        return token
    return secrets.token_urlsafe(24)


def _read_token_file(path: Path) -> str:
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        raise TokenError(f"--token-file {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        raise TokenError(f"--token-file {path} is not a file")
    # A token others can read (or replace) protects nothing.
    if mode & 0o077:
        raise TokenError(
            f"--token-file {path} can be read or written by other users (mode "
            f"{stat.filemode(mode)}): make it yours alone with chmod 600 {path}"
        )
    token = path.read_text().strip()
    if not token:
        raise TokenError(f"--token-file {path} is empty: write the token into it")
    return token


def token_on_command_line(option: str = "--token") -> TokenError:
    """The error for a token given as a command-line argument."""
    return TokenError(
        f"{option} on the command line is visible to every user of this machine (ps): choose a "
        f"new token and put it in the environment ({TOKEN_ENV}=...) or in a file only you can "
        f"read (--token-file PATH, chmod 600), or give neither for a random one"
    )


def cookie_name(port: int | None) -> str:
    """The cookie that carries the token after `?token=`, named after the server's port.

    What the name does: two dashboards a browser opens on one host (two ports) keep a
    cookie each, instead of the second overwriting the first's token.

    What it does not do: keep the token from other servers on that host. Cookies do not
    tell ports apart: a browser sends every cookie of a host (this one included, under any
    name) to every port of that host, so a server of another user on the same login node
    that the browser visits receives the token. HttpOnly keeps it from scripts and
    SameSite=Strict from other sites' pages, not from another port of the same host. The
    token is random per server by default and dies with it; where other users run servers
    on the host, reach the dashboard through an SSH tunnel to a host of your own, or
    through the hub (jupyter-server-proxy: a Unix socket, no cookie of this server)."""
    return "nbdist-dashboard-token" + (f"-{port}" if port else "")


# The reason phrase of every 403 (tornado writes it into the page as well).
REFUSED = "nbdist dashboard: token required; open the URL the server printed at start (it ends in ?token=...)"


def _from_header(authorization: str) -> str | None:
    scheme, _, value = authorization.partition(" ")
    return value.strip() if scheme.lower() == "token" and value.strip() else None


def _matches(given: str | None, token: str | None) -> bool:
    if not given or not token:
        return False
    return hmac.compare_digest(given.encode(), token.encode())


# What `panel serve dashboards/nbdist_dashboard.py` shows a session without the token.
TOKEN_REQUIRED_PAGE = f"""## nbdist dashboard: token required

This server does not check the dashboard's token, so the dashboard shows nothing here.
Serve it with `--auth-module dashboards/token_auth.py` (it prints the token), or with
`python -m nbdist dashboard --store ...` (it prints the URL with its token); or set
`{TOKEN_ENV}` for `panel serve` and open the page with `?token=...`."""


def session_has_token(request: Any, token: str | None) -> bool:
    """Whether the request that opened a served session (a Bokeh session context's
    request) carries `token`, as `?token=`, the cookie TokenAuth sets, or an
    `Authorization: token ...` header. No token to compare with: no."""
    header = _from_header(request.headers.get("Authorization", ""))
    argument = next(iter(request.arguments.get("token", [])), b"").decode() or None
    return any(_matches(given, token) for given in (header, argument, request.cookies.get(cookie_name(None))))


class _TokenRequired(RequestHandler):
    """Bokeh wants a login page; nothing is sent to it (requests without the token are
    refused where they arrive, see TokenAuth.get_user), but it answers 403 too."""

    def get(self) -> None:
        raise HTTPError(403, reason=REFUSED)


class TokenAuth(AuthProvider):
    """Lets in the requests that carry the token (query argument, the cookie it sets, or
    an `Authorization: token ...` header) and answers every other one, page or websocket,
    403 (not tornado's redirect to a login page: there is nothing to log in with)."""

    def __init__(self, token: str, *, cookie: str = cookie_name(None), cookie_path: str = "/"):
        self.token, self.cookie, self.cookie_path = token, cookie, cookie_path
        super().__init__()

    def given(self, handler: RequestHandler) -> tuple[str | None, bool]:
        """The token the request gives, and whether it came as `?token=` (browsers cannot
        add query arguments or headers to a websocket: those use the cookie)."""
        header = _from_header(handler.request.headers.get("Authorization", ""))
        if header is not None:
            return header, False
        if not isinstance(handler, WebSocketHandler):
            argument = handler.get_argument("token", None)
            if argument is not None:
                return argument, True
        return handler.get_cookie(self.cookie), False

    @property
    def get_user(self) -> Any:
        def user(handler: RequestHandler) -> str | None:
            given, in_url = self.given(handler)
            if not _matches(given, self.token):
                raise HTTPError(403, reason=REFUSED)
            if in_url and given:
                handler.set_cookie(self.cookie, given, path=self.cookie_path, httponly=True, samesite="Strict")
            return "nbdist"

        return user

    @property
    def login_url(self) -> str:
        return "/token-required"

    @property
    def login_handler(self) -> type[RequestHandler]:
        return _TokenRequired


class SameOriginWebsocket(PanelWSHandler):
    """Panel's websocket, taken only from pages of the host it is connected to (tornado's
    own rule: Origin equals Host). Behind jupyter-server-proxy that host is the hub's,
    which the server cannot know in advance, so it cannot be listed."""

    def check_origin(self, origin: str) -> bool:
        return WebSocketHandler.check_origin(self, origin)
