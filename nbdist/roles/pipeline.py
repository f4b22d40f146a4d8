"""A worker whose processes are the stages of a pipeline (--worker-parallel pipeline).

Process s of a worker holds stage s of the model file's build_stages() (a TorchStage).
Each batch is cut into --micro-batches parts that flow through the stages in the order of
--pipeline-schedule (GPipe or 1F1B, train/pipeline_schedule.py): the first stage reads
the batch's features, the last its labels and computes the loss, and activations and
their gradients travel between neighbouring stages (transport/pipeline.py). Every stage
ends the batch with its own parameters' gradient, of the whole batch.

Towards the master the stages are one worker: the rule runs on each stage's part of the
buffers (every rule is elementwise), the leader (stage 0) gathers the parts into the
whole model's message (encoded with --compression, as a plain worker's) and scatters the
master's reply back. The master holds the whole model, the stages in a row, and never
knows the worker is a pipeline.

Under --topology allreduce there is no master: each worker is a pipeline replica, and
stage s of every replica reduces its gradient with the others' stage s (StageReplica,
on the allreduce role's loop).
"""

from __future__ import annotations

import time

import numpy as np

from nbdist.backends.base import BatchStats
from nbdist.backends.stages import TorchStage
from nbdist.roles.allreduce import Replica, run_allreduce
from nbdist.roles.worker import Worker
from nbdist.train.context import RankContext
from nbdist.train.pipeline_schedule import FORWARD, schedule
from nbdist.train.progress import RunResult
from nbdist.transport import messages as m
from nbdist.transport.compression import Compressor, make_codec
from nbdist.transport.pipeline import StageLinks, StageParts
from nbdist.transport.staging import Staging

__all__ = [
    "StageRunner",
    "PipelineWorker",
    "StageReplica",
    "run_pipeline_worker",
    "run_pipeline_replicas",
    "stage_layout",
]

EVALUATE_ROWS = 1024  # samples of a validation part sent between stages at once


class StageRunner:
    """One stage's part of a batch's forward and backward passes over its micro-batches.

    `busy_s` and `idle_s` add up the time spent computing and waiting for the other
    stages (receives, and the step's last sends): the measured bubble is idle / (busy + idle)."""

    def __init__(self, stage: TorchStage, links: StageLinks, schedule_name: str, micro_batches: int):
        self.stage, self.links = stage, links
        self.schedule_name, self.micro_batches = schedule_name, micro_batches
        self.busy_s = self.idle_s = 0.0

    def gradients(self, x: np.ndarray, y: np.ndarray, scale: float = 1.0) -> BatchStats:
        """This stage's gradient of the batch (x, y), times `scale`; the batch's loss and
        metric sums on the last stage (zero on the others)."""
        stage, links = self.stage, self.links
        rows = len(y)
        bounds = np.linspace(0, rows, min(self.micro_batches, rows) + 1).round().astype(int)
        micro = len(bounds) - 1
        shapes: dict[int, tuple[int, ...]] = {}
        stats = BatchStats()
        stage.begin_batch(micro)
        started = time.perf_counter()
        idle = 0.0
        for kind, i in schedule(self.schedule_name, stage.index, links.count, micro):
            part = slice(bounds[i], bounds[i + 1])
            rows_i = int(bounds[i + 1] - bounds[i])
            if kind == FORWARD:
                if stage.first:
                    inputs = x[part]
                else:
                    t0 = time.perf_counter()
                    inputs = links.receive_activation(rows_i)
                    idle += time.perf_counter() - t0
                output = stage.forward(i, inputs)
                if output is not None:
                    shapes[i] = output.shape
                    links.send_activation(output, rows_i)
                continue
            if stage.last:
                weight = scale * rows_i / rows
                part_stats, input_grad = stage.loss_backward(i, y[part], weight)
                stats.add(part_stats)
            else:
                t0 = time.perf_counter()
                output_grad = links.receive_gradient(shapes.pop(i))
                idle += time.perf_counter() - t0
                input_grad = stage.backward(i, output_grad)
            if input_grad is not None:
                links.send_gradient(input_grad)
        stage.end_batch()
        t0 = time.perf_counter()
        links.flush()
        ended = time.perf_counter()
        idle += ended - t0
        self.idle_s += idle
        self.busy_s += ended - started - idle
        return stats

    def evaluate(self, x: np.ndarray, y: np.ndarray, rows_per_part: int = EVALUATE_ROWS) -> BatchStats:
        """The validation of (x, y) through the stages, `rows_per_part` samples at a time:
        its loss and metric sums on the last stage (zero on the others)."""
        stage, links = self.stage, self.links
        stats = BatchStats()
        for start in range(0, len(y), rows_per_part):
            part = slice(start, min(start + rows_per_part, len(y)))
            rows = part.stop - part.start
            inputs = x[part] if stage.first else links.receive_activation(rows)
            if stage.last:
                stats.add(stage.evaluate(inputs, y[part]))
            else:
                links.send_activation(stage.infer(inputs), rows)
                links.flush()  # one part's activations held at a time
        return stats


