"""The live dashboard (Panel + HoloViews): per-rank throughput, staleness, loss and
accuracy, a compute/communicate/wait timeline, CPU and memory, the layout tree, the
study's population; served, inline in a notebook, or exported as one HTML file.

Importing this package imports Panel and HoloViews: nbdist does so only when a
dashboard is asked for.
"""

from nbdist.dashboard.app import Dashboard, dashboard
from nbdist.dashboard.export import export_html
from nbdist.dashboard.serve import serve

__all__ = ["Dashboard", "dashboard", "export_html", "serve"]
