"""Bringing a cluster's engines up: start them, or attach to those started elsewhere, and
wait until each has registered and is known by its MPI rank.

ipyparallel numbers engines in the order they register, which is not their ranks' order;
each engine is asked its rank (`EngineInfo`), and the cluster's view lists them by rank.
Every wait here has a deadline, and an error that quotes the engines' own output (or
sbatch's refusal) when they die at start. The functions take the `Cluster` whose state
they fill in; its `start()` and `attach()` call them.
"""

from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from nbdist.cluster import launchers
from nbdist.cluster.current import make_current
from nbdist.cluster.errors import ClusterError
from nbdist.cluster.stopping import teardown, watch

if TYPE_CHECKING:
    from nbdist.cluster.cluster import Cluster

__all__ = ["EngineInfo", "attach", "map_ranks", "start", "wait_for_engines"]

# How long attach() waits for engines that are not registered yet before calling them dead.
ATTACH_SETTLE_SECONDS = 5.0


@dataclass(frozen=True, slots=True)
class EngineInfo:
    engine_id: int
    rank: int
    size: int
    host: str
    pid: int
    uuid: str = ""  # the controller's name for this engine process (ids are reused after a restart)
    fault_tolerant: bool = False  # MPI fault tolerance on: the others live on when it dies


def start(cluster: Cluster) -> None:
    """Start the controller and the engines of a cluster that is not running, and wait
    until every engine has registered; on failure nothing is left running."""
    if importlib.util.find_spec("ipyparallel") is None:
        raise ClusterError("ipyparallel is not installed: pip install 'nbdist[notebook]'")
    if importlib.util.find_spec("mpi4py") is None:
        raise ClusterError(
            "mpi4py is not installed in this Python: the engines need it (pip install mpi4py, built against your MPI)"
        )
    import ipyparallel as ipp

    config = launchers.launcher_config(
        cluster.engines, cluster.mpiexec, cluster.mpi_args, cluster.interface, cluster.slurm
    )
    # The controller's address, on the command line so that a profile's config cannot
    # widen it: every socket it opens listens there, and the engines connect there.
    kwargs: dict[str, Any] = {
        "engines": cluster.engines,
        "n": cluster.n,
        "config": config,
        "log_level": 40,
        "controller_ip": cluster.ip,
        **cluster.ipp_options,
    }
    if cluster.encrypted:
        # Beyond loopback other hosts reach the controller: CurveZMQ encrypts and
        # authenticates every connection (engines and this client get its key through
        # their connection information; nothing without it is answered).
        kwargs["controller_args"] = [*kwargs.get("controller_args", []), "--IPController.enable_curve=True"]
    if cluster.cluster_id:
        kwargs["cluster_id"] = cluster.cluster_id
    if cluster.profile:
        kwargs["profile"] = cluster.profile
    cluster._ipp = ipp.Cluster(**kwargs)
    if cluster.engines == "slurm":
        # Beside the engines' log in the profile, not in the notebook's directory.
        cluster._ipp.config.SlurmEngineSetLauncher.batch_file_name = os.path.join(
            cluster._ipp.profile_dir, "log", f"nbdist-engines-{cluster._ipp.cluster_id}.sbatch"
        )
    try:
        cluster._ipp.start_controller_sync()
        watch(cluster, "controller", cluster._ipp.controller, remove=cluster._ipp.cluster_file)
        engine_set = cluster._ipp.start_engines_sync(cluster.n)
        watch(cluster, engine_set, cluster._ipp.engines[engine_set])
        client = cluster._ipp.connect_client_sync()
        client._registration_callbacks.append(cluster._on_registration_event)
        wait_for_engines(cluster, client)
    except (ClusterError, KeyboardInterrupt):  # an interrupt while waiting: nothing is left running
        teardown(cluster)
        raise
    except Exception as exc:  # ipyparallel's own failure: say it with the engines' output
        refused = launchers.sbatch_refusal(cluster, exc)
        if refused:
            teardown(cluster)
            raise ClusterError(f"SLURM refused the engines job: {refused}") from None
        output = launchers.engine_output(cluster._ipp)
        teardown(cluster)
        raise ClusterError(
            f"the cluster did not start: {type(exc).__name__}: {exc}"
            + (f"\nengine output:\n{output}" if output else "")
        ) from None
    cluster.client = client
    map_ranks(cluster, client.ids)


