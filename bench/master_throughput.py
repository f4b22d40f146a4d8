"""How many updates per second a Downpour master absorbs, against one memcpy of the weights.

(a) in process: `Downpour.master_apply` with the backend's TorchFlatOptimizer (fused
    kernels by default) on 1M and 10M float32 parameters, for SGD and Adam; Adam on
    torch's default (foreach) path is shown for reference.
(b) the real MPI master: `mpiexec -n 3 python bench/_master_worker.py` runs nbdist's
    master loop (one posted Irecv per worker for its header, its body into a pooled
    buffer, Testsome, master_apply, reply header + payload) against 2 workers that send
    precomputed gradients in the real wire format as fast as the replies come back.
    Its phase totals say where the master's time goes.
    `--real-workers` adds runs with nbdist's own run_worker (trivial compute) for comparison.

The reference is `np.copyto` of a float32 array of the same size: in (a) alternated with
the updates, in (b) by the master process just before and after its run.
ratio = ms per update / memcpy ms; aim: within 4x. The MPI runs also print the master loop's
CPU time per update: on a shared machine the wall time includes the time the master was
not running at all. Usage: python bench/master_throughput.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np
from _common import aim_at_most, header, run_mpi, table

OPTIMIZERS = {"sgd": "sgd(lr=0.01)", "adam": "adam(lr=0.001)"}
REFERENCE = {"adam (torch default, foreach)": "adam(lr=0.001, foreach=True)"}
AIM = 4.0


def in_process(n: int, spec: str, repeat: int) -> tuple[float, float]:
    """Median ms of one Downpour.master_apply (one worker's gradient, asynchronous) and
    of one memcpy of the weights, measured alternately so that load hits both alike."""
    import torch
    from torch import nn

    from nbdist.algorithms.base import Update
    from nbdist.algorithms.downpour import Downpour
    from nbdist.backends.torch import TorchBackend
    from nbdist.specs import parse_spec

    torch.set_num_threads(1)
    backend = TorchBackend(nn.Embedding(n // 10, 10))
    opt = backend.make_optimizer(parse_spec(spec))
    rule = Downpour()
    state = rule.new_master_state(n)
    grad = np.random.default_rng(1).standard_normal(n, dtype=np.float32) * 1e-3
    update = Update(grad, 0, 32)
    copy = np.empty_like(grad)
    for _ in range(2):  # the first step allocates the optimiser state
        rule.master_apply(state, backend.params, [update], opt)
        np.copyto(copy, grad)
    apply_times, copy_times = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        rule.master_apply(state, backend.params, [update], opt)
        t1 = time.perf_counter()
        np.copyto(copy, grad)
        t2 = time.perf_counter()
        apply_times.append(t1 - t0)
        copy_times.append(t2 - t1)
    return float(np.median(apply_times)) * 1e3, float(np.median(copy_times)) * 1e3


def mpi_masters(configs: list[dict]) -> list[dict]:
    """All the MPI measurements in one `mpiexec -n 3` job (one start-up)."""
    with tempfile.TemporaryDirectory(prefix="nbdist-bench-") as runs:
        argv = [
            str(Path(__file__).with_name("_master_worker.py")),
            "--configs",
            json.dumps(configs),
            "--runs-dir",
            runs,
        ]
        return run_mpi(3, argv, timeout=600)[0]["results"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repetitions and updates (about 40 s)")
    p.add_argument("--real-workers", action="store_true", help="also run the master with nbdist's run_worker")
    args = p.parse_args()
    header("Downpour master throughput against a memcpy of the weights")
    q = args.quick

    sizes = (1_000_000, 10_000_000)
    kinds = ["protocol", "real"] if args.real_workers else ["protocol"]
    configs = [
        {
            "params": n,
            "optimizer": spec,
            "workers": kind,
            "updates": (60 if n < 5e6 else 24) if q else (300 if n < 5e6 else 80),
        }
        for n in sizes
        for spec in OPTIMIZERS.values()
        for kind in kinds
    ]
    t0 = time.time()
    mpi = mpi_masters(configs)
    print(f"   MPI master runs: {time.time() - t0:.0f} s", flush=True)

    rows, mpi_rows, ratios = [], [], {}
    for n in sizes:
        small = n < 5_000_000
        repeat = (20 if small else 8) if q else (60 if small else 20)
        label = f"{n / 1e6:g}M"
        for name, spec in {**OPTIMIZERS, **REFERENCE}.items():
            ms, copy = in_process(n, spec, repeat)
            rows.append([label, name, "in process", ms, 1e3 / ms, copy, ms / copy])
            if name in OPTIMIZERS:
                ratios[("in process", name, n)] = ms / copy
        for r in (r for r in mpi if r["params"] == n):
            name = next(k for k, v in OPTIMIZERS.items() if v == r["optimizer"])
            where = "MPI master" if r["workers"] == "protocol" else "MPI, run_worker"
            copy = r["memcpy_ms"]
            rows.append(
                [label, name, where, r["ms_per_update"], 1e3 / r["ms_per_update"], copy, r["ms_per_update"] / copy]
            )
            mpi_rows.append(
                [
                    label,
                    name,
                    r["workers"],
                    r["ms_per_update"],
                    r["wait_ms"],
                    r["apply_ms"],
                    r["reply_ms"],
                    r["cpu_ms_per_update"],
                    r["cpu_ms_per_update"] / copy,
                    r["updates"],
                ]
            )
            if r["workers"] == "protocol":
                ratios[(where, name, n)] = r["ms_per_update"] / copy
    print()
    table(rows, ["params", "optimizer", "measured", "ms/update", "updates/s", "memcpy ms", "ratio"])
    print("MPI master, per update (its phase totals / updates; wait includes receiving the message):")
    table(
        mpi_rows,
        [
            "params",
            "optimizer",
            "workers",
            "ms/update",
            "wait ms",
            "apply ms",
            "reply ms",
            "CPU ms",
            "CPU ratio",
            "updates",
        ],
    )
    print(
        "(CPU ms: the master loop's own CPU time per update over the same updates, its polling included;\n"
        " CPU ratio: that over the memcpy. The aim is on ms/update, the wall time.)"
    )
    for (where, name, n), ratio in ratios.items():
        aim_at_most(f"{where}, {name}, {n / 1e6:g}M params: ms/update over memcpy ms", AIM, ratio)


if __name__ == "__main__":
    main()
