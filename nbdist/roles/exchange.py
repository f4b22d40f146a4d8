"""PBT's exploit step on the ranks: a group copies another group's training state.

Before a segment, the group that trains the source trial sends each rank's share of it
(weights, optimiser state, the rule's state: what that rank's checkpoint holds) to the
rank in the same place of each receiving group, over MPI as flat buffers
(transport/study_channel.py). The share comes from memory: a rank keeps the shares it
wrote at its last checkpoint (`Kept`), which is the state the run ended with; only a
study resumed after a kill, whose ranks kept nothing, reads it from the source run's own
last checkpoint.

A receiving rank keeps its own RNG state and scalars (its position, its history) and
takes the rest; the fold's ranks then commit it as their run's checkpoint
`exploit-<epoch>`, so that the segment resumes from it and a study killed after the copy
resumes from it too. Only then does each receiving rank tell its source rank, which
waits for that word before it trains on: until every copy is committed, the source's
last checkpoint is still the state that was copied.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nbdist.hpo.trial import Segment, exploit_label
from nbdist.layout import Communicators, Layout
from nbdist.train.checkpoint import CheckpointError, Checkpoints
from nbdist.transport.collectives import Collectives
from nbdist.transport.study_channel import acknowledge, await_acknowledgement, receive_state, send_state
from nbdist.transport.waiting import wait_all

__all__ = ["Kept", "exchange", "send_shares", "receive_share", "exploit_label"]

# What a receiver takes from the source's share; it keeps its own RNG ('rng').
TAKEN = ("model", "opt", "rule", "own")


@dataclass
class Kept:
    """This rank's share of the last checkpoint its trial wrote (a study's `keep` hook)."""

    number: int | None = None
    label: str | None = None
    arrays: dict[str, dict[str, np.ndarray]] | None = None
    meta: dict[str, Any] | None = None

    def keeper(self, number: int):
        def keep(label: str, arrays: dict, meta: dict) -> None:
            self.number, self.label, self.arrays, self.meta = number, label, arrays, dict(meta)

        return keep

    def share(self, number: int, run_dir: Path, rank: int) -> tuple[dict, dict, str]:
        """(arrays, scalars, label) of trial `number`'s last checkpoint on this rank: from
        memory when this rank wrote it, else from the run's files."""
        latest = Checkpoints(run_dir).latest()
        if latest is None:
            raise CheckpointError(f"{run_dir} has no checkpoint to copy a training state from")
        if self.number == number and self.label == latest.name and self.arrays is not None:
            return self.arrays, dict(self.meta or {}), latest.name
        arrays, meta = Checkpoints.read_rank(latest, rank)
        return arrays, meta, latest.name


def _peer(layout: Layout, group: int, fold: int, index: int) -> int:
    """The world rank in place `index` of fold `fold` of group `group`."""
    return layout.fold_ranks(group, fold)[index]


def send_shares(
    world: Any,
    comms: Communicators,
    layout: Layout,
    kept: Kept,
    number: int,
    run_dir: Path,
    receivers: list[int],
    epoch: int,
    timeout: float,
) -> None:
    """This rank's share of trial `number` to its place in each receiving group; returns
    once each has committed it."""
    index, (_, fold) = comms.run.Get_rank(), comms.role.run
    arrays, _, label = kept.share(number, run_dir, index)
    info = {"trial": number, "epoch": epoch, "label": label}
    shared = {group: arrays.get(group, {}) for group in TAKEN}
    dests = [_peer(layout, group, fold, index) for group in receivers]
    requests = [r for dest in dests for r in send_state(world, dest, shared, info)]
    wait_all(requests, timeout=timeout)
    for dest in dests:
        await_acknowledgement(world, dest, timeout)


def receive_share(
    world: Any,
    comms: Communicators,
    layout: Layout,
    collectives: Collectives,
    kept: Kept,
    number: int,
    run_dir: Path,
    source: tuple[int, int],
    epoch: int,
    timeout: float,
) -> dict[str, Any]:
    """Take the source group's share into this run's checkpoint `exploit-<epoch>`
    (collective over the fold); returns what was copied, for the run's records."""
    index, (_, fold) = comms.run.Get_rank(), comms.role.run
    source_group, source_trial = source
    origin = _peer(layout, source_group, fold, index)
    arrays, info = receive_state(world, origin, timeout)
    label = exploit_label(epoch)
    checkpoints = Checkpoints(run_dir)
    latest = checkpoints.latest()
    if latest is None:  # a receiver has trained a segment: its run has a checkpoint on every rank
        raise RuntimeError(f"trial {number} has no checkpoint in {run_dir} to take trial {source_trial}'s state into")
    done = latest.name == label  # copied before a kill: kept as it was
    if not done:
        own, scalars, _ = kept.share(number, run_dir, index)
        share = {**{g: own.get(g, {}) for g in own if g not in TAKEN}, **arrays}
        checkpoints.write_rank(label, index, share, {**scalars, "exploit": {"trial": source_trial, "epoch": epoch}})
        collectives.barrier(comms.run, f"the copy of trial {source_trial}'s state")
        if index == 0:
            meta = {k: v for k, v in Checkpoints.read_meta(latest).items() if k not in ("sequence", "files")}
            checkpoints.commit(
                label, {**meta, "label": label, "time": time.time(), "exploit": {"trial": source_trial, "epoch": epoch}}
            )
    collectives.barrier(comms.run, f"the commit of trial {source_trial}'s state")
    acknowledge(world, origin, info, timeout)
    sizes = sum(int(a.nbytes) for named in arrays.values() for a in named.values())
    return {"source": source_trial, "epoch": epoch, "label": info.get("label"), "bytes": sizes, "copied": not done}


def exchange(
    world: Any,
    comms: Communicators,
    layout: Layout,
    collectives: Collectives,
    kept: Kept,
    number: int,
    runs_dir: str | Path,
    segment: Segment,
    timeout: float,
) -> dict[str, Any] | None:
    """PBT's copies before `segment` of trial `number`: its state to the groups that take
    it, or the state it takes into its run's checkpoint. Every rank of the group calls it."""
    if segment.exchange_epoch is None:
        return None
    run_dir = Path(runs_dir) / segment.runs[comms.role.run[1]]
    if segment.send_to:
        send_shares(world, comms, layout, kept, number, run_dir, segment.send_to, segment.exchange_epoch, timeout)
    if segment.receive_from is not None:
        return receive_share(
            world,
            comms,
            layout,
            collectives,
            kept,
            number,
            run_dir,
            segment.receive_from,
            segment.exchange_epoch,
            timeout,
        )
    return None