def attach(cls: type[Cluster], cluster_id: str = "", profile: str | None = None) -> Cluster:
    """A `cls` on the running cluster `cluster_id` of `profile`, its engines mapped; dead
    ones are replaced (see `Cluster.attach`)."""
    import ipyparallel as ipp

    try:
        ipp_cluster = ipp.Cluster.from_file(profile=profile, cluster_id=cluster_id, log_level=40)
    except FileNotFoundError:
        raise ClusterError(
            f"no running cluster with id {cluster_id!r} in profile {profile or 'default'} "
            f"(ipcluster list shows the running ones)"
        ) from None
    kinds = {type(s).__name__ for s in ipp_cluster.engines.values()}
    engines = "slurm" if any("Slurm" in k for k in kinds) else "mpi"
    n = sum(getattr(s, "n", 0) for s in ipp_cluster.engines.values())
    cluster = cls(n=max(n, 1), engines=engines, cluster_id=cluster_id or None, profile=profile)
    cluster._ipp, cluster.owned = ipp_cluster, False
    try:
        cluster.client = ipp_cluster.connect_client_sync()
        cluster.client._registration_callbacks.append(cluster._on_registration_event)
        missing = _settle(cluster, n)
    except Exception as exc:
        cluster.stop()
        if isinstance(exc, ClusterError):
            raise
        raise ClusterError(f"could not connect to cluster {cluster_id!r}: {type(exc).__name__}: {exc}") from None
    make_current(cluster)
    if missing or cluster.broken():
        if not ipp_cluster.engines:
            cluster.stop()
            raise ClusterError(
                f"cluster {cluster_id!r} has dead engines ({missing or 'see its status'}) that were not "
                f"started by ipyparallel's Cluster (mpiexec ipengine by hand?), so they cannot be restarted "
                f"from here: restart them where they were started, then attach again"
            )
        print(f"nbdist: {cluster.heal(missing=missing)}", flush=True)
    return cluster


def _settle(cluster: Cluster, n: int) -> str:
    """Map the registered engines of an attached cluster; '' or what is missing."""
    deadline = time.monotonic() + min(cluster.start_timeout, ATTACH_SETTLE_SECONDS)
    while len(cluster.client.ids) < n and time.monotonic() < deadline and not launchers.engines_exited(cluster):
        time.sleep(0.1)
    if not cluster.client.ids:
        return f"none of its {n} engines is registered"
    map_ranks(cluster, cluster.client.ids, size=n or None)
    ranks = sorted(set(range(cluster.info[0].size)) - {i.rank for i in cluster.info})
    if not ranks:
        return ""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} had no engine registered"


def wait_for_engines(cluster: Cluster, client: Any, exclude: frozenset[str] = frozenset()) -> list[int]:
    """The ids of `cluster.n` engines registered (none of the `exclude`d uuids), once they are."""
    deadline = time.monotonic() + cluster.start_timeout
    said = ""
    while True:
        ids = [eid for eid, uuid in dict(client._engines).items() if uuid not in exclude]
        if len(ids) >= cluster.n:
            return sorted(ids)
        if cluster.engines == "slurm":
            said = launchers.say_queue_progress(cluster, said, len(ids))
            if "waiting in the queue" in said:
                # The time to start counts from the allocation: a queue can take hours
                # (interrupting the kernel gives up and cancels the job).
                deadline = time.monotonic() + cluster.start_timeout
        if launchers.engines_exited(cluster):
            output = launchers.engine_output(cluster._ipp)
            raise ClusterError(
                f"the engines exited while starting ({len(ids)} of {cluster.n} registered)"
                + (f"; their output:\n{output}" if output else "; they printed nothing")
            )
        if time.monotonic() > deadline:
            output = launchers.engine_output(cluster._ipp)
            raise ClusterError(
                f"only {len(ids)} of {cluster.n} engines registered within "
                f"{cluster.start_timeout:.0f} s" + (f"; engine output:\n{output}" if output else "")
            )
        time.sleep(0.1)


def map_ranks(cluster: Cluster, ids: list[int], size: int | None = None) -> None:
    """Ask the engines `ids` their ranks; the cluster's info and view list them by rank."""
    from nbdist import engine

    view = cluster.client[list(ids)]
    replies = view.apply_sync(engine.describe_engine)
    uuids = dict(cluster.client._engines)
    infos = [
        EngineInfo(engine_id=eid, uuid=uuids.get(eid, ""), **reply)
        for eid, reply in zip(view.targets, replies, strict=True)
    ]
    sizes = {i.size for i in infos}
    if sizes != {size or len(infos)}:
        cluster.stop()
        raise ClusterError(
            f"the {len(infos)} engines are not one MPI job (they report world sizes "
            f"{sorted(sizes)}); was mpi4py built against a different MPI than mpiexec?"
        )
    cluster.info = sorted(infos, key=lambda i: i.rank)
    cluster.view = cluster.client[[i.engine_id for i in cluster.info]]
    cluster.view.apply_sync(engine.install_idle_stop_handler)
