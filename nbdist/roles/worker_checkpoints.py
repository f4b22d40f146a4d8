"""Where a worker starts, and its shares of the checkpoints: `WorkerCheckpoints`, the
base class of `Worker` (worker.py), apart from its training loop.

A worker starts from the master's first weights, or, resumed, from its own saved share
(weights, optimiser and rule state, what the codecs carry, its data position), or, where
the checkpoint holds nothing of it (it had finished, been dropped, or the run had fewer
workers), from its master's saved centre. On another layout (train/relayout.py) every
worker starts the master's next epoch.

It saves its share of a checkpoint at an epoch's end (synchronous), when the master asks
(SNAPSHOT) and when it stops (STOP), and acknowledges each share to the master in a
message: the next one, or, where a thread writes the share (a worker of one process,
train/writer.py), the first after it is on disk. roles/pipeline.py overrides which part of
the saved centre a stage takes (`_centre_parts`), how the first weights reach its stages
(`_first_weights`) and whose share holds its weights bit for bit (`_twin`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nbdist.algorithms.arrays import copy_into
from nbdist.layout import Layout
from nbdist.train.checkpoint import Checkpoints
from nbdist.train.context import RankContext
from nbdist.train.relayout import centre_share
from nbdist.train.state import load_rank_state, save_rank_state
from nbdist.train.writer import CheckpointWriter
from nbdist.transport.compression import Compressor
from nbdist.transport.reduction import CompressedReduction
from nbdist.transport.staging import Staging

__all__ = ["WorkerCheckpoints"]


class WorkerCheckpoints:
    """The state a worker's start and checkpoint shares read and write (set by
    `Worker.__init__`), and the methods that do it."""

    ctx: RankContext
    leader: bool
    procs: int  # the worker's processes
    block: Any  # its master's communicator
    wcomm: Any  # the worker's own communicator
    params: Staging
    model_state: Staging
    rule_params: Any
    rule_state: Any
    opt: Any  # the worker optimiser, if any
    version: int
    members: tuple[int, ...]
    writer: CheckpointWriter | None
    writing: dict[str, float]
    pending_ack: float
    epochs_acked: int  # synchronous: every due epoch checkpoint up to it written (m.EPOCHS_ACKED)
    compressor: Compressor | None
    reduction: CompressedReduction | None
    carried_before: dict[str, np.ndarray]

    # -- where it starts ----------------------------------------------------------------
    def _start(self) -> tuple[int, int]:
        """(epoch, step) to start from: a resume's saved position, or the master's weights."""
        ctx = self.ctx
        if ctx.resume_from is None:
            self._first_weights()
            ctx.rule.worker_start(self.rule_state, self.rule_params)
            return 0, 0
        if ctx.resume_rank is None or not Checkpoints.has_rank(ctx.resume_dir, ctx.resume_rank):
            return self._start_without_state()
        carried = self._carried()
        extra = load_rank_state(ctx, ctx.resume_dir, self.opt, self.rule_state, own=carried)
        self._load_carried(carried)
        self.version = int(extra["version"])
        if ctx.relayout:
            # On another layout the shards are new: every worker starts the master's
            # current epoch from its first batch (train/relayout.py).
            return self._relaid_start()
        if extra.get("members") is not None:
            self.members = tuple(int(w) for w in extra["members"])
        return int(extra["epoch"]), int(extra["step"])

    def _relaid_start(self) -> tuple[int, int]:
        """On another layout: the top master's next epoch, at this worker's master's version
        (staleness starts at 0)."""
        ctx = self.ctx
        old = ctx.old_layout
        self.version = int(
            Checkpoints.read_scalars(ctx.resume_dir, centre_share(old, ctx.role.master_index))["version"]
        )
        return int(Checkpoints.read_scalars(ctx.resume_dir, centre_share(old, 0))["next_epoch"]), 0

    def _first_weights(self) -> None:
        """Every process: the master's weights (the leader receives them, shares them)."""
        collectives = self.ctx.peers.collectives
        if self.leader:
            collectives.bcast(self.block, self.params)
            collectives.bcast(self.block, self.model_state)
        if self.procs > 1:
            collectives.bcast(self.wcomm, self.params, "the worker's first weights")
            collectives.bcast(self.wcomm, self.model_state, "the worker's first weights")

    def _centre_parts(self, model: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
        """This process's part of a master's saved centre: its parameters and model state
        (all of them here; a pipeline stage its own)."""
        return model["params"], model.get("state")

    def _start_without_state(self) -> tuple[int, int]:
        """Resumed from a checkpoint that holds nothing of this worker: it had finished
        (then it says DONE at once), or it had been dropped, or the checkpoint had fewer
        workers (then it starts again from its master's centre, at the first epoch whose
        data it owns)."""
        ctx = self.ctx
        meta = Checkpoints.read_meta(ctx.resume_dir)
        old = ctx.resumed_layout or Layout.from_dict(meta["layout"])
        arrays, master = Checkpoints.read_rank(ctx.resume_dir, centre_share(old, ctx.role.master_index))
        params, state = self._centre_parts(arrays["model"])
        if not ctx.relayout and ctx.comms.world.Get_rank() in meta.get("finished", []):
            # It had trained every epoch of the run as it was then; a resume that extends
            # the run has it go on from the centre.
            done = int(meta.get("options", {}).get("epochs", ctx.options.epochs))
            if done >= ctx.options.epochs:
                return ctx.options.epochs, 0
            copy_into(self.params.device, params)
            ctx.rule.worker_start(self.rule_state, self.rule_params)
            return done, 0
        copy_into(self.params.device, params)
        if state is not None:
            copy_into(self.model_state.device, state)
        self.version = int(master["version"])
        ctx.rule.worker_start(self.rule_state, self.rule_params)
        if ctx.relayout:
            return self._relaid_start()
        fixed = {int(e): tuple(w) for e, w in master.get("members", {}).items()}
        mine = [e for e, members in sorted(fixed.items()) if ctx.role.worker in members]
        start = mine[0] if mine else max([int(master["next_epoch"]), *(e + 1 for e in fixed)])
        if start in fixed:
            self.members = fixed[start]
        return start, 0

    # -- its shares of the checkpoints --------------------------------------------------
    def _twin(self) -> int | None:
        """The rank whose checkpoint share holds this rank's weights bit for bit: the leader."""
        return self.ctx.role.rank - self.ctx.role.proc_index

    def _save(self, label: str, epoch: int, step: int, before_message: bool = False) -> None:
        """`before_message`: the state from before the message just sent (which the
        master did not apply: a resume sends it again)."""
        save_rank_state(
            self.ctx,
            label,
            self.opt,
            self.rule_state,
            {"version": self.version, "epoch": epoch, "step": step, "members": list(self.members)},
            own=self._carried(before_message),
            same_as=self._twin(),
            writer=self.writer,
        )
        if self.procs > 1:
            # The leader acknowledges for all the worker's processes.
            self.ctx.peers.collectives.barrier(self.wcomm, "the worker's checkpoint")

    def _acknowledge(self, label: str, code: float) -> None:
        """Say in a message to the master that this worker's share of `label` is written:
        the next one, or with the writer, the first after it is on disk."""
        if self.writer is None:
            self._acknowledged(code)
        else:
            self.writing[label] = code
            self._written(self.writer.written())

    def _written(self, labels: list[str]) -> None:
        for label in labels:
            if label in self.writing:
                self._acknowledged(self.writing.pop(label))

    def _acknowledged(self, code: float) -> None:
        # A message carries one acknowledgement: of shares written together, the latest.
        # An asynchronous run's earlier one is superseded (its snapshot never becomes the
        # latest). A synchronous worker writes every due epoch's share, in order, and each
        # is a checkpoint the run keeps: it says "every epoch up to here" as well (a slow
        # disk can finish two between its messages, and the earlier was never committed).
        self.pending_ack = code
        if self.ctx.options.synchronous and code >= 1:
            self.epochs_acked = max(self.epochs_acked, int(code))

    def _carried(self, before_message: bool = False) -> dict[str, np.ndarray]:
        """What the codecs carry from step to step, for this rank's share of a checkpoint."""
        carried = {}
        if self.compressor is not None:
            message = self.carried_before if before_message else self.compressor.state_arrays()
            carried.update({f"message_{k}": v for k, v in message.items()})
        if self.reduction is not None:
            carried.update({f"reduction_{k}": v for k, v in self.reduction.state_arrays().items()})
        return carried

    def _load_carried(self, carried: dict[str, np.ndarray]) -> None:
        if self.compressor is not None:
            self.compressor.load_state_arrays(
                {k[len("message_") :]: v for k, v in carried.items() if k.startswith("message_")}
            )
        if self.reduction is not None:
            self.reduction.load_state_arrays(
                {k[len("reduction_") :]: v for k, v in carried.items() if k.startswith("reduction_")}
            )
