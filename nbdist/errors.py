"""Errors meant for the person at the keyboard.

A `UserError` is shown as its message alone (no traceback) in the notebook cell or on
the command line; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

__all__ = ["UserError", "OptionsError", "TrainingError", "DiskFull"]


class UserError(Exception):
    """Bad input: the message names the problem and, where it can, the fix."""

    def _render_traceback_(self) -> list[str]:
        # IPython shows what this returns instead of a traceback: in a notebook cell the
        # user sees the one line that says what is wrong.
        return [f"{type(self).__name__}: {self}"]


class OptionsError(UserError, ValueError):
    pass


class TrainingError(UserError, RuntimeError):
    """Training could not go on (a NaN loss, a worker that failed)."""


class DiskFull(TrainingError):
    """A write of the run found no space left on its file system (nbdist.train.diskspace)."""
