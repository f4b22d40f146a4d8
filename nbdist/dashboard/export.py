"""A finished run's dashboard as one self-contained HTML file (for logbooks and reports):
every plot with its data, and the JavaScript, the stylesheets and the icon inline: no
server, no network."""

from __future__ import annotations

import base64
from pathlib import Path

from nbdist.durable import make_dir, open_private
from nbdist.errors import UserError

__all__ = ["export_html"]


def export_html(store: str | Path, path: str | Path, *, run: str | None = None, study: str | None = None) -> Path:
    """Write the dashboard of `run` (default: the newest) in `store` to `path`; with
    `study` and no `run`, that study's page alone (every view of nbdist.dashboard.study,
    each tab drawn)."""
    from bokeh.document import Document
    from bokeh.models.ui.ui_element import UIElement
    from bokeh.resources import INLINE
    from panel.io.model import add_to_doc
    from panel.io.notebook import patch_inline_stylesheets
    from panel.io.save import save

    from nbdist.dashboard.app import dashboard

    path = Path(path)
    if not path.name.endswith(".html"):
        # Panel's save would write `<path>.html` instead, not private, and leave `path` empty.
        raise UserError(f"--export {path}: the dashboard is an HTML page; give a file name ending in .html")
    board = dashboard(store, run=run, study=study, live=False, runs=study is None or run is not None)
    board.drain()
    make_dir(path.parent)
    # Made private before bokeh writes into it (it keeps the mode of a file it truncates):
    # the page holds the run's options, hosts and metrics.
    open_private(path, "w").close()
    doc = Document()
    root = board.page.get_root(doc)
    add_to_doc(root, doc)
    # Panel's components link their stylesheets from its CDN even with INLINE resources
    # (a page opened offline would lose its styles): the same files, inline.
    for model in root.select({"type": UIElement}):
        patch_inline_stylesheets(model)
    title = f"nbdist dashboard: {board.view.info.id}" if board.view else f"nbdist study dashboard: {study or ''}"
    save(
        doc,
        str(path),
        title=title,
        resources=INLINE,
        template_variables={"app_favicon": _panel_icon(), "apple_icon": ""},
    )  # else icons from the CDN
    board.close()
    return path


def _panel_icon() -> str:
    from panel.io.resources import DIST_DIR

    return "data:image/x-icon;base64," + base64.b64encode((DIST_DIR / "images" / "favicon.ico").read_bytes()).decode()
