"""A full disk under a run's files, told in one line: where, how much, how to go on.

Any write of a run can find its file system full: a checkpoint (the big one), the
metric logs, the history, the final weights. Each such `OSError` (ENOSPC, or EDQUOT for
a user's quota) becomes a `DiskFull` that names the directory, what the write needed
(for a checkpoint, its size: this rank's share, and the whole checkpoint as big as the
last one committed) and what is free there. The run then ends as after any error (every
rank, no hang), and the rank that reports it adds the checkpoint to resume from
(roles/runner.py): the checkpoints before are intact, since a checkpoint is committed
only once all its files are written.
"""

from __future__ import annotations

import errno
import json
import shutil
from pathlib import Path
from typing import TypeGuard

from nbdist.errors import DiskFull

__all__ = ["NO_SPACE", "is_disk_full", "disk_full", "checkpoint_disk_full", "size_text"]

NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


def is_disk_full(exc: BaseException) -> TypeGuard[OSError]:
    return isinstance(exc, OSError) and exc.errno in NO_SPACE


def size_text(n: float) -> str:
    """Bytes for people: 812 B, 3.4 kB, 1.2 MB, 7.9 GB."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _free(path: Path, unfinished: Path | None = None) -> str:
    """What is free on the file system of `path` (or of its nearest existing parent), with
    the files of `unfinished` counted as free (the run removes them as it ends)."""
    for place in (path, *path.parents):
        try:
            free = shutil.disk_usage(place).free
        except OSError:
            continue
        return size_text(free + _bytes_in(unfinished))
    return "an unknown amount"


def _bytes_in(directory: Path | None) -> int:
    if directory is None:
        return 0
    total = 0
    for file in directory.glob("*"):
        try:
            total += file.stat().st_size
        except OSError:
            continue
    return total


def disk_full(exc: OSError, *, needed: int | None = None, what: str | None = None) -> DiskFull:
    """The DiskFull for write error `exc` (its file names the directory)."""
    path = Path(exc.filename) if exc.filename else Path.cwd()
    directory = path.parent if exc.filename else path
    wrote = what or f"writing {path.name}"
    need = f"it needed {size_text(needed)}" if needed is not None else "it needed more"
    return DiskFull(f"no space left on the device of {directory} ({wrote}: {need}, {_free(directory)} is free)")


def checkpoint_disk_full(exc: OSError, directory: Path, label: str, share: int) -> DiskFull:
    """The DiskFull for a checkpoint share of `share` bytes written into `directory`
    (checkpoints/.tmp-<label>): the whole checkpoint's size is estimated from the last
    one committed, which lists its files and their sizes in its meta.json."""
    whole = _last_checkpoint_bytes(directory.parent)
    size = f"about {size_text(whole)}, as the last one" if whole else f"this rank's share alone {size_text(share)}"
    free = _free(directory, unfinished=directory)
    return DiskFull(
        f"no space left on the device of {directory.parent} for checkpoint {label} ({size}; {free} is free)"
    )


def _last_checkpoint_bytes(root: Path) -> int:
    latest = root / "LATEST.json"
    try:
        label = json.loads(latest.read_text(encoding="utf-8"))["label"]
        files = json.loads((root / label / "meta.json").read_text(encoding="utf-8"))["files"]
        return int(sum(int(f["bytes"]) for f in files.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0
