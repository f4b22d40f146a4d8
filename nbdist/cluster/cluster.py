"""The `Cluster` class: a notebook's handle on ipyparallel engines that are the ranks of one
MPI job, and the whole of its public surface.

    with nbdist.Cluster(n=4) as cluster:      # or cluster = Cluster(n=4).start()
        job = nbdist.train(build_model, cluster=cluster, topology="allreduce")

The class holds the cluster's settings and state; what it does at length lives beside
it, as functions of the cluster: starting and attaching (`startup`), ipyparallel's
launcher settings and the state of its processes (`launchers`), health and healing
(`health`), and stopping (`stopping`). Its methods say what each does for the user.
"""

from __future__ import annotations

import concurrent.futures
import ipaddress
import signal
from typing import Any

from nbdist.cluster import health, launchers, startup
from nbdist.cluster.current import forget, make_current
from nbdist.cluster.errors import ClusterError
from nbdist.cluster.launchers import ENGINE_KINDS, QUEUE_POLL_SECONDS
from nbdist.cluster.startup import EngineInfo
from nbdist.cluster.stopping import teardown
from nbdist.liveness import DeadEngine, Liveness
from nbdist.transport.interfaces import interface_address

__all__ = ["Cluster"]

LOOPBACK = "127.0.0.1"
SIGNAL_SECONDS = 5.0


