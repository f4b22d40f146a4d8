"""Panel objects that a live dashboard needs beyond Panel's own: a Markdown pane whose
updates send its text only, a page that applies the browser's messages on the kernel's
main thread, and the push that sends a notebook's Bokeh changes."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import panel as pn

__all__ = ["LiveMarkdown", "NotebookPage", "push_bokeh_changes"]


class LiveMarkdown(pn.pane.Markdown):
    """Markdown whose updates send its text, not its stylesheets again.

    Panel's HTML panes set every property of their model again on each update, the
    stylesheets among them, and those link Panel's CDN: a notebook display inlines them
    once, when the pane is first shown (a served page maps them to its own server). Under
    a notebook cell, each update of a run's header then made the browser ask the internet
    for four stylesheets."""

    def _update(self, ref: str, model: Any) -> None:
        properties = self._get_properties(model.document)
        properties.pop("stylesheets", None)  # unchanged since the pane was shown
        model.update(**properties)


class NotebookPage(pn.Column):
    """A page whose browser messages are applied on the thread that updates it.

    JupyterLab (4.6 here) sends comm messages to a kernel that has subshells (ipykernel 7) on a
    subshell thread. Panel applies a browser message to the notebook's document between
    `hold()` and `unhold()`, and `unhold()` hands every event held at that moment to no one:
    an update the kernel's main thread had made but not yet pushed (the dashboard's poll
    runs there) was lost, and a study plot stayed at 2 of 6 trials. The message is handed
    to the main thread's event loop instead, where it runs between two polls."""

    _owner: tuple[asyncio.AbstractEventLoop, int] | None = None

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> Any:
        try:
            self._owner = (asyncio.get_running_loop(), threading.get_ident())
        except RuntimeError:  # no event loop: messages are applied where they arrive
            self._owner = None
        return super()._repr_mimebundle_(include, exclude)

    def _on_msg(self, ref: str, manager: Any, msg: Any) -> None:
        apply = super()._on_msg
        if self._owner is None or self._owner[1] == threading.get_ident():
            apply(ref, manager, msg)
            return

        def on_owner_thread() -> None:
            try:
                apply(ref, manager, msg)
            except Exception as error:  # shown as Panel shows a message's error
                self._on_error(ref, error)

        self._owner[0].call_soon_threadsafe(on_owner_thread)


def push_bokeh_changes(viewable: Any) -> None:
    """Send what was changed on Bokeh models under `viewable` (a source's data, a title)
    to the notebook cells that show it; served, a no-op (the session sends every change).

    Under a notebook cell Panel holds the document's changes and sends them only when one
    of its own parameters changes: a view that sets a Bokeh model directly waited for the
    next such change, and the study page's history stayed at 2 of 6 trials. Inside a
    browser message (a tab opened, a widget changed) it is worse: the changes held when
    the message ends are dropped, and the tab opened showed its figures as they were
    when it was built, empty. A view calls this once its models are changed."""
    from panel.io.notebook import push_on_root

    for root in list(viewable._models):  # the ids of the roots it is shown under
        push_on_root(root)
