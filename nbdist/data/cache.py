"""Node-local copies of data files, the HPC habit: read the shared file system once,
then the local disk (or memory-backed /tmp) for every epoch after."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import weakref
from pathlib import Path

from nbdist.data.base import DataReadError
from nbdist.errors import UserError

__all__ = ["FileCache", "CacheError"]

MARKER = ".made-by-nbdist"


class CacheError(UserError):
    pass


class FileCache:
    """Copies files into a private directory under `root`, removed again by close().

    Each process has its own directory (ranks on one node never race on a half-written
    copy); it is removed by close(), or when the interpreter exits if close() was not
    reached. `root` itself goes too when a cache created it and the last one leaves it empty.
    """

    def __init__(self, root: str | Path):
        self.root = Path(root).expanduser()
        try:
            try:
                self.root.mkdir(parents=True)
                # Ranks that start together race to create the root; the marker tells the
                # last one to finish that nbdist made it, so it may go when empty.
                (self.root / MARKER).touch()
            except FileExistsError:
                pass
            self.dir = Path(tempfile.mkdtemp(prefix=f"nbdist-{socket.gethostname()}-{os.getpid()}-", dir=self.root))
        except OSError as exc:
            raise CacheError(f"--cache-dir {str(root)!r} cannot be used: {exc.strerror or exc}") from None
        self._copies: dict[Path, Path] = {}
        self._lock = threading.Lock()  # the prefetch thread and the training thread both copy
        self._cleanup = weakref.finalize(self, _remove, self.dir, self.root)

    def local(self, path: Path) -> Path:
        """The cached copy of `path`, made now if there is none yet."""
        with self._lock:
            copy = self._copies.get(path)
            if copy is None:
                copy = self.dir / f"{len(self._copies):05d}-{path.name}"
                partial = copy.with_name(copy.name + ".partial")
                try:
                    shutil.copyfile(path, partial)
                    os.replace(partial, copy)
                except OSError as exc:
                    raise DataReadError(
                        f"cannot copy {path} into the cache {self.dir}: {exc.strerror or exc}"
                    ) from None
                self._copies[path] = copy
            return copy

    @property
    def copies(self) -> dict[Path, Path]:
        with self._lock:
            return dict(self._copies)

    def close(self) -> None:
        self._cleanup()


def _remove(directory: Path, root: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    try:
        if [p.name for p in root.iterdir()] == [MARKER]:
            (root / MARKER).unlink()
            root.rmdir()
    except OSError:
        pass  # another rank got there first, or still uses it
