"""Files that are their owner's alone, that survive a crash or a power cut once written,
and the digests that prove it.

Every file and directory nbdist creates for a run (run directories, options, metric
logs, checkpoints, summaries, failure reports, the SQLite store, sbatch scripts,
dashboard exports) is made here, private to the user: directories 0700, files 0600,
whatever the umask. A shared login node has other users, and what a run writes (options
with paths and host names, metrics, weights) is as much the user's as the dashboard that
asks for a token to show it. The modes are set with chmod after creating, because the
umask may also take bits away from the owner (umask 0277 would leave a directory its
owner cannot write to). Existing files and directories keep their modes: a directory
the user made (or chmod-ed to share with a group) is theirs to decide.

A write is durable only when the file's data and its name are on disk: the file is
fsynced, then the directory that holds its name. Checkpoints and the run's history are
written this way before anything points at them.

Digests are SHA-256: on this kind of CPU (SHA extensions, which x86 servers have had
since Ice Lake and Zen) OpenSSL's SHA-256, which `hashlib` uses, hashes about 1.5 GB/s
against 0.77 GB/s for BLAKE2b, and `sha256sum` lets a person check a file by hand.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

__all__ = [
    "DIGEST",
    "PRIVATE_DIR",
    "PRIVATE_FILE",
    "file_digest",
    "fsync_dir",
    "make_dir",
    "make_private",
    "naming",
    "open_private",
    "private_fd",
    "replace_file",
    "write_bytes",
    "write_json",
    "write_text",
]

DIGEST = "sha256"
PRIVATE_DIR = 0o700
PRIVATE_FILE = 0o600
# open()'s text and binary modes, as os.open flags (every one creates a missing file).
_FLAGS = {
    "w": os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
    "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
    "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
}


def fsync_dir(path: Path) -> None:
    """Make the names in directory `path` (files created, renamed or removed) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dir(path: Path | str, *, exclusive: bool = False) -> None:
    """mkdir -p, each directory it creates private (0700) and durable in its parent.
    `exclusive`: `path` itself must be new (FileExistsError otherwise): one atomic mkdir
    decides between two processes that want the same name."""
    path = Path(path)
    if not exclusive and path.is_dir():
        return
    if not path.parent.is_dir():
        make_dir(path.parent)
    try:
        path.mkdir(mode=PRIVATE_DIR)
    except FileExistsError:  # another rank made it meanwhile
        if exclusive or not path.is_dir():
            raise
        return
    os.chmod(path, PRIVATE_DIR)
    fsync_dir(path.parent)


def private_fd(path: Path | str, flags: int) -> int:
    """os.open(path, flags) with a file it creates private (0600); a file it finds keeps
    its mode."""
    flags |= os.O_CLOEXEC
    if not flags & os.O_CREAT:
        return os.open(path, flags)
    while True:
        try:
            fd = os.open(path, flags | os.O_EXCL, PRIVATE_FILE)
        except FileExistsError:
            if flags & os.O_EXCL:
                raise
            try:
                return os.open(path, flags & ~os.O_CREAT)  # there already: as it is
            except FileNotFoundError:
                continue  # removed in between: create it after all
        try:
            if stat.S_IMODE(os.fstat(fd).st_mode) != PRIVATE_FILE:  # the umask took owner bits
                os.fchmod(fd, PRIVATE_FILE)
        except BaseException:
            os.close(fd)
            raise
        return fd


def open_private(path: Path | str, mode: str = "w", **text: Any) -> IO[Any]:
    """open(path, mode) for writing ('w', 'a', 'x', with 'b' for bytes), creating the
    file private (0600); `text`: open()'s encoding, errors, newline."""
    kind = mode.replace("b", "")
    if kind not in _FLAGS:
        raise ValueError(f"open_private writes: mode 'w', 'a' or 'x' (with 'b' for bytes), not {mode!r}")
    if "b" not in mode:
        text.setdefault("encoding", "utf-8")
    return open(private_fd(path, _FLAGS[kind]), mode, **text)


def make_private(path: Path | str) -> None:
    """chmod a file (0600) or directory (0700) that a library created with its own mode
    (safetensors, h5py, bokeh): before anything else can open it."""
    os.chmod(path, PRIVATE_DIR if Path(path).is_dir() else PRIVATE_FILE)


@contextlib.contextmanager
def naming(path: Path | str) -> Iterator[None]:
    """An OSError inside names `path` when it names no file: write(), flush(), fsync() and
    close() name none, and a full disk would be told as the current directory's
    (train/diskspace.py) instead of this file's."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None:
            raise
        raise OSError(exc.errno, exc.strerror, str(path)) from exc


def write_bytes(path: Path, data: bytes) -> dict[str, Any]:
    """Write and fsync `data` into a private file (the caller fsyncs the directory);
    returns its size and digest. An error names the file, as open()'s do."""
    with naming(path), open_private(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return {"bytes": len(data), DIGEST: hashlib.new(DIGEST, data).hexdigest()}


def replace_file(path: Path, data: bytes) -> None:
    """Replace `path` with `data` atomically and durably (temporary file, fsync, rename,
    fsync of the directory): a reader sees the old file or the new one, never a part."""
    tmp = path.with_name(path.name + ".tmp")
    write_bytes(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_json(path: Path, data: Any, *, default: Any = None) -> None:
    """`data` as indented JSON, replacing `path` atomically (`default`: json.dumps')."""
    replace_file(path, json.dumps(data, indent=1, default=default).encode("utf-8"))


def write_text(path: Path, text: str) -> None:
    replace_file(path, text.encode("utf-8"))


def file_digest(path: Path) -> dict[str, Any]:
    """Size and digest of a file on disk, as `write_bytes` returns them."""
    digest = hashlib.new(DIGEST)
    with open(path, "rb") as fh:
        # hashlib.file_digest would do this, from Python 3.11 on only.
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
        return {"bytes": os.fstat(fh.fileno()).st_size, DIGEST: digest.hexdigest()}
