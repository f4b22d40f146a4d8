"""The MPI side of master_throughput.py; run under `mpiexec -n 3` (1 master + 2 workers).

Rank 0 runs nbdist's real master loop (`run_master`: one posted Irecv per worker for
its header, the body into a pooled buffer, Testsome, Downpour.master_apply with the
master optimiser, reply header + payload without waiting for it to leave).
The model is an nn.Embedding with exactly --params parameters, so the master's work per
update is that of a real model of that size.

Workers (`--workers protocol`, the default) speak the real wire format and nothing else:
each sends one message [header | precomputed gradient | state] per update (the header,
then the body), waits for the
reply header and payload, and sends again at once, so the master is the bottleneck.
`--workers real` runs nbdist's own `run_worker` instead (its per-step gradient
computation on this model is an embedding lookup plus zeroing and copying the flat
buffers), to show what a worker's side costs on top.

The master rank reports the steady-state time per update from its own metric records
(one "update" record per update, `--trace-updates` as in earlier versions of this bench,
the first fifth dropped as warm-up), the CPU time its loop's thread spent over the same
updates (CpuClock: what the master's own work costs, however much of the two cores the
workers and other jobs took), its phase totals
(wait / update / reply), and the memcpy reference measured in the same process just
before and after the run.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Self

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
import torch
from _common import emit, memcpy_ms
from mpi4py import MPI
from torch import nn

from nbdist.metrics.log import read_log
from nbdist.options import TrainOptions
from nbdist.roles.master import run_master
from nbdist.roles.worker import run_worker
from nbdist.train.context import prepare
from nbdist.train.definition import ModelDefinition
from nbdist.train.stopping import StopFlag
from nbdist.transport import messages as m
from nbdist.transport.waiting import wait

CLASSES = 10


def definition(params: int, samples: int) -> ModelDefinition:
    rows = params // CLASSES
    rng = np.random.default_rng(0)
    x = rng.integers(0, rows, samples).astype(np.int64)
    y = rng.integers(0, CLASSES, samples).astype(np.int64)
    from nbdist.data import ArrayData

    data = ArrayData(x, y, x[:8], y[:8], name="embedding-ids")
    return ModelDefinition(build_model=lambda: nn.Embedding(rows, CLASSES), data=data, source="bench")


def protocol_worker(ctx, epochs: int, steps: int) -> None:
    """Only the wire protocol of run_worker: send a precomputed gradient, await the reply."""
    block = ctx.comms.block
    # Host buffers of the model's sizes (--device auto may have put the model on a GPU).
    n, s = ctx.backend.num_params, len(ctx.backend.state)
    params, state = np.empty(n, np.float32), np.empty(s, np.float32)
    wait(block.Ibcast(params, root=0))  # as the master sends them: nonblocking
    wait(block.Ibcast(state, root=0))
    out = m.Message(n, s)
    out.payload[:] = np.random.default_rng(ctx.role.rank).standard_normal(n, dtype=np.float32) * 1e-3
    reply_header, reply_payload = m.new_header(ctx.layout.workers), np.empty(n, np.float32)
    version = 0
    for epoch in range(epochs):
        for step in range(steps):
            out.header[: m.CHECKPOINT + 1] = (
                m.UPDATE,
                version,
                epoch,
                1,
                2.3,
                0.0,
                m.EPOCH_END if step == steps - 1 else 0,
                m.NO_CHECKPOINT,
            )
            header_req = block.Irecv(reply_header, source=0, tag=m.TAG_REPLY_HEADER)
            payload_req = block.Irecv(reply_payload, source=0, tag=m.TAG_REPLY)
            for part, tag in out.parts():
                block.Send(part, dest=0, tag=tag)
            wait(header_req)
            wait(payload_req)
            version = int(reply_header[m.VERSION])
            if reply_header[m.KIND] != m.CONTINUE:
                raise SystemExit(f"the master answered {reply_header[m.KIND]} (not CONTINUE)")
    # DONE, acknowledging the final checkpoint the master wrote.
    out.header[: m.CHECKPOINT + 1] = (m.DONE, version, epochs, 0, 0.0, 0.0, 0, m.label_code(f"epoch-{epochs:04d}"))
    block.Send(out.buffer[: m.HEADER_FLOATS], dest=0, tag=m.TAG_UPDATE)  # DONE: the header alone


class CpuClock:
    """Samples the CPU time of the thread that made it (the master's loop), with the wall
    time, every `every` seconds from a background thread: the CPU time the master spent
    in any window of its run, its polling included, whatever the other processes on the
    cores took from it. `with CpuClock():` runs the sampling."""

    def __init__(self, every: float = 0.005):
        self.clock = time.pthread_getcpuclockid(threading.get_ident())
        self.every, self.samples, self.stop = every, [], threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while True:
            self.samples.append((time.time(), time.clock_gettime(self.clock)))
            if self.stop.wait(self.every):
                return

    def __enter__(self) -> Self:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self.samples.append((time.time(), time.clock_gettime(self.clock)))

    def seconds_between(self, start: float, end: float) -> float:
        """CPU seconds between two wall times (time.time()) of the run, interpolated."""
        wall, cpu = np.array(self.samples).T
        return float(np.interp(end, wall, cpu) - np.interp(start, wall, cpu))


def measure(comm, params: int, optimizer: str, updates: int, workers: str, runs: str) -> dict | None:
    """One run of the real master against this job's workers; the result on the master."""
    n_workers = comm.Get_size() - 1
    epochs = 2
    steps = max(2, updates // epochs)
    options = TrainOptions(
        topology="master-worker",
        algorithm="downpour",
        workers=n_workers,
        epochs=epochs,
        batch_size=1,
        sync_every=1,
        master_optimizer=optimizer,
        validate_every=10**6,
        runs_dir=runs,
        checkpoint_every=0,
        quiet=True,
        trace_updates=True,
    )
    ctx = prepare(options, definition(params, n_workers * steps), comm, StopFlag())
    assert ctx.backend.num_params == params
    try:
        if ctx.role.kind == "master":
            copy_before = memcpy_ms(params, 10)  # the reference, in this process, next to the run
            started = time.perf_counter()
            with CpuClock() as cpu:
                run_master(ctx)
            total = time.perf_counter() - started
            copy_after = memcpy_ms(params, 10)
        elif workers == "protocol":
            protocol_worker(ctx, epochs, steps)
        else:
            run_worker(ctx)
    finally:
        ctx.comms.free()
    if ctx.role.kind != "master":
        return None
    times = np.array([r["time"] for r in read_log(ctx.run_dir, "update")])
    phases = [r["values"] for r in read_log(ctx.run_dir, "phase")][-1]
    window = times[len(times) // 5 :]  # the first fifth is warm-up
    steady = np.diff(window)
    count = len(times)
    return {
        "params": params,
        "optimizer": optimizer,
        "workers": workers,
        "updates": count,
        "ms_per_update": float(np.mean(steady)) * 1e3,
        "median_ms": float(np.median(steady)) * 1e3,
        "cpu_ms_per_update": cpu.seconds_between(window[0], window[-1]) / len(steady) * 1e3,
        "wait_ms": phases["wait"] / count * 1e3,
        "apply_ms": phases["update"] / count * 1e3,
        "reply_ms": phases["reply"] / count * 1e3,
        "run_s": total,
        "memcpy_ms": (copy_before + copy_after) / 2,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument(
        "--configs",
        required=True,
        help='JSON list of {"params": N, "optimizer": spec, "updates": per worker, "workers": "protocol" | "real"}',
    )
    p.add_argument("--runs-dir", default=None)
    args = p.parse_args()

    comm = MPI.COMM_WORLD
    runs = args.runs_dir or tempfile.mkdtemp(prefix="nbdist-bench-")
    results = []
    for c in json.loads(args.configs):
        results.append(measure(comm, c["params"], c["optimizer"], c["updates"], c.get("workers", "protocol"), runs))
        gc.collect()
    if comm.Get_rank() == 0:
        emit({"results": results})


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
