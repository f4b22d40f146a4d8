"""Whether a SQLite store lies on a network file system, where its locks do not hold.

SQLite keeps writers apart with POSIX file locks and, in WAL mode, with a memory-mapped
`-shm` file that every process of the store shares. On NFS, CIFS, Lustre, GPFS, BeeGFS,
CephFS and their kin, processes on different hosts do not see each other's shared
memory and often not each other's locks: two hosts writing one store at once can
corrupt it (sqlite.org/wal.html, "WAL does not work over a network filesystem";
sqlite.org/howtocorrupt.html, section 2.1). From one host the locks and the mapping are
that host's own and hold. So a run that writes a SQLite store on such a file system from
several hosts is refused (PostgreSQL is the store for that), and from one host warned
about (a dashboard or another job on another host must not write it meanwhile).

The file system of a path is the one mounted at the longest mount point that is a prefix
of the path's real location, as /proc/mounts lists them (a later mount over the same
point hides the earlier one). `file_system(path, table)` takes the table as text, so
that the rule is tested on any table, not only on this machine's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Mount", "NETWORK_FILE_SYSTEMS", "file_system", "network_mount", "parse_mounts", "MOUNTS"]

MOUNTS = "/proc/mounts"
# File systems whose files other hosts share (fstype as /proc/mounts spells it; FUSE
# ones as fuse.NAME). Local ones (ext4, xfs, btrfs, zfs, tmpfs, overlay, ...) are not here.
NETWORK_FILE_SYSTEMS = frozenset(
    {
        "nfs",
        "nfs4",
        "cifs",
        "smb3",
        "smbfs",
        "lustre",
        "gpfs",
        "beegfs",
        "fhgfs",
        "ceph",
        "fuse.ceph",
        "fuse.ceph-fuse",
        "glusterfs",
        "fuse.glusterfs",
        "afs",
        "panfs",
        "wekafs",
        "pvfs2",
        "orangefs",
        "ocfs2",
        "gfs2",
        "dvs",
        "9p",
        "fuse.sshfs",
        "fuse.s3fs",
        "fuse.gcsfuse",
    }
)


@dataclass(frozen=True, slots=True)
class Mount:
    point: str
    kind: str  # the fstype column: nfs4, lustre, ext4, ...
    source: str

    @property
    def networked(self) -> bool:
        return self.kind in NETWORK_FILE_SYSTEMS

    def __str__(self) -> str:
        return f"{self.kind} at {self.point}"


def _unescape(field: str) -> str:
    # The kernel writes space, tab, newline and backslash in mount points as \040 & co.
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mounts(table: str) -> list[Mount]:
    """The mounts of a /proc/mounts (or /etc/mtab) text, in its order."""
    mounts = []
    for line in table.splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[1].startswith("/"):
            mounts.append(Mount(_unescape(fields[1]), fields[2], _unescape(fields[0])))
    return mounts


def _under(path: str, point: str) -> bool:
    return point == "/" or path == point or path.startswith(point.rstrip("/") + "/")


def file_system(path: str | Path, table: str) -> Mount | None:
    """The mount that holds absolute `path` in mount table `table`: the longest mount
    point that is a prefix of it, the last one listed where several share it."""
    found: Mount | None = None
    for mount in parse_mounts(table):
        if _under(str(path), mount.point) and (found is None or len(mount.point) >= len(found.point)):
            found = mount
    return found


def network_mount(path: str | Path, table: str | None = None) -> Mount | None:
    """The network file system that file `path` (existing or not) lies on, or None when it
    is local or the mount table cannot be read (not Linux: nothing is said)."""
    if table is None:
        try:
            table = Path(MOUNTS).read_text()
        except OSError:
            return None
    # The directory's real location: the file may not exist yet, and a symbolic link
    # (a home directory linked into /gpfs) leads where the data are.
    real = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    mount = file_system(real, table)
    return mount if mount is not None and mount.networked else None
