"""The peers a master serves: its workers' leaders and, at a top master, the sub-masters."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nbdist.algorithms.base import Update
from nbdist.train.context import RankContext
from nbdist.transport import messages as m
from nbdist.transport.compression import Codec, make_codec
from nbdist.transport.deadlines import Silence

__all__ = ["WORKER", "SUB_MASTER", "Client", "worker_clients"]

WORKER, SUB_MASTER = "worker", "sub-master"


@dataclass(slots=True)
class Client:
    """One peer a master serves, with the header its posted receive fills: a worker's
    leader (peer w + 1 on `block`) or, at the top master, a sub-master (peer j on
    `masters`). Workers' updates go through the algorithm's `master_apply`; a client with
    a `merge` function has its payload merged into the centre by that instead."""

    comm: Any
    peer: int
    kind: str  # WORKER or SUB_MASTER
    world_rank: int
    inbox: m.Message = field(default_factory=m.Message)  # the header alone
    merge: Callable[[np.ndarray, Sequence[Update]], None] | None = None  # Algorithm.merge_master_steps
    weight: int = 1  # workers whose model state (BatchNorm statistics) its messages carry
    silence: Silence = field(default_factory=Silence)
    body: m.Body | None = None  # the pooled body of the update being served
    codec: Codec | None = None  # how a worker's payload is encoded (--compression)

    @property
    def index(self) -> int:
        """A worker's index under its master, a sub-master's among the masters."""
        return self.peer - 1 if self.kind == WORKER else self.peer

    def describe(self, ctx: RankContext | None = None) -> str:
        if ctx is not None:
            return ctx.peers.directory.describe(self.world_rank)
        return f"{self.kind} {self.index} (rank {self.world_rank})"


def worker_clients(ctx: RankContext) -> list[Client]:
    block = ctx.comms.block
    ranks = _leader_world_ranks(ctx, block.Get_size() - 1)
    # Decoding keeps no state: the workers share one codec.
    codec = (
        make_codec(ctx.compression, ctx.backend.num_params, ctx.backend.param_blocks())
        if ctx.compression is not None
        else None
    )
    return [
        Client(block, i + 1, WORKER, rank, silence=Silence(ctx.options.peer_timeout), codec=codec)
        for i, rank in enumerate(ranks)
    ]


def _leader_world_ranks(ctx: RankContext, workers: int) -> list[int]:
    ranks = ctx.layout.fold_ranks(*ctx.role.run)
    roles = [ctx.layout.role(r) for r in ranks]
    return [r.rank for r in roles if r.kind == "worker" and r.master == ctx.role.master and r.proc == 0][:workers]
