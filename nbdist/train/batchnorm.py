"""--sync-batchnorm: which ranks share a batch, and the model's BatchNorm layers reducing
their statistics over them (backends/torch_batchnorm.py; the sums: transport/batch_sums.py).

The ranks that take one step from one batch between them share it: every rank of an
allreduce run, the processes of one master/worker worker (--procs-per-worker > 1). A
master/worker worker of one process already normalises over its whole batch, and
different workers train apart, so there is nothing to synchronise: the run says so.
"""

from __future__ import annotations

from typing import Any

from nbdist.backends import Backend
from nbdist.layout import Layout
from nbdist.options import TrainOptions
from nbdist.train.asynchrony import Notice
from nbdist.transport.batch_sums import SumOverRanks

__all__ = ["convert_for_sync", "synchronise_batchnorm"]


def shares_batches(layout: Layout) -> bool:
    """Whether the ranks of a worker, or of the run, take one step from one batch."""
    return layout.masters == 0 or layout.procs_per_worker > 1


def convert_for_sync(options: TrainOptions, layout: Layout, backend: Backend) -> list[Notice]:
    """Set-up, on every rank: the model's BatchNorm layers made synchronisable (one error
    where the framework cannot), and what the run leader tells the user."""
    if not options.sync_batchnorm:
        return []
    layers = backend.convert_batchnorm()
    if layers == 0:
        return [
            Notice(
                "--sync-batchnorm: the model has no BatchNorm layer (torch.nn.BatchNorm1d/2d/3d): "
                "nothing to synchronise",
                warning=True,
            )
        ]
    if not shares_batches(layout):
        return [
            Notice(
                f"--sync-batchnorm: each worker is one process, whose {layers} BatchNorm layer(s) already "
                f"normalise over its whole batch, and workers train apart: nothing to synchronise (it acts "
                f"over a worker's processes with --procs-per-worker > 1, or over --topology allreduce)",
                warning=True,
            )
        ]
    return []


def synchronise_batchnorm(ctx: Any, comm: Any) -> bool:
    """The model's BatchNorm layers reduce their statistics over `comm` (the ranks that
    share each batch) from now on, when --sync-batchnorm asks; whether they do."""
    if not ctx.options.sync_batchnorm:
        return False
    ctx.backend.reduce_batchnorm_over(SumOverRanks(comm, ctx.peers.collectives, ctx.backend.copier))
    return True
