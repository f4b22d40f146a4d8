"""Which rank does what: roles and sub-communicators from (N_G, N_F, N_M, N_W, N_P).

One training run or HPO study occupies

    N_ranks = [1] + N_G x N_F x (N_M + N_M x N_W x N_P)      (master-worker)
    N_ranks = [1] + N_G x N_F x N_W x N_P                     (allreduce)

ranks: an optional coordinator, then group by group and fold by fold; inside a fold
master 0, its workers, master 1, its workers, ... (allreduce: the workers), each worker's
processes contiguous. Keeping every unit contiguous makes the rank ranges in a tree, a
log line or a `mpiexec --map-by` hint easy to read, and puts the processes of one worker
next to each other, where a block mapping places them on the same node.

Nothing else in nbdist computes "which rank am I": topologies, the training loop and the
dashboard all ask a `Layout`. mpi4py is imported only by `Layout.split`, so layouts can be
built, checked and printed in a notebook kernel that has no MPI.

The modules: core.py (Layout), roles.py (Role), tree.py (the tree as data and as text),
communicators.py (the MPI sub-communicators).
"""

from __future__ import annotations

from nbdist.layout.communicators import Communicators
from nbdist.layout.core import TOPOLOGIES as TOPOLOGIES
from nbdist.layout.core import Layout
from nbdist.layout.roles import LayoutError, Role
from nbdist.layout.tree import ranks_text as ranks_text

__all__ = ["Layout", "Role", "LayoutError", "Communicators"]
