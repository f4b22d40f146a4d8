"""The jupyter-server-proxy entry: JupyterHub users open the dashboard at
<hub>/user/<name>/nbdist-dashboard/ behind the hub's own authentication.

Registered in pyproject.toml under `jupyter_serverproxy_servers`; jupyter-server-proxy
starts the command on a free localhost port when the URL is first opened. The store is
$NBDIST_STORE, else runs/nbdist.db under the notebook server's directory.
"""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["server_process", "PROXY_NAME"]

PROXY_NAME = "nbdist-dashboard"


def server_process() -> dict[str, Any]:
    store = os.environ.get("NBDIST_STORE", "runs/nbdist.db")
    return {
        # The hub authenticates; the server itself listens on localhost only, and takes
        # websocket connections from pages of the hub's host (which it cannot know).
        "command": [sys.executable, "-m", "nbdist", "dashboard", "--store", store, "--port", "{port}",
                    "--prefix", "{base_url}" + PROXY_NAME, "--allow-websocket-origin", "*",
                    # Opened before the first run, it shows the runs to come.
                    "--create"],
        "absolute_url": True,
        "timeout": 60,
        "launcher_entry": {"title": "nbdist dashboard", "path_info": f"{PROXY_NAME}/nbdist"},
    }
