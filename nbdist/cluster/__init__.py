"""A notebook's cluster: ipyparallel engines that are the ranks of one MPI job.

A package so that the cluster's code can be split into modules small enough to read at
once; `nbdist.cluster` keeps the names it had as a single module.
"""

from nbdist.cluster.cluster import (
    HEAL_HINT,
    Cluster,
    ClusterError,
    DeadEngine,
    EngineInfo,
    current_cluster,
    running_cluster,
)

__all__ = ["Cluster", "ClusterError", "DeadEngine", "EngineInfo", "current_cluster", "running_cluster", "HEAL_HINT"]
