"""Every rank splits COMM_WORLD by a Layout and checks its communicators.

Usage: mpiexec -n N python tests/mpi_scripts/layout_split.py '{"workers": 2, "masters": 2}'

The expected members of each communicator are worked out here from the roles alone
(not from Layout.split), then compared with an allgather of world ranks over the real
communicator, which checks size, membership and rank order at once. Prints
"OK rank N ..." per rank; any failure aborts the whole job so that no rank hangs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np
from mpi4py import MPI
from rank_main import run_or_abort

from nbdist.layout import Layout, LayoutError

FIELDS = ("run", "group", "block", "masters", "worker", "leaders", "stage")


def expected_members(layout: Layout, rank: int) -> dict[str, list[int] | None]:
    """World ranks of each communicator of `rank`, in communicator-rank order."""
    me = layout.roles[rank]
    roles = layout.roles
    out: dict[str, list[int] | None] = dict.fromkeys(FIELDS)
    if me.kind == "coordinator":
        return out
    out["run"] = [r.rank for r in roles if (r.group, r.fold) == (me.group, me.fold)]
    out["group"] = [r.rank for r in roles if r.group == me.group]
    same_fold = [r for r in roles if (r.group, r.fold) == (me.group, me.fold)]
    if layout.topology == "master-worker":
        if me.kind == "master" or me.is_leader:
            boss = [r.rank for r in same_fold if r.kind == "master" and r.master == me.master]
            leaders = sorted((r.worker, r.rank) for r in same_fold if r.is_leader and r.master == me.master)
            out["block"] = boss + [rank for _, rank in leaders]
        if me.kind == "master":
            out["masters"] = [
                r.rank for r in sorted((r for r in same_fold if r.kind == "master"), key=lambda r: r.master)
            ]
    elif me.is_leader:
        out["leaders"] = [r.rank for r in sorted((r for r in same_fold if r.is_leader), key=lambda r: r.worker)]
    if layout.topology == "allreduce" and layout.procs_per_worker > 1 and me.kind == "worker":
        out["stage"] = [r.rank for r in sorted((r for r in same_fold if r.proc == me.proc), key=lambda r: r.worker)]
    if me.kind == "worker":
        out["worker"] = [
            r.rank
            for r in sorted(
                (r for r in same_fold if r.master == me.master and r.worker == me.worker), key=lambda r: r.proc
            )
        ]
    return out


def main() -> None:
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    options = json.loads(sys.argv[1])
    layout = Layout.for_world(size, **options)
    assert layout.n_ranks == size

    # A layout of the wrong size must fail on every rank alike, before any Split.
    wrong = Layout(**{**options, "workers": layout.workers + 1})
    try:
        wrong.split(world)
    except LayoutError as exc:
        assert f"needs {wrong.n_ranks} ranks" in str(exc), exc
    else:
        raise AssertionError("split accepted a communicator of the wrong size")

    comms = layout.split(world)
    assert comms.world is world
    assert comms.role == layout.role(rank)
    sizes = []
    for name, members in expected_members(layout, rank).items():
        comm = getattr(comms, name)
        if members is None:
            assert comm == MPI.COMM_NULL, f"{name} should be COMM_NULL on rank {rank}"
            continue
        assert comm != MPI.COMM_NULL, f"{name} is COMM_NULL on rank {rank}"
        got = comm.allgather(rank)
        assert got == members, f"{name}: members {got}, expected {members}"
        assert comm.Get_rank() == members.index(rank)
        sizes.append(f"{name}={comm.Get_size()}")

    # The hot path uses buffer collectives: sum the world ranks over the block.
    if comms.block != MPI.COMM_NULL:
        total = np.zeros(1, dtype=np.int64)
        comms.block.Allreduce(np.array([rank], dtype=np.int64), total, op=MPI.SUM)
        block = expected_members(layout, rank)["block"]
        assert total[0] == sum(block), (total[0], block)
        assert comms.block.Get_rank() == (0 if comms.role.kind == "master" else comms.role.worker + 1)

    with comms:
        pass
    for name in FIELDS:
        assert getattr(comms, name) == MPI.COMM_NULL, f"{name} not freed"
    comms.free()  # a second free is harmless

    world.Barrier()
    print(f"OK rank {rank} {comms.role.kind} {' '.join(sizes)}", flush=True)


if __name__ == "__main__":
    run_or_abort(main)
