"""The cluster in use in this process: the one started or attached last.

The `%distnn` magics take no cluster argument: they run on this one. `Cluster.start()`
and `Cluster.attach()` make their cluster the one in use, `Cluster.stop()` forgets it.
Kept in a module of its own so that the magics ask for it through a public function
instead of reading a private variable.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from nbdist.cluster.errors import ClusterError

if TYPE_CHECKING:
    from nbdist.cluster.cluster import Cluster

__all__ = ["current_cluster", "forget", "make_current", "running_cluster"]

_current: Cluster | None = None


def running_cluster() -> Cluster | None:
    """The cluster started or attached last in this process, if it is still running.

    Returns:
        That cluster, or None when none was started or it was stopped since.

    Example:
        What `%distnn cluster status` prints::

            from nbdist.cluster import running_cluster

            cluster = running_cluster()
            print(cluster.status() if cluster is not None else "nbdist cluster: not running")
    """
    return _current if _current is not None and _current.running else None


def current_cluster() -> Cluster:
    """The cluster started last in this process (what the magics use).

    Raises:
        ClusterError: No cluster is running; the message says how to start one.
    """
    running = running_cluster()
    if running is None:
        raise ClusterError(
            "no cluster is running: start one with  %distnn cluster start -n 4  (or nbdist.Cluster(n=4).start())"
        )
    return running


def make_current(cluster: Cluster) -> None:
    """Make `cluster` the one the magics use (start() and attach() do)."""
    global _current
    _current = cluster


def forget(cluster: Cluster) -> None:
    """`cluster` was stopped: if it was the one in use, none is now."""
    global _current
    if _current is cluster:
        _current = None
