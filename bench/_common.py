"""Helpers shared by the benchmark scripts (not a benchmark itself).

The scripts print ratios against a peer measured in the same run; absolute numbers on a
shared box mean little. Everything here is deterministic given a seed, so both sides of a
comparison build the same model and see the same batches.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from itertools import pairwise
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
RESULT_PREFIX = "BENCH_RESULT "


# ----------------------------------------------------------------------------- models
def mlp(sizes: Sequence[int]):
    """Linear/ReLU stack: sizes = (inputs, hidden..., outputs)."""
    from torch import nn

    layers: list = []
    for i, (a, b) in enumerate(pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


MLPS = {
    # ~22k parameters: a step is a few hundred microseconds, the allreduce is latency-bound.
    "small": (100, 128, 64, 10),
    # ~7.9M parameters (31.5 MB of gradient): the allreduce is bandwidth-bound.
    "large": (512, 1024, 1024, 1024, 1024, 1024, 1024, 1024, 1024, 10),
}


def count_params(sizes: Sequence[int]) -> int:
    return sum(a * b + b for a, b in pairwise(sizes))


def synthetic(n: int, features: int, classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, features), dtype=np.float32)
    y = rng.integers(0, classes, n).astype(np.int64)
    return x, y


def batch_indices(n: int, batch: int, steps: int, seed: int) -> list[np.ndarray]:
    """`steps` random index batches into n samples (fancy indexing, as a data loader does)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, n, batch) for _ in range(steps)]


# ----------------------------------------------------------------------------- output
def header(title: str) -> None:
    import torch

    try:
        from mpi4py import MPI

        mpi = MPI.Get_library_version().splitlines()[0].split(",")[0]
        import mpi4py

        mpi = f"mpi4py {mpi4py.__version__}, {mpi}"
    except Exception as exc:  # pragma: no cover - informative only
        mpi = f"mpi unavailable ({exc})"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"== {title}")
    print(f"   torch {torch.__version__}, {mpi}, python {platform.python_version()}")
    print(f"   {os.cpu_count()} cores, load average {load:.2f}, {platform.machine()} {platform.system()}")
    print("   ratios compare runs made now on this machine; absolute numbers on a busy box mean little")
    print()


def table(rows: list[list], headers: list[str]) -> None:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for k, row in enumerate(cells):
        print(
            "  ".join(c.ljust(w) if k == 0 or not _numeric(c) else c.rjust(w) for c, w in zip(row, widths, strict=True))
        )
        if k == 0:
            print("  ".join("-" * w for w in widths))
    print()


def _numeric(text: str) -> bool:
    return text.replace(",", "").replace(".", "").replace("x", "").replace("-", "").isdigit() or text == "n/a"


def _fmt(value) -> str:
    if isinstance(value, float):
        if value != value:
            return "n/a"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.3g}" if abs(value) < 1 else f"{value:.2f}"
    return str(value)


def aim(label: str, threshold: float, ratio: float) -> bool:
    met = ratio >= threshold
    print(f"aim >= {threshold:g}x {label}: ratio {ratio:.2f}x ({'met' if met else 'not met'})")
    return met


def aim_at_most(label: str, threshold: float, ratio: float) -> bool:
    met = ratio <= threshold
    print(f"aim <= {threshold:g}x {label}: ratio {ratio:.2f}x ({'met' if met else 'not met'})")
    return met


# ----------------------------------------------------------------------------- processes
def emit(result: dict) -> None:
    """A rank's answer to the parent script: one tagged JSON line on stdout."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_mpi(n: int, argv: list[str], *, timeout: float = 300) -> list[dict]:
    """`mpiexec -n n python argv` with nbdist's MPI environment; the ranks' emitted results."""
    from nbdist.launch import mpi_env, mpiexec_command

    cmd = mpiexec_command(n, argv)
    proc = subprocess.run(cmd, cwd=ROOT, env=mpi_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
    results = [
        json.loads(line[len(RESULT_PREFIX) :]) for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)
    ]
    if not results:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"{' '.join(cmd)} printed no result")
    return results


def best_time(fn: Callable[[], None], *, repeat: int, number: int = 1) -> float:
    """Fastest of `repeat` timings of `number` calls, per call (seconds)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t0) / number)
    return best


def memcpy_ms(n: int, repeat: int) -> float:
    """Median time of np.copyto between two float32 arrays of n elements (pages touched first)."""
    src = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def median_time(fn: Callable[[], None], *, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))
