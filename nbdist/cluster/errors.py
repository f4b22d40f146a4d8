"""The cluster's error and the one hint its messages share.

Every module of the package raises `ClusterError` and ends a dead engine's message with
`HEAL_HINT`; `job.py` quotes the hint too. They sit apart so that each of those imports
them without importing the `Cluster` class and the modules it pulls in.
"""

from __future__ import annotations

from nbdist.errors import UserError

__all__ = ["ClusterError", "HEAL_HINT"]

HEAL_HINT = "heal the cluster with  %distnn cluster start  (in Python: cluster.heal()), which restarts its engines"


class ClusterError(UserError):
    """The cluster could not start, or is not in a state to run a job."""
