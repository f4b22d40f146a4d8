"""Files that survive a crash or a power cut once written, and the digests that prove it.

A write is durable only when the file's data and its name are on disk: the file is
fsynced, then the directory that holds its name. Checkpoints and the run's history are
written this way before anything points at them.

Digests are SHA-256: on this kind of CPU (SHA extensions, which x86 servers have had
since Ice Lake and Zen) OpenSSL's SHA-256, which `hashlib` uses, hashes about 1.5 GB/s
against 0.77 GB/s for BLAKE2b, and `sha256sum` lets a person check a file by hand.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

__all__ = ["DIGEST", "file_digest", "fsync_dir", "make_dir", "replace_file", "write_bytes", "write_json"]

DIGEST = "sha256"


def fsync_dir(path: Path) -> None:
    """Make the names in directory `path` (files created, renamed or removed) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dir(path: Path) -> None:
    """mkdir -p, with each directory it creates durable in its parent."""
    if path.is_dir():
        return
    make_dir(path.parent)
    try:
        path.mkdir()
    except FileExistsError:  # another rank made it meanwhile
        return
    fsync_dir(path.parent)


def write_bytes(path: Path, data: bytes) -> dict[str, Any]:
    """Write and fsync `data` (the caller fsyncs the directory); returns its size and digest."""
    with open(path, "wb") as fh:
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


def write_json(path: Path, data: Any) -> None:
    replace_file(path, json.dumps(data, indent=1).encode("utf-8"))


def file_digest(path: Path) -> dict[str, Any]:
    """Size and digest of a file on disk, as `write_bytes` returns them."""
    digest = hashlib.new(DIGEST)
    with open(path, "rb") as fh:
        # hashlib.file_digest would do this, from Python 3.11 on only.
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
        return {"bytes": os.fstat(fh.fileno()).st_size, DIGEST: digest.hexdigest()}
