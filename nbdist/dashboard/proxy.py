"""The jupyter-server-proxy entry: JupyterHub users open the dashboard at
<hub>/user/<name>/nbdist-dashboard/nbdist behind the hub's own authentication.

Registered in pyproject.toml under `jupyter_serverproxy_servers`; jupyter-server-proxy
starts the command when the URL is first opened. The store is $NBDIST_STORE, else
runs/nbdist.db under the notebook server's directory.

Nothing here can be reached around the hub:
- the dashboard listens on a Unix socket in a directory jupyter-server-proxy makes for
  it (mode 700), not on a TCP port another user of the node could connect to;
- it still requires its token, as everywhere: a random one made here, handed to the
  server in its environment (not on its command line, which `ps` shows) and added by the
  proxy to every request it forwards (pages and websockets);
- its websockets are taken only from pages of the host the browser reached it at, the
  hub's (the Jupyter server checks the same before it forwards one).
"""

from __future__ import annotations

import os
import secrets
import sys
from typing import Any

from nbdist.dashboard.access import TOKEN_ENV

__all__ = ["server_process", "PROXY_NAME"]

PROXY_NAME = "nbdist-dashboard"


def server_process() -> dict[str, Any]:
    store = os.environ.get("NBDIST_STORE", "runs/nbdist.db")
    token = secrets.token_urlsafe(32)
    return {
        "command": [
            sys.executable,
            "-m",
            "nbdist",
            "dashboard",
            "--store",
            store,
            "--unix-socket",
            "{unix_socket}",
            "--prefix",
            "{base_url}" + PROXY_NAME,
            # Opened before the first run, it shows the runs to come.
            "--create",
        ],
        "unix_socket": True,
        "environment": {TOKEN_ENV: token},
        "request_headers_override": {"Authorization": f"token {token}"},
        "absolute_url": True,
        "timeout": 60,
        "launcher_entry": {"title": "nbdist dashboard", "path_info": f"{PROXY_NAME}/nbdist"},
    }
