"""Known test functions, to try a searcher without a cluster (the tests and
bench/hpo_parallel.py use them).

    branin      2 parameters, three global minima of 0.397887
    hartmann6   6 parameters in [0, 1], one global minimum of -3.32237
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np

from nbdist.hpo.searcher import Searcher

__all__ = ["BRANIN_SPACE", "BRANIN_MIN", "branin", "HARTMANN6_SPACE", "HARTMANN6_MIN", "hartmann6", "drive"]

BRANIN_SPACE = "x1=real(-5,10) x2=real(0,15)"
BRANIN_MIN = 0.397887


def branin(params: Mapping[str, float]) -> float:
    x1, x2 = params["x1"], params["x2"]
    b, c, t = 5.1 / (4 * math.pi**2), 5 / math.pi, 1 / (8 * math.pi)
    return (x2 - b * x1**2 + c * x1 - 6) ** 2 + 10 * (1 - t) * math.cos(x1) + 10


HARTMANN6_SPACE = " ".join(f"x{i}=real(0,1)" for i in range(1, 7))
HARTMANN6_MIN = -3.32237
_ALPHA = np.array([1.0, 1.2, 3.0, 3.2])
_A = np.array(
    [[10, 3, 17, 3.5, 1.7, 8], [0.05, 10, 17, 0.1, 8, 14], [3, 3.5, 1.7, 10, 17, 8], [17, 8, 0.05, 10, 0.1, 14]]
)
_P = 1e-4 * np.array(
    [
        [1312, 1696, 5569, 124, 8283, 5886],
        [2329, 4135, 8307, 3736, 1004, 9991],
        [2348, 1451, 3522, 2883, 3047, 6650],
        [4047, 8828, 8732, 5743, 1091, 381],
    ]
)


def hartmann6(params: Mapping[str, float]) -> float:
    x = np.array([params[f"x{i}"] for i in range(1, 7)])
    return float(-_ALPHA @ np.exp(-(_A * (x - _P) ** 2).sum(axis=1)))


def drive(
    searcher: Searcher,
    func: Callable[[dict], float],
    evaluations: int,
    *,
    batch: int = 1,
    stop: Callable[[float], bool] | None = None,
) -> list[float]:
    """Ask `batch` points at a time and tell each its value, until `evaluations` values are
    told, the searcher is exhausted, or `stop(value)` is true; the values in the order told."""
    values: list[float] = []
    while len(values) < evaluations and not searcher.exhausted:
        points = searcher.ask(min(batch, evaluations - len(values)))
        if not points:
            raise RuntimeError(f"{searcher!r} gave no point while none was pending")
        for p in points:
            value = func(p)
            searcher.tell(p, value)
            values.append(value)
            if stop is not None and stop(value):
                return values
    return values
