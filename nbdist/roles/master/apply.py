"""Folding updates into the centre with the rule: each asynchronous update as its own
version, a synchronous round as one (its bodies streamed in), sub-masters' pushes
merged with their `merge` rule."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

from nbdist.algorithms.base import Update
from nbdist.errors import TrainingError
from nbdist.roles.master.clients import WORKER
from nbdist.roles.master.epochs import tally_of
from nbdist.roles.master.receive import round_updates
from nbdist.roles.master.replies import settle_centre
from nbdist.transport import messages as m

if TYPE_CHECKING:
    from nbdist.roles.master.state import Master

__all__ = ["apply_updates"]


def apply_updates(me: Master, updates: list[tuple[int, Update]]) -> list[tuple[int, np.ndarray]]:
    """Fold the updates into the centre, a synchronous round as one version and each
    asynchronous update as its own; returns (client, array to reply) pairs."""
    ctx = me.ctx
    groups = [updates] if ctx.options.synchronous else [[u] for u in updates]
    replies: list[tuple[int, np.ndarray]] = []
    for group in groups:
        if not group:
            continue
        settle_centre(me)  # counted as replying
        t0 = time.perf_counter()
        for _, u in group:
            u.staleness = me.version - u.version
        from_workers = [(i, u) for i, u in group if me.clients[i].merge is None]
        from_masters = [(i, u) for i, u in group if me.clients[i].merge is not None]
        start = me.centre.copy() if from_workers and from_masters else None
        waited = me.phases["wait"]  # a synchronous round receives its bodies as it goes
        if from_workers:
            me.lr.before_update(sum(u.samples for _, u in from_workers), max(u.staleness for _, u in from_workers))
            replies += _apply_rule(me, from_workers)
        if from_masters:
            _merge_masters(me, start, len(from_workers), from_masters)
            replies += [(i, me.centre) for i, _ in from_masters]
        me.version += 1
        me.phases["update"] += time.perf_counter() - t0 - (me.phases["wait"] - waited)
        for i, u in group:
            client = me.clients[i]
            epoch = int(client.inbox.header[m.EPOCH])
            tally_of(me, epoch).add_staleness(u.staleness)
            me.updates.add(client.world_rank, u.staleness, me.version)
            window = _next_window(me, i, u) if me.windows is not None and client.kind == WORKER else None
            if ctx.options.trace_updates:
                who = {"worker": client.index} if client.kind == WORKER else {"sub_master": client.index}
                ctx.log.emit(
                    "update",
                    {
                        **who,
                        "source_rank": client.world_rank,
                        "staleness": u.staleness,
                        "version": me.version,
                        "samples": u.samples,
                        **({"window": window} if window is not None else {}),
                        "traced": True,
                    },
                    step=me.version,
                    epoch=epoch,
                )
    return replies


def _next_window(me: Master, i: int, u: Update) -> int:
    """Dynamic local steps: time worker i's window that this update ended, and name its
    next one (its reply carries it: replies.reply)."""
    windows = me.windows
    assert windows is not None
    windows.arrived(i, u.samples, me.clients[i].silence.last)
    return windows.name(i, (j for j in me.active if me.clients[j].kind == WORKER))


def _apply_rule(me: Master, updates: list[tuple[int, Update]]) -> list[tuple[int, np.ndarray]]:
    """The rule on the workers' updates: master_apply, or, for a synchronous round,
    master_round with the bodies streamed in; (client, array to reply) pairs."""
    ctx = me.ctx
    if not ctx.options.synchronous:
        payloads = ctx.rule.master_apply(me.rule_state, me.centre, [u for _, u in updates], me.opt)
        return [(i, payload) for (i, _), payload in zip(updates, payloads, strict=True)]
    stream = round_updates(me, updates)
    payload = ctx.rule.master_round(
        me.rule_state, me.centre, stream, [u.samples for _, u in updates], me.opt, me.round_buffer
    )
    if next(stream, None) is not None:
        raise TrainingError(f"internal: {ctx.rule.name}'s master_round left updates of the round undrawn")
    return [(i, payload) for i, _ in updates]


def _merge_masters(me: Master, start: np.ndarray | None, own_workers: int, pushes: list[tuple[int, Update]]) -> None:
    """Merge sub-masters' pushes (hierarchy.py) into the centre with their `merge` rule.
    In a synchronous round this master's own workers moved the centre from `start`
    too: that step is merged with the pushes as one master's among the others."""
    steps = [Update(u.payload, u.staleness, me.clients[i].weight, u.version) for i, u in pushes]
    if start is not None:
        steps.insert(0, Update(me.centre - start, 0, own_workers))
        me.centre[:] = start
    me.clients[pushes[0][0]].merge(me.centre, steps)
