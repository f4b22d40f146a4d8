"""Serving the dashboard, always behind its token (nbdist.dashboard.access says why and
where the token comes from):

    python -m nbdist dashboard --store runs/nbdist.db     # http://127.0.0.1:5006/nbdist?token=...
    python -m nbdist dashboard --store ... --address 0.0.0.0
    python -m nbdist dashboard --store ... --unix-socket PATH --prefix /user/me/nbdist-dashboard

On a Unix socket (what the jupyter-server-proxy entry uses, nbdist.dashboard.proxy) the
server opens no TCP port at all: only its owner can connect to the socket, and the page
is reached through the hub, which authenticates.

Beyond loopback (`--address 0.0.0.0` or a host's address) the server speaks plain HTTP:
the token travels in the clear in the URL and the cookie, and anyone on the network path
can read it, and the runs with it. That is refused unless the user says `--insecure` (a
network they trust), and then said on the terminal; an SSH tunnel to the loopback server
(`ssh -L 5006:127.0.0.1:5006 HOST`) or the hub's proxy encrypt the way instead.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import sys
from pathlib import Path
from typing import Any

from nbdist.dashboard.access import SameOriginWebsocket, TokenAuth, cookie_name, dashboard_token
from nbdist.errors import UserError

__all__ = ["serve", "existing_store", "check_port", "DashboardError", "free_port", "is_loopback", "APP_PATH"]

APP_PATH = "nbdist"


class DashboardError(UserError):
    pass


def existing_store(store: str | Path, *, served: bool = True) -> str | Path:
    """`store` when it is a run store file; else one error naming it and where runs put
    theirs (a mistyped path would otherwise show a new, empty store). `served`: a server
    could start before the first run (--create); an export has nothing to show then."""
    from nbdist.store import STORE_FILE, RunStore, is_url

    if is_url(store):  # a database: it must hold a store already (no tables: an error naming it)
        RunStore(store, create=False).close()
        return store
    path = Path(store)
    if path.is_dir():
        inside = " (it holds one: --store " + str(path / STORE_FILE) + ")" if (path / STORE_FILE).is_file() else ""
        raise DashboardError(f"--store {store} is a directory, not a run store file{inside}")
    if not path.exists():
        raise DashboardError(
            f"--store {store}: no such run store; runs record in RUNS_DIR/{STORE_FILE} "
            f"(runs/{STORE_FILE} by default) or in the --store they were given"
            + (" (add --create to start the dashboard before the first run)" if served else ": export after a run")
        )
    return path


def serve(
    store: str | Path,
    *,
    address: str = "127.0.0.1",
    port: int = 5006,
    prefix: str = "",
    token: str | None = None,
    unix_socket: str | Path | None = None,
    run: str | None = None,
    study: str | None = None,
    allow_origin: list[str] | None = None,
    show: bool = False,
    create: bool = False,
    insecure: bool = False,
) -> Any:
    """Serve the dashboard of `store` until interrupted. Returns when the server stops.
    `token`: what every request must carry (default: $NBDIST_DASHBOARD_TOKEN, else a
    fresh random one). `unix_socket`: listen on this socket instead of `address`/`port`.
    `create`: start an empty store when there is none (the dashboard of runs to come).
    `insecure`: listen beyond loopback, where the token travels over plain HTTP."""
    import panel as pn

    from nbdist.dashboard.app import dashboard
    from nbdist.dashboard.sources import check_choices
    from nbdist.store import RunStore, is_url, store_label

    check_port(port)
    beyond_loopback = unix_socket is None and not is_loopback(address)
    if beyond_loopback and not insecure:
        raise DashboardError(plain_http_refused(address))
    if not create and not is_url(store):
        existing_store(store)  # a mistyped path is named, not created
    # An unreadable store (a database without nbdist's tables too) is an error now, not on
    # every page; one connection says it.
    with RunStore(store, create=create) as opened:
        empty = not opened.runs()
        check_choices(opened, run, study)
    token = dashboard_token() if token is None else token
    try:
        if unix_socket is not None:
            listen: dict[str, Any] = {"unix_socket": str(unix_socket), "websocket_origin": allow_origin}
        else:
            port = free_port(address) if port == 0 else port
            listen = {"address": address, "port": port, "websocket_origin": allow_origin or _origins(address, port)}
        auth = TokenAuth(
            token, cookie=cookie_name(port if unix_socket is None else None), cookie_path=prefix.rstrip("/") + "/"
        )
        # Panel adds what the factory returns to each session's page: return the page, not .servable().
        server = pn.serve(
            {APP_PATH: lambda: dashboard(store, run=run, study=study).start().page},
            prefix=prefix,
            show=False,
            start=False,
            verbose=False,
            title="nbdist dashboard",
            auth_provider=auth,
            **listen,
        )
    except OSError as exc:
        raise _cannot_listen(exc, address, port, unix_socket) from None
    if unix_socket is not None and not allow_origin:
        _same_origin_websockets(server)
    server.start()
    path = f"{prefix.rstrip('/')}/{APP_PATH}"
    if unix_socket is not None:
        # The token came from whoever started the server (the proxy adds it): not printed.
        where = f"on the Unix socket {unix_socket}, path {path}"
    else:
        host = socket.gethostname() if address in ("0.0.0.0", "::") else address
        where = f"at http://{host}:{server.port}{path}?token={token}"
    if beyond_loopback:
        print(f"nbdist: warning: {plain_http_warning(address)}", file=sys.stderr, flush=True)
    print(f"nbdist: dashboard of {store_label(store)}{' (no runs yet)' if empty else ''} {where}", flush=True)
    if show and unix_socket is None:
        server.show(f"/{APP_PATH}?token={token}")
    try:
        server.io_loop.start()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return server


def _same_origin_websockets(server: Any) -> None:
    """Behind a proxy the page's host (the hub's) is unknown here: Panel's websocket
    handler is swapped for one that takes pages of the host it was reached at."""
    from panel.io.server import WSHandler

    rules = [rule for rule in server._tornado.wildcard_router.rules if rule.target is WSHandler]
    if not rules:
        raise RuntimeError("Panel's websocket route was not found: the dashboard's origin rule cannot be set")
    for rule in rules:
        rule.target = SameOriginWebsocket


MAX_PORT = 65535


def check_port(port: int) -> None:
    """A TCP port number, or 0 for any free one (beyond them Bokeh's server fails on an assertion)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= MAX_PORT:
        raise DashboardError(f"--port {port}: a port is a number from 1 to {MAX_PORT}, or 0 for any free port")


def _cannot_listen(exc: OSError, address: str, port: int, unix_socket: str | Path | None) -> DashboardError:
    if unix_socket is not None:
        return DashboardError(f"cannot listen on the Unix socket {unix_socket}: {exc.strerror or exc}")
    if exc.errno == errno.EADDRINUSE:
        return DashboardError(
            f"port {port} on {address} is in use (another dashboard?): choose another with "
            f"--port, or --port 0 for any free port"
        )
    return DashboardError(
        f"cannot listen on {address} port {port}: {exc.strerror or exc}; --address takes an "
        f"interface of this machine: 127.0.0.1 (the default), or 0.0.0.0 for all"
    )


def is_loopback(address: str) -> bool:
    """Whether `address` (an IP address or a host name) is this machine's loopback."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:  # a host name: where it resolves
        try:
            return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(address, None))
        except (OSError, ValueError):
            return False


def plain_http_refused(address: str) -> str:
    return (
        f"--address {address} would serve the dashboard beyond this machine over plain HTTP: its token "
        f"(in the URL and the cookie) and the runs would cross the network unencrypted; serve on "
        f"127.0.0.1 (the default) and reach it through an SSH tunnel (ssh -L 5006:127.0.0.1:5006 "
        f"{socket.gethostname()}) or the hub's proxy, or add --insecure on a network you trust"
    )


def plain_http_warning(address: str) -> str:
    return (
        f"serving on {address} over plain HTTP (--insecure): the token and the runs cross the "
        f"network unencrypted; anyone on its path can read them"
    )


def free_port(address: str) -> int:
    with socket.socket() as probe:
        probe.bind((address, 0))
        return probe.getsockname()[1]


def _origins(address: str, port: int) -> list[str]:
    """The pages allowed to open the dashboard's websocket: those served by this server
    under any of the names it is reached by (Bokeh compares the Origin header)."""
    hosts = {"localhost", "127.0.0.1", address, socket.gethostname(), socket.getfqdn()}
    return [f"{host}:{port}" for host in sorted(hosts) if host]