def stage_layout(sizes: list[int], floats: list[int]) -> tuple[list[int], list[int]]:
    """Where each stage's parameters and state start in the whole model's buffers: its
    parameters come last stage first (TorchBackend lays them out in reverse order of
    registration), its state (BatchNorm statistics) first stage first."""
    params = [sum(sizes[s + 1 :]) for s in range(len(sizes))]
    state = [sum(floats[:s]) for s in range(len(floats))]
    return params, state


def stage_runner(ctx: RankContext) -> StageRunner:
    """This rank's stage of its worker (or replica), linked to its neighbours."""
    links = StageLinks(ctx.comms.worker, ctx.peers.collectives, ctx.role.proc_index, ctx.comms.worker.Get_size())
    stage = ctx.backend
    if not isinstance(stage, TorchStage):
        raise TypeError(f"a pipeline stage's backend is a TorchStage, not {type(stage).__name__}")
    return StageRunner(stage, links, ctx.options.pipeline_schedule, ctx.options.micro_batches)


def stage_parts(ctx: RankContext) -> tuple[StageParts, StageParts]:
    """The stages' parameters and states as parts of the whole model's (collective over
    the worker's processes)."""
    backend, collectives, comm = ctx.backend, ctx.peers.collectives, ctx.comms.worker
    sizes = collectives.allgather(comm, [backend.num_params, len(backend.state)], "the pipeline stages' sizes")
    params, floats = [int(s[0]) for s in sizes], [int(s[1]) for s in sizes]
    param_offsets, state_offsets = stage_layout(params, floats)
    return (StageParts(comm, collectives, params, param_offsets), StageParts(comm, collectives, floats, state_offsets))


