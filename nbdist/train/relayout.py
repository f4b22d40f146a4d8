"""Resuming a checkpoint on ranks laid out otherwise than the ranks that wrote it.

Weights do not depend on the rank count: a checkpoint of 1 master + 2 workers resumes on
1 master + 4 workers, on 2 masters x (1 + 2 workers) or on 1 master + 1 worker, after
`--resume` with another `-n` or a restart on the ranks left (`--max-restarts`). Every
rank works out the same plan from the checkpoint's layout: which rank's share each rank
of the new layout loads (`plan_shares`), and one line for the user saying what changed
(`change_note`).

What carries over, and what does not:

- The run's state, always: the top master's centre, its optimiser and rule state, its
  lr position, the history, early stopping, the samples seen (allreduce: the replicas'
  weights and optimiser).
- Masters. Master m loads master m's share where the checkpoint has one. A sub-master it
  lacks starts from the top master's centre (its pulled copy the same), with a fresh
  master optimiser and the top master's version. A sub-master the new layout lacks is
  dropped, and with it what its workers did since its last push to the top master
  (nothing at a synchronous epoch's end, where every push has been merged).
- Workers of a master, counted in rank order over all masters: the k-th worker of the new
  layout loads the k-th worker's share where there is one (on a restart, a surviving
  process keeps its own share if it stays a worker): its own weights (EASGD's elastic
  variable, a local replica), optimiser, rule state, RNG and codec residuals. Workers
  beyond the checkpoint's start from their master's centre with fresh optimiser and rule
  state, as at a run's start; the state of workers the new layout lacks is dropped. Each
  worker starts at its master's version, so staleness restarts at 0. A worker process of
  a multi-process worker that the checkpoint lacks loads its leader's weights and
  optimiser and keeps its own RNG.
- Allreduce replicas hold the same weights and optimiser state: a replica beyond the
  checkpoint's loads replica 0's (weights, optimiser, BatchNorm statistics) and keeps its
  own RNG and no --compression residual; a replica the new layout lacks takes only those
  with it. A pipeline replica's stage s loads stage s of its own replica, or of replica 0.
- Data position: the shards are cut anew for the new number of workers, so every worker
  starts the checkpoint's epoch (a master's next epoch) from its first batch. A checkpoint
  taken within an epoch (a stop, an asynchronous snapshot) trains that epoch again whole,
  its open tallies dropped; the epoch counts once in the history.
- What must not change: the model, the topology and a pipeline's number of stages
  (--procs-per-worker with --worker-parallel pipeline).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nbdist.layout import Layout, LayoutError, ranks_text
from nbdist.train.checkpoint import CheckpointError, Checkpoints

__all__ = [
    "Share",
    "plan_shares",
    "change_note",
    "centre_share",
    "check_resumable",
    "saved_layout",
]


@dataclass(frozen=True, slots=True)
class Share:
    """What one rank of the new layout loads: the share of checkpoint rank `rank` (None:
    none, it starts from its master's centre), all of it or, `partial`, only what twins
    hold alike (weights, optimiser, rule state: not the RNG nor codec residuals)."""

    rank: int | None
    partial: bool = False


def saved_layout(path: Path) -> Layout | None:
    """The layout that wrote checkpoint `path` (None for a checkpoint too old to say)."""
    saved = Checkpoints.read_meta(path).get("layout")
    return Layout.from_dict(saved) if saved else None


def epochs_done(path: Path, old: Layout) -> int:
    """How many epochs checkpoint `path`, written by layout `old`, had trained: the epoch
    an allreduce run's first rank ended, or the epochs the top master's centre began."""
    if old.topology == "allreduce":
        return int(Checkpoints.read_scalars(path, 0).get("epoch", 0))
    return int(Checkpoints.read_scalars(path, centre_share(old, 0)).get("next_epoch", 0))


def _key(layout: Layout, rank: int) -> tuple[Any, ...]:
    """A role by its place: ("master", m), or ("worker", k, p) for process p of the k-th
    worker of the run counted in rank order over all masters."""
    role = layout.role(rank)
    if role.kind == "master":
        return ("master", role.master)
    return ("worker", (role.master or 0) * layout.workers + role.worker_index, role.proc)


def _pipeline(options: Any) -> bool:
    return getattr(options, "worker_parallel", None) == "pipeline"


def plan_shares(
    old: Layout, new: Layout, restart_world: tuple[list[int], list[int]] | None = None, pipeline: bool = False
) -> list[Share]:
    """The share each rank of `new` loads from a checkpoint written by `old`.

    `restart_world`: (the checkpoint's ranks, the new ranks) as COMM_WORLD ranks, for a
    restart on the ranks left: a process that keeps its kind of role keeps its own share.
    `pipeline`: the worker processes are pipeline stages, each a stage of its own."""
    if old.topology != new.topology:
        raise CheckpointError(
            f"the checkpoint was written by a {old.topology} run, this run is {new.topology}: "
            f"resume with --topology {old.topology}"
        )
    if pipeline and old.procs_per_worker != new.procs_per_worker:
        raise CheckpointError(
            f"the checkpoint's pipelines have {old.procs_per_worker} stages, this run's {new.procs_per_worker}: "
            f"resume with --procs-per-worker {old.procs_per_worker}"
        )
    by_key = {_key(old, r): r for r in range(old.n_ranks)}
    owns = [_own_by_process(old, new, rank, restart_world, pipeline) for rank in range(new.n_ranks)]
    claimed = {r for r in owns if r is not None}  # a survivor's own share is not given to another rank too
    plans = []
    for rank, own in enumerate(owns):
        key = _key(new, rank)
        if own is not None:
            plans.append(Share(own))
        elif key in by_key and by_key[key] not in claimed:
            plans.append(Share(by_key[key]))
        elif key[0] == "worker" and key[2] and not pipeline and ("worker", key[1], 0) in by_key:
            plans.append(Share(by_key[("worker", key[1], 0)], partial=True))  # a process its leader's
        elif key[0] == "worker" and new.topology == "allreduce":
            plans.append(Share(by_key[("worker", 0, key[2] if pipeline else 0)], partial=True))  # replica 0's
        else:
            plans.append(Share(None))
    return plans


def _own_by_process(
    old: Layout, new: Layout, rank: int, restart_world: tuple[list[int], list[int]] | None, pipeline: bool
) -> int | None:
    """On a restart, the share this very process wrote, if it keeps its kind of role
    (a master its master index, a pipeline stage its stage)."""
    if restart_world is None:
        return None
    old_world, new_world = restart_world
    me = new_world[rank]
    if me not in old_world:
        return None
    before, now = old.role(old_world.index(me)), new.role(rank)
    if before.kind != now.kind or before.kind == "master" or (pipeline and before.proc != now.proc):
        return None
    return old_world.index(me)


def centre_share(old: Layout, master: int | None) -> int:
    """The checkpoint rank that holds master `master`'s centre: that master's share, or
    the top master's where the checkpoint had no such master."""
    ranks = {old.role(r).master: r for r in range(old.n_ranks) if old.role(r).kind == "master"}
    if not ranks:
        raise CheckpointError("the checkpoint was written by an allreduce run: it has no master's centre")
    return ranks.get(master, ranks[0])


def check_resumable(path: Path) -> str | None:
    """What checkpoint `path` lacks for any resume, whatever the layout ("it holds no state
    for master 1 (rank 3)"), or None. Workers may lack a share (they had finished or were
    dropped: they start from the centre); the masters, or the replicas' first ranks that
    the others share their weights with, may not."""
    try:
        layout = saved_layout(path)
    except (CheckpointError, LayoutError, KeyError, TypeError) as exc:
        return f"its layout cannot be read ({exc})"
    if layout is None:
        return None
    if layout.topology == "allreduce":
        needed = [(r, f"replica 0, process {layout.role(r).proc}") for r in layout.fold_ranks(0, 0)]
        needed = needed[: layout.procs_per_worker]
    else:
        needed = [
            (r, "the top master" if role.master == 0 else f"sub-master {role.master}")
            for r in range(layout.n_ranks)
            if (role := layout.role(r)).kind == "master"
        ]
    for rank, who in needed:
        if not Checkpoints.has_rank(path, rank):
            return f"it holds no state for {who} (rank {rank})"
    return None


def change_note(old: Layout, new: Layout, plans: list[Share], epoch: int | None, restart: bool) -> str:
    """One line on what resuming `old`'s checkpoint on `new` changed:
    which ranks start from a centre or a replica's weights, whose state is dropped, and
    where the data starts."""
    what = "restarting from" if restart else "resuming"
    parts = []
    fresh = [r for r, p in enumerate(plans) if p.rank is None and new.role(r).kind == "worker"]
    if fresh:
        parts.append(f"the workers on {ranks_text(fresh)} start from their master's centre")
    borrowed = [r for r, p in enumerate(plans) if p.partial]
    if borrowed:
        source = "replica 0's" if new.topology == "allreduce" else "their worker leader's"
        verb = "starts" if len(borrowed) == 1 else "start"
        parts.append(f"{ranks_text(borrowed)} {verb} from {source} weights and optimiser state")
    new_masters = [new.role(r).master for r, p in enumerate(plans) if p.rank is None and new.role(r).kind == "master"]
    if new_masters:
        verb = "starts" if len(new_masters) == 1 else "start"
        parts.append(f"{_plural('sub-master', new_masters)} {_listed(new_masters)} {verb} from the top master's centre")
    used = {p.rank for p in plans if p.rank is not None and not p.partial}
    gone_masters = [old.role(r).master for r in range(old.n_ranks) if old.role(r).kind == "master" and r not in used]
    if gone_masters:
        parts.append(
            f"the updates of {_plural('sub-master', gone_masters)} {_listed(gone_masters)} not yet pushed to the "
            f"top master are dropped"
        )
    gone = [r for r in range(old.n_ranks) if old.role(r).kind == "worker" and r not in used]
    if gone and new.topology != "allreduce":
        parts.append(f"the checkpoint's workers on {ranks_text(gone)} are not resumed (their own state is dropped)")
    if epoch is not None:
        parts.append(f"every worker starts epoch {epoch + 1} from its first batch")
    return f"{what} a checkpoint of {_layout_text(old)} on {_layout_text(new)}: " + "; ".join(parts)


def _layout_text(layout: Layout) -> str:
    count, _, formula = layout.describe().partition(": ")
    return f"{count} ({formula})"


def _plural(word: str, items: list) -> str:
    return word if len(items) == 1 else word + "s"


def _listed(items: list) -> str:
    return ", ".join(map(str, items))
