"""Notes on a study and its trials, as optuna-dashboard keeps them: written on the study's
page (served, or under a notebook cell) and kept in the run store with the study, so that
every reader of the store, the trial table and an exported page show them.

An exported page shows the notes as text (nothing there could save an edit).
"""

from __future__ import annotations

import html
import time
from typing import Any

import panel as pn

from nbdist.store import RunStore

__all__ = ["NotesView", "notes_markdown"]


def notes_markdown(notes: dict[int | None, str]) -> str:
    """The notes as Markdown, the study's first, then by trial; the text escaped (a note
    is shown as written, never run as HTML, in a page that may be passed on)."""
    if not notes:
        return "*no notes yet*"
    lines = []
    for number in sorted(notes, key=lambda n: -1 if n is None else n):
        who = "Study" if number is None else f"Trial {number}"
        lines.append(f"**{who}:** " + html.escape(notes[number]).replace("\n", "  \n"))
    return "\n\n".join(lines)


class NotesView:
    def __init__(self, store: RunStore, study_id: str, *, live: bool):
        self.store, self.study_id = store, study_id
        self.notes: dict[int | None, str] = {}
        self.listing = pn.pane.Markdown("", sizing_mode="stretch_width", name="nbdist-study-notes")
        if not live:
            self.panel = pn.Column(self.listing, sizing_mode="stretch_width")
            return
        area = {"height": 110, "sizing_mode": "stretch_width"}
        self.study_note = pn.widgets.TextAreaInput(label="the study's note", **area)
        self.trial = pn.widgets.IntInput(label="trial", value=0, start=0, width=120)
        self.trial_note = pn.widgets.TextAreaInput(label="the trial's note", **area)
        self.save_study = pn.widgets.Button(label="save the study's note", color="primary")
        self.save_trial = pn.widgets.Button(label="save the trial's note", color="primary")
        self.said = pn.pane.Markdown("", name="nbdist-notes-saved")
        self.save_study.on_click(lambda event: self.save(None))
        self.save_trial.on_click(lambda event: self.save(int(self.trial.value or 0)))
        self.trial.param.watch(lambda event: self._show_trial(), "value")
        self.panel = pn.Column(
            self.study_note,
            self.save_study,
            pn.Row(self.trial, self.trial_note, sizing_mode="stretch_width"),
            self.save_trial,
            self.said,
            self.listing,
            sizing_mode="stretch_width",
        )

    def refresh(self) -> None:
        """Read the notes again (another page, or another user of the store, may have saved some)."""
        self.notes = self.store.notes(self.study_id)
        self.listing.object = notes_markdown(self.notes)
        if hasattr(self, "study_note"):
            self.study_note.value = self.notes.get(None, "")
            self._show_trial()

    def _show_trial(self) -> None:
        self.trial_note.value = self.notes.get(int(self.trial.value or 0), "")

    def save(self, trial: int | None) -> None:
        """Keep the study's note (trial None) or a trial's, as written in its box."""
        text = (self.study_note if trial is None else self.trial_note).value or ""
        self.store.save_note(self.study_id, text, trial=trial)
        what = "the study's note" if trial is None else f"trial {trial}'s note"
        self.said.object = f"*{what} saved at {time.strftime('%H:%M:%S')}*"
        self.refresh()

    @property
    def by_trial(self) -> dict[int, Any]:
        """The trials' notes (not the study's), for the trial table."""
        return {n: text for n, text in self.notes.items() if n is not None}
