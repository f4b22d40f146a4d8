"""Taking a cluster's processes down: when it is stopped, and when its owner dies.

A cluster started here is taken down with the process that started it, even by kill -9:
each launcher gets a watchdog process (nbdist.watchdog) that outlives a killed kernel
and ends what it watches. `teardown` is the orderly way: it closes the client and, for a
cluster started here, stops the engines and the controller and makes sure no process of
the controller is left behind. An attached cluster's engines belong to whoever started
them: tearing it down only disconnects.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import psutil

from nbdist import watchdog
from nbdist.cluster.launchers import controller_processes
from nbdist.liveness import Liveness

if TYPE_CHECKING:
    from nbdist.cluster.cluster import Cluster

__all__ = ["teardown", "unwatch", "watch"]


def watch(cluster: Cluster, key: str, launcher: Any, remove: str | None = None) -> None:
    """Start a watchdog that takes this launcher's processes down when the cluster's
    owner dies: this process for a cluster started here; for engines started here for
    an attached cluster, its controller (whoever stops that cluster stops them too)."""
    process = getattr(launcher, "process", None)
    owner = psutil.Process() if cluster.owned else getattr(cluster._ipp.controller, "process", None)
    if isinstance(process, psutil.Process) and isinstance(owner, psutil.Process):
        cluster._watchdogs[key] = watchdog.start(owner, [process], remove=remove)
    elif getattr(launcher, "job_id", "") and cluster.engines == "slurm" and isinstance(owner, psutil.Process):
        # A SLURM job has no local process: cancel it when the owner dies; the watchdog
        # leaves quietly with the controller (a normal stop cancels the job itself).
        controller = getattr(cluster._ipp.controller, "process", None)
        if isinstance(controller, psutil.Process):
            cluster._watchdogs[key] = watchdog.start(owner, [controller], scancel=launcher.job_id)


def unwatch(cluster: Cluster, key: str) -> None:
    dog = cluster._watchdogs.pop(key, None)
    if dog is not None:
        dog.kill()
        dog.wait()


def teardown(cluster: Cluster) -> None:
    """Close the client and stop what this cluster owns; afterwards it is not running."""
    if cluster.client is not None:
        try:
            cluster.client.close()
        except Exception:  # closing a dead connection
            pass
    ipp_cluster = cluster._ipp
    if ipp_cluster is not None and cluster.owned:
        # A batch job that was never submitted has nothing to cancel, and ipyparallel's
        # `scancel ''` for it would fail before the controller is stopped.
        for key, engine_set in list(ipp_cluster.engines.items()):
            if hasattr(engine_set, "job_id") and not engine_set.job_id:
                ipp_cluster.engines.pop(key)
        controller = controller_processes(ipp_cluster)
        try:
            ipp_cluster.stop_cluster_sync()
        except Exception:  # already gone
            pass
        # A controller stopped while it still starts its schedulers can leave them
        # orphaned (seen under load after a refused engines job): they go too, those
        # forked after the list above included (they are in the controller's group).
        if controller:
            listed = {p.pid for p in controller}
            controller += [p for p in watchdog.process_groups([controller[0].pid]) if p.pid not in listed]
        watchdog.take_down([p for p in controller if p.is_running()], grace=5.0)
    if cluster.owned:
        for key in list(cluster._watchdogs):
            unwatch(cluster, key)
    # An attached cluster's watchdogs go on: they end the engines started here for it
    # with its controller, which outlives this client.
    cluster._watchdogs.clear()
    cluster.client, cluster.view, cluster._ipp, cluster.info = None, None, None, []
    cluster._health = Liveness(cluster._health.ping_seconds)
