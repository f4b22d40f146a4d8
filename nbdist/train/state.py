"""One rank's share of a checkpoint: weights, optimiser, rule state, RNG, position."""

from __future__ import annotations

from copy import deepcopy
from pathlib import Path
from typing import Any

import numpy as np

from nbdist.algorithms.arrays import copy_into, host_copy, to_numpy
from nbdist.algorithms.base import RuleState
from nbdist.backends.base import FlatOptimizer
from nbdist.train.checkpoint import CheckpointError, other_model
from nbdist.train.writer import CheckpointWriter

__all__ = ["save_rank_state", "rank_state_arrays", "write_rank_state", "load_rank_state"]

# What ranks that step the same optimiser on the same reduced gradient hold bit for bit.
# Not the model state: BatchNorm statistics come from each rank's own batches and are
# averaged only at validation. Nor the RNG, which differs per rank by design.
IDENTICAL_ON_TWINS = ("model/params", "opt", "rule")


def save_rank_state(
    ctx: Any,
    label: str,
    opt: FlatOptimizer | None,
    rule_state: RuleState | None,
    extra: dict[str, Any],
    own: dict[str, np.ndarray] | None = None,
    same_as: int | None = None,
    writer: CheckpointWriter | None = None,
) -> None:
    """`own`: arrays only this kind of rank has (a sub-master's last pulled centre).
    `same_as`: the world rank that holds this rank's weights, optimiser and rule state
    bit for bit (an allreduce run's rank 0, a worker's leader process); this rank then
    writes only the rest and reads those from that rank's file (passing its own rank is
    the same as None). `writer`: write on its thread, from copies taken now (the share is
    written once the writer says `label`), instead of before returning."""
    arrays = rank_state_arrays(ctx, opt, rule_state, own, copy=writer is not None)
    write_rank_state(ctx, label, arrays, extra, same_as, writer)


def rank_state_arrays(
    ctx: Any,
    opt: FlatOptimizer | None,
    rule_state: RuleState | None,
    own: dict[str, np.ndarray] | None = None,
    copy: bool = True,
) -> dict[str, dict[str, np.ndarray]]:
    """What this rank's share of a checkpoint holds, as it is now: with `copy`, arrays of
    their own (the weights and optimiser state move on with the next update), each made
    with one copy: a large model's checkpoint costs the training loop that much."""
    backend = ctx.backend
    model = {"params": backend.params, "state": backend.state}
    # With copy, one copy of each buffer; without, views of host memory (a device's buffers come over).
    arrays = {
        "model": {name: host_copy(value) if copy else to_numpy(value) for name, value in model.items()},
        "opt": opt.state_arrays() if opt is not None else {},  # copies already (FlatOptimizer)
        "rule": rule_state.to_arrays() if rule_state is not None else {},
        "rng": backend.rng_state(),
        "own": own or {},
    }
    if not copy:
        return arrays
    kept = ("model", "opt")
    return {
        group: named if group in kept else {name: np.array(value, copy=True) for name, value in named.items()}
        for group, named in arrays.items()
    }


def write_rank_state(
    ctx: Any,
    label: str,
    arrays: dict[str, dict[str, np.ndarray]],
    extra: dict[str, Any],
    same_as: int | None = None,
    writer: CheckpointWriter | None = None,
) -> None:
    """Write `arrays` (rank_state_arrays) and this rank's scalars `extra` as its share of
    `label`; on the writer's thread if given (then `arrays` must be copies)."""
    meta = {"rank": ctx.role.rank, "role": ctx.role.kind, **extra}
    rank = ctx.comms.world.Get_rank()
    if ctx.keep_state is not None:
        # A study's trial keeps its last state in memory too: PBT sends it to another group
        # over MPI when the run has ended (nbdist.roles.study), rather than through files.
        ctx.keep_state(label, arrays, meta)
    if writer is None:
        ctx.checkpoints.write_rank(label, rank, arrays, meta, same_as=same_as, shared=IDENTICAL_ON_TWINS)
        return
    meta = deepcopy(meta)
    writer.submit(
        lambda: ctx.checkpoints.write_rank(label, rank, arrays, meta, same_as=same_as, shared=IDENTICAL_ON_TWINS),
        name=label,
    )


def load_rank_state(
    ctx: Any,
    path: Path,
    opt: FlatOptimizer | None,
    rule_state: RuleState | None,
    own: dict[str, np.ndarray] | None = None,
) -> dict[str, Any]:
    """Restore this rank from checkpoint `path` (and the `own` arrays, in place); returns
    the rank's saved scalars. The share read is `ctx.resume_rank`'s: this rank's own, or
    on another layout the one its place maps to (train/relayout.py); with
    `ctx.resume_partial`, only what twins hold alike (weights, optimiser, rule state):
    the rank keeps its own RNG, and its `own` arrays as they are."""
    backend = ctx.backend
    if ctx.resume_rank is None:
        raise CheckpointError(f"checkpoint {path} has no state for rank {ctx.comms.world.Get_rank()}")
    arrays, meta = ctx.checkpoints.read_rank(path, ctx.resume_rank)
    model = arrays.get("model", {})
    if model.get("params") is None or model["params"].shape != (backend.num_params,):
        raise other_model(path, getattr(model.get("params"), "size", 0), ctx.role.rank, backend.num_params)
    copy_into(backend.params, model["params"])
    if "state" in model:
        copy_into(backend.state, model["state"])
    if opt is not None:
        opt.load_state_arrays(arrays.get("opt", {}))
    if rule_state is not None:
        rule_state.load_arrays(arrays.get("rule", {}))
    if ctx.resume_partial:
        return meta
    backend.set_rng_state(arrays.get("rng", {}))
    saved = arrays.get("own", {})
    for name, array in (own or {}).items():
        if name not in saved:
            raise CheckpointError(f"checkpoint {path} holds no {name!r} for rank {ctx.role.rank}")
        array[...] = saved[name]
    return meta
