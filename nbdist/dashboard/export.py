"""A finished run's dashboard as one self-contained HTML file (for logbooks and reports):
every plot with its data and the JavaScript inline, no server, no network."""

from __future__ import annotations

from pathlib import Path

__all__ = ["export_html"]


def export_html(store: str | Path, path: str | Path, *, run: str | None = None, study: str | None = None) -> Path:
    """Write the dashboard of `run` (default: the newest) in `store` to `path`."""
    from bokeh.resources import INLINE

    from nbdist.dashboard.app import dashboard

    board = dashboard(store, run=run, study=study, live=False)
    board.drain()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    board.page.save(str(path), resources=INLINE, title=f"nbdist dashboard: {board.view.info.id if board.view else ''}")
    return path
