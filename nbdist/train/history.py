"""The run's epoch records, stored once: `RUN/history.jsonl`, one JSON line per epoch.

A checkpoint used to hold the whole history in its JSON, so a run checkpointing every
epoch stored it over and over (the copies grow with the square of the epochs). Now the
run leader appends the new records to one file, fsynced before the checkpoint that
includes them is committed, and a checkpoint holds only how many records belong to it.
A resume reads that many and cuts the file back to them: the epochs after the checkpoint
are trained, and recorded, again.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

from nbdist.durable import fsync_dir, naming, open_private, replace_file
from nbdist.train.writer import CheckpointWriter

__all__ = ["HistoryFile"]

ENTRIES = "history_entries"  # the key a checkpoint's rank JSON holds the count under


class HistoryFile:
    """`writer`: this rank (the run leader) writes the file; the others only read it."""

    def __init__(self, run_dir: Path | str, writer: bool):
        self.path = Path(run_dir) / "history.jsonl"
        self.writer = writer
        self.written = 0  # records already in the file

    def checkpoint(self, history: list[dict[str, Any]], writer: CheckpointWriter | None = None) -> dict[str, int]:
        """Make `history` durable before the checkpoint that refers to it is committed;
        returns what a checkpoint stores in its place. With the checkpoint's `writer`, the
        append and its fsync are that thread's next job (its jobs run in order: before the
        share and the commit submitted after it), off the training loop; else at once."""
        if self.writer and len(history) > self.written:
            lines = "".join(json.dumps(entry) + "\n" for entry in history[self.written :])
            append = functools.partial(self._append, lines, created=self.written == 0)
            if writer is None:
                append()
            else:
                writer.submit(append)
            self.written = len(history)
        return {ENTRIES: len(history)}

    def _append(self, lines: str, created: bool) -> None:
        with naming(self.path), open_private(self.path, "a") as fh:
            fh.write(lines)
            fh.flush()
            os.fsync(fh.fileno())
        if created:
            fsync_dir(self.path.parent)  # the file's name, when it was just created

    def resume(self, saved: dict[str, Any]) -> list[dict[str, Any]]:
        """The history of the checkpoint whose scalars are `saved`; the writer rewrites the
        file to hold exactly that."""
        if "history" in saved:  # a checkpoint written before history.jsonl
            entries = list(saved["history"])
        else:
            wanted = int(saved.get(ENTRIES, 0))
            entries = self.read(wanted)
            if self.writer and len(entries) < wanted:
                print(
                    f"nbdist: warning: {self.path} holds {len(entries)} intact epoch records, the checkpoint "
                    f"includes {wanted}: the run's summary lacks the others",
                    file=sys.stderr,
                    flush=True,
                )
        if self.writer:
            replace_file(self.path, "".join(json.dumps(entry) + "\n" for entry in entries).encode("utf-8"))
        self.written = len(entries)
        return entries

    def read(self, count: int) -> list[dict[str, Any]]:
        """The first `count` records, or fewer where the file ends or a line is damaged."""
        entries: list[dict[str, Any]] = []
        if count <= 0 or not self.path.exists():
            return entries
        with open(self.path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                try:
                    entries.append(json.loads(line))
                except ValueError:
                    break  # a damaged line: the ones after it cannot be placed
                if len(entries) == count:
                    break
        return entries