class PipelineWorker(Worker):
    replicas = False  # each process holds one stage: no gradient to sum between them

    def __init__(self, ctx: RankContext):
        super().__init__(ctx)
        backend = ctx.backend
        self.runner = stage_runner(ctx)
        self.param_parts, self.state_parts = stage_parts(ctx)
        params, floats = self.param_parts.total, self.state_parts.total
        # --compression: the leader encodes the whole model's message, as a plain worker
        # its own (Worker._exchange).
        codec = None
        if ctx.compression is not None:
            blocks = self.param_parts.gather_blocks(backend.param_blocks(), "the pipeline stages' parameter shapes")
            codec = make_codec(ctx.compression, params, blocks) if self.leader else None
        self.compressor = Compressor(codec) if codec is not None else None
        # The leader's message and reply hold the whole model; each stage's own part of
        # them is what its rule writes and reads.
        self.out = (
            m.Message(params, floats, codec.wire_size if codec is not None else 0) if self.leader else m.Message(0, 0)
        )
        self.whole_reply = np.empty(params if self.leader else 0, np.float32)
        self.channel.reply_payload = self.whole_reply  # the leader receives the whole model's reply
        stage_message = np.empty(backend.num_params, np.float32)
        self.message = Staging.of_host(stage_message, self.rule_params, backend.copier)

    def _share(self, indices: np.ndarray) -> np.ndarray:
        return indices  # every stage reads the batch: the first its features, the last its labels

    def _gradients(self, x, y, scale: float) -> BatchStats:
        return self._batch_totals(self.runner.gradients(x, y, scale))

    def _first_weights(self) -> None:
        collectives, leader = self.ctx.peers.collectives, self.leader
        if leader:
            collectives.bcast(self.block, self.out.payload)
            collectives.bcast(self.block, self.out.state)
        self.param_parts.scatter(
            self.out.payload if leader else None, self.params.to_host(), "the worker's first weights"
        )
        self.params.to_device()
        self.state_parts.scatter(
            self.out.state if leader else None, self.model_state.to_host(), "the worker's first weights"
        )
        self.model_state.to_device()

    def _centre_parts(self, model: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
        # The master's centre is the whole model, the stages in a row (stage_layout).
        proc, state = self.ctx.role.proc_index, model.get("state")
        p0, p1 = self.param_parts.displs[proc], self.param_parts.displs[proc] + self.param_parts.counts[proc]
        s0, s1 = self.state_parts.displs[proc], self.state_parts.displs[proc] + self.state_parts.counts[proc]
        return model["params"][p0:p1], None if state is None else state[s0:s1]

    def _collect_message(self) -> None:
        leader = self.leader
        self.param_parts.gather(
            self.message.to_host(), self.out.payload if leader else None, "the pipeline stages' message"
        )
        self.state_parts.gather(
            self.model_state.to_host(), self.out.state if leader else None, "the pipeline stages' message"
        )

    def _message_state(self) -> None:
        pass  # gathered from the stages with the payload (_collect_message)

    def _share_reply(self) -> None:
        what = "the master's reply to the pipeline stages"
        self.ctx.peers.collectives.bcast(self.wcomm, self.reply_header, what)
        self.param_parts.scatter(self.whole_reply if self.leader else None, self.reply_payload, what)

    def _twin(self) -> int | None:
        return None  # every stage holds weights of its own


def run_pipeline_worker(ctx: RankContext) -> None:
    PipelineWorker(ctx).run()


class StageReplica(Replica):
    """One pipeline stage of a replica (--topology allreduce --worker-parallel pipeline).

    The run is N replicas of P stage ranks each: replica w takes shard w of each batch
    through its stages, and stage s reduces its gradient with stage s of the other
    replicas (the layout's `stage` communicator, the stage's own bucketed reducer) and
    steps its own optimiser. The batch's sums come from the last stages: a replica's
    stages add up their trailers (its stops too) before the reduction, so every rank
    holds the run's. Validation runs through the stages; the final weights are the whole
    model, the stages in a row, as replica 0's first stage gathers them."""

    def __init__(self, ctx: RankContext):
        super().__init__(ctx)
        role = ctx.role
        self.comm = ctx.comms.stage
        self.index, self.count = role.worker, ctx.layout.workers
        self.twin = ctx.layout.fold_ranks(*role.run)[0] + role.proc_index  # replica 0's stage
        self.runner = stage_runner(ctx)

    def gradients(self, x, y, scale: float) -> BatchStats:
        return self.runner.gradients(x, y, scale)

    def share_sums(self, trailer: np.ndarray) -> None:
        self.ctx.peers.collectives.allreduce(self.ctx.comms.worker, trailer, "the pipeline stages' batch sums")

    def evaluate(self, x, y) -> BatchStats:
        return self.runner.evaluate(x, y)

    def final_arrays(self) -> dict[str, np.ndarray] | None:
        ctx = self.ctx
        if ctx.role.worker != 0:
            return None
        backend = ctx.backend
        # The first stage gathers the stages in a row, as a master holds them.
        whole = ctx.make_replica() if ctx.role.proc == 0 else None
        for parts, mine, into in zip(
            stage_parts(ctx),
            (backend.params, backend.state),
            (whole.params, whole.state) if whole is not None else (None, None),
            strict=True,
        ):
            target = Staging(into, whole.copier) if whole is not None else None
            parts.gather(
                Staging(mine, backend.copier).to_host(),
                target.to_host() if target is not None else None,
                "the pipeline stages' final weights",
            )
            if target is not None:
                target.to_device()
        return whole.named_arrays() if whole is not None else None


def run_pipeline_replicas(ctx: RankContext) -> RunResult | None:
    return run_allreduce(ctx, StageReplica(ctx))
