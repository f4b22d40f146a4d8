"""A cluster's health: which engines are dead (nbdist.liveness), how to say so, and healing.

`check_alive` (before every job) fails at once naming the dead engines; `status_text` lists
every engine and its state; `heal` replaces dead engines: an MPI engine set is one
`mpiexec` job whose survivors cannot take a new rank in, so the whole set is stopped and
a new one started on the same controller. The functions take the `Cluster` they look at;
its methods of the same names call them.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import psutil

from nbdist import watchdog
from nbdist.cluster import launchers
from nbdist.cluster.errors import HEAL_HINT, ClusterError
from nbdist.cluster.startup import map_ranks, wait_for_engines
from nbdist.cluster.stopping import teardown, unwatch, watch
from nbdist.liveness import Liveness, process_gone

if TYPE_CHECKING:
    from nbdist.cluster.cluster import Cluster

__all__ = ["check_alive", "heal", "status_text"]

# How long a stopped engine set's engines get to unregister before the new set starts
# (they then get their ranks as engine ids again).
UNREGISTER_SECONDS = 10.0


def heal(cluster: Cluster, n: int | None = None, *, missing: str = "") -> str:
    """Replace the dead engines (see `Cluster.heal`); what happened, in one line."""
    if not cluster.running:
        raise ClusterError("the cluster is not running: start it with  %distnn cluster start -n 4")
    n = cluster.n if n is None else int(n)
    if n < 1:
        raise ClusterError(f"a cluster needs at least 1 engine, got n={n}")
    if launchers.controller_exited(cluster._ipp):
        if not cluster.owned:
            raise ClusterError(
                f"the controller of cluster {cluster.id} has exited, and it was started elsewhere: "
                f"%distnn cluster stop, then start a cluster with  %distnn cluster start -n {n}"
            )
        teardown(cluster)
        cluster.n = n
        cluster.start()
        return f"the controller had exited; started the cluster again with {n} engines"
    dead = cluster.dead_engines()
    if not dead and not missing and n == cluster.n:
        return f"all {cluster.n} engines are alive"
    _restart_engines(cluster, n)
    said = [missing] if missing else []
    said += [f"rank {d.rank} (engine {d.engine_id}) was dead: {d.why}" for d in dead]
    return "; ".join(said + [f"restarted {n} engines"]) if said else f"restarted {n} engines"


def _restart_engines(cluster: Cluster, n: int) -> None:
    ipp_cluster = cluster._ipp
    old = frozenset(dict(cluster.client._engines).values()) | {i.uuid for i in cluster.info}
    stragglers = [i for i in cluster.info if not process_gone(i.host, i.pid)]
    for key in list(ipp_cluster.engines):
        unwatch(cluster, key)
        try:
            ipp_cluster.stop_engines_sync(key)
        except Exception:  # its mpiexec is gone already
            ipp_cluster.engines.pop(key, None)
    # Engines that did not go with their mpiexec (stopped with kill -STOP, orphaned).
    local = [psutil.Process(i.pid) for i in stragglers if not process_gone(i.host, i.pid)]
    watchdog.take_down(local, grace=1.0)
    deadline = time.monotonic() + UNREGISTER_SECONDS
    while old & set(dict(cluster.client._engines).values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    cluster.n, cluster.info, cluster.view = n, [], None
    cluster._health = Liveness(cluster._health.ping_seconds)
    if not cluster.owned:
        # An attached cluster's file does not keep how its engines were launched: the
        # new set starts with this environment's mpiexec (and no extra mpiexec arguments).
        ipp_cluster.update_config(
            launchers.launcher_config(
                cluster.engines, cluster.mpiexec, cluster.mpi_args, cluster.interface, cluster.slurm
            )
        )
    engine_set = ipp_cluster.start_engines_sync(n)
    watch(cluster, engine_set, ipp_cluster.engines[engine_set])
    map_ranks(cluster, wait_for_engines(cluster, cluster.client, exclude=old))


def check_alive(cluster: Cluster, engines: list[int] | None = None) -> None:
    """Raise a ClusterError naming the dead engines (see `Cluster.check_alive`)."""
    if not cluster.running:
        raise ClusterError("the cluster is not running: start it again with  %distnn cluster start")
    if launchers.controller_exited(cluster._ipp):
        raise ClusterError(f"the cluster's controller has exited; {HEAL_HINT}")
    dead = cluster.dead_engines(engines=engines)
    if dead:
        raise ClusterError(
            f"{len(dead)} of {cluster.n} engines {'is' if len(dead) == 1 else 'are'} dead: "
            + "; ".join(map(str, dead[:4]))
            + ("; ..." if len(dead) > 4 else "")
            + f"; {HEAL_HINT}"
        )


def status_text(cluster: Cluster, layout: Any = None) -> str:
    """Engines, ranks, hosts and whether each is alive, and the rank layout a run would use."""
    if not cluster.running:
        return "nbdist cluster: not running"
    lines = [
        f"nbdist cluster: {cluster.n} MPI engines ({cluster.engines}{'' if cluster.owned else ', attached'}), "
        f"cluster id {cluster.id}, profile {cluster._ipp.profile_dir}, controller on {cluster.ip}"
        + (" (CurveZMQ)" if cluster.encrypted else "")
    ]
    if launchers.controller_exited(cluster._ipp):
        return "\n".join(lines + [f"the controller has exited; {HEAL_HINT}"])
    dead = {d.engine_id: d for d in cluster.dead_engines()}
    lines.append(f"  {'rank':>4}  {'engine':>6}  {'host':<20} {'pid':<8} state")
    for i in cluster.info:
        if i.engine_id in dead:
            state = f"dead: {dead[i.engine_id].why}"
        else:
            state = "busy" if cluster._health.busy(cluster.client, i) else "alive"
        lines.append(f"  {i.rank:>4}  {i.engine_id:>6}  {i.host:<20} {i.pid:<8} {state}")
    if dead:
        ranks = sorted(d.rank for d in dead.values())
        lines.append(
            f"{len(dead)} of {cluster.n} engines dead (rank{'s' if len(ranks) > 1 else ''} "
            f"{', '.join(map(str, ranks))}): {HEAL_HINT}"
        )
        return "\n".join(lines)
    if layout is None:
        from nbdist.layout import Layout

        layout = Layout.for_world(cluster.n)
    lines.append("layout of a master-worker run on all engines:")
    lines.append(layout.tree())
    return "\n".join(lines)