class Cluster:
    """Start, use and stop ipyparallel MPI engines; also a context manager.

    The engines are the ranks of one MPI job: `nbdist.train(..., cluster=...)`,
    `nbdist.study(..., cluster=...)` and the `%%distnn` magics run on them. The controller
    listens on 127.0.0.1: engines on this host and the notebook reach it, other hosts do
    not. For engines on several nodes, `interface="ib0"` (the address of that interface)
    or `ip="10.1.2.3"` say where it listens and where engines connect (then with
    CurveZMQ encryption). A kernel that dies takes the controller and engines with it.

    Args:
        n: The number of engines, i.e. MPI ranks.
        engines: `"mpi"` (the `mpiexec` beside this Python, or inside a SLURM allocation)
            or `"slurm"` (the engines submitted as a SLURM job, `mpiexec` inside it).
        mpiexec: The `mpiexec` to start the engines with (default: this environment's).
        mpi_args: More `mpiexec` arguments, e.g. `["--hostfile", "hosts"]`.
        start_timeout: Seconds to wait for every engine to register (a SLURM job's wait
            in the queue included).
        cluster_id: ipyparallel's id for the cluster, so that another notebook can
            attach to it (`Cluster.attach(cluster_id)`).
        profile: The IPython profile the cluster's files go to.
        interface: The network interface the controller listens on, for engines on
            other nodes (e.g. `"ib0"`).
        ip: The address the controller listens on, instead of `interface`.
        partition: With `engines="slurm"`: the partition (`sbatch --partition`).
        time: With `engines="slurm"`: the time limit, e.g. `"01:00:00"`.
        account: With `engines="slurm"`: the account to charge.
        nodes: With `engines="slurm"`: the nodes the engines spread over.
        **ipp_options: Passed on to `ipyparallel.Cluster`.

    Raises:
        ClusterError: A bad argument (no engines, an unknown launcher, SLURM settings
            without `engines="slurm"`, both `interface` and `ip`); `start()` raises it too
            when the engines do not come up, with the reason.

    Example:
        In a notebook or a script (the `notebook` extra installed)::

            import nbdist

            def build_model():  # runs on every engine: what it needs, it imports there
                from torch import nn

                return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))

            with nbdist.Cluster(n=2) as cluster:      # started here, stopped at the end
                print(cluster.status())
                job = nbdist.train(build_model, cluster=cluster, topology="allreduce", epochs=2)
                print(job.wait().result.final)
    """

    def __init__(
        self,
        n: int = 4,
        *,
        engines: str = "mpi",
        mpiexec: str | None = None,
        mpi_args: list[str] | tuple[str, ...] = (),
        start_timeout: float = 120.0,
        cluster_id: str | None = None,
        profile: str | None = None,
        interface: str | None = None,
        ip: str | None = None,
        partition: str | None = None,
        time: str | None = None,
        account: str | None = None,
        nodes: int | None = None,
        **ipp_options: Any,
    ):
        if int(n) < 1:
            raise ClusterError(f"a cluster needs at least 1 engine, got n={n}")
        if engines not in ENGINE_KINDS:
            raise ClusterError(f"unknown engine launcher {engines!r}; choose one of: {', '.join(ENGINE_KINDS)}")
        if interface and ip:
            raise ClusterError("give the controller's network interface or its ip address, not both")
        self.slurm: dict[str, Any] = {"partition": partition, "time": time, "account": account, "nodes": nodes}
        if engines != "slurm" and any(self.slurm.values()):
            given = ", ".join(k for k, v in self.slurm.items() if v)
            raise ClusterError(f"{given} belong to engines submitted to SLURM: add --slurm (engines='slurm')")
        self.n = int(n)
        self.engines = engines
        self.mpiexec = mpiexec
        self.mpi_args = list(mpi_args)
        self.start_timeout = float(start_timeout)
        self.cluster_id = cluster_id
        self.profile = profile
        self.interface = interface
        self.ip = ip or (interface_address(interface, ClusterError) if interface else LOOPBACK)
        self.ipp_options = ipp_options
        self._ipp: Any = None
        self.owned = True  # started here; an attached cluster's engines belong to whoever started them
        self.client: Any = None
        self.view: Any = None  # a DirectView on every engine, in rank order
        self.info: list[EngineInfo] = []
        self._health = Liveness()
        self._watchdogs: dict[str, Any] = {}  # what it watches ("controller", an engine set id) -> its Popen
        self._jobs_asked: tuple[float, dict[str, Any]] = (-QUEUE_POLL_SECONDS, {})  # engines=slurm: when, what

    # -- life cycle ---------------------------------------------------------------------
    @property
    def encrypted(self) -> bool:
        """Whether the controller's connections use CurveZMQ: whenever it listens beyond loopback."""
        try:
            return not ipaddress.ip_address(self.ip).is_loopback
        except ValueError:  # a host name
            return self.ip != "localhost"

    @property
    def running(self) -> bool:
        return self.client is not None

    def start(self) -> Cluster:
        """Start the controller and the engines and wait until every engine has registered;
        on a running cluster with dead engines, replace them (heal).

        Returns:
            The cluster itself, started.

        Raises:
            ClusterError: ipyparallel or mpi4py is missing, or the engines did not come up
                within `start_timeout` (SLURM's refusal or the engines' output says why).
        """
        if self.running:
            if self.broken():
                print(f"nbdist: {self.heal()}", flush=True)
            return self
        startup.start(self)
        make_current(self)
        return self

    @classmethod
    def attach(cls, cluster_id: str = "", profile: str | None = None) -> Cluster:
        """Use MPI engines started elsewhere: `ipcluster start --engines=mpi -n 8`, another
        notebook, or JupyterHub's cluster panel. stop() then only disconnects. Dead engines
        are replaced by a new engine set started from here with this environment's mpiexec
        (it is recorded in the cluster's file, so its owner stops it with the rest)."""
        return startup.attach(cls, cluster_id, profile)

    def _on_registration_event(self, event: dict[str, Any]) -> None:
        # Looked up at each event: a heal or a stop replaces the health record.
        self._health.on_registration_event(event)

    def heal(self, n: int | None = None, *, missing: str = "") -> str:
        """Replace dead engines, and say what happened in one line. An MPI engine set is one
        mpiexec job whose survivors cannot take a new rank in: the set is stopped and a new
        one of `n` engines (default: as many as before) starts on the same controller. A
        controller that is gone takes a new start of the whole cluster (ours only)."""
        return health.heal(self, n, missing=missing)

    def stop(self) -> None:
        """Stop the engines and the controller (an attached cluster: disconnect only)."""
        teardown(self)
        forget(self)

    def __enter__(self) -> Cluster:
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
        (through each engine's nanny, which signals it even while it runs a task). Dead
        engines are left out; so is mpiexec once one of its ranks is dead."""
        if self._ipp is None:
            raise ClusterError("the cluster is not running")
        dead = {d.engine_id for d in self.dead_engines(ping=False)}
        if engines is None and not dead:
            self._ipp.signal_engines_sync(signum)
            return
        targets = [e for e in (engines if engines is not None else [i.engine_id for i in self.info]) if e not in dead]
        if targets:
            sent = self.client.send_signal(signum, targets=targets, block=False)
            # A nanny that does not answer must not hold the caller.
            concurrent.futures.wait([sent], timeout=SIGNAL_SECONDS)

    def dead_engines(self, *, ping: bool = True, engines: list[int] | None = None) -> list[DeadEngine]:
        """The dead engines (all, or those of `engines`), the first to die first. With
        `ping`, idle engines are pinged: those silent for PING_SECONDS count as dead."""
        if not self.running:
            return []
        chosen = [i for i in self.info if engines is None or i.engine_id in engines]
        return self._health.dead(self.client, chosen, ping=ping)

    def mark_stuck(self, engines: list[int], why: str) -> None:
        """A job gave up on these engines: they count as dead until the cluster is healed."""
        self._health.mark_stuck([i for i in self.info if i.engine_id in engines], why)

    def broken(self) -> bool:
        """The controller has exited or an engine is dead: heal() (or start()) replaces them."""
        return launchers.controller_exited(self._ipp) or bool(self.dead_engines())

    def check_alive(self, engines: list[int] | None = None) -> None:
        """Fail at once, naming the dead engines and saying how to heal, unless every
        engine (or every one of `engines`) is alive. Jobs and studies call it first."""
        health.check_alive(self, engines)

    @property
    def id(self) -> str:
        return self._ipp.cluster_id if self._ipp is not None else (self.cluster_id or "")

    def status(self, layout: Any = None) -> str:
        """Engines, ranks, hosts and whether each is alive, and the rank layout a run would use."""
        return health.status_text(self, layout)

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<nbdist.Cluster {self.id} {self.n} {self.engines} engines, {state}>"
