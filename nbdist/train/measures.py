"""Figures of merit measured on the trained model when a study's run ends, for objectives
that no epoch records: `params`, the model's parameter count, and the functions of the
model file's (or cell's) `objectives` dict, each called with the trained model, e.g.

    def latency(model):                      # seconds per sample, the figure an FPGA budget limits
        x = torch.randn(256, 64)
        start = time.perf_counter(); model(x); return (time.perf_counter() - start) / 256
    objectives = {"latency": latency}

and `--objective val_acc,latency --direction maximize,minimize`. The run's leader measures
them (its model holds the final weights, whatever the topology) and adds them to the
run's final metrics.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from nbdist.errors import UserError

__all__ = ["MODEL_MEASURES", "measure"]

MODEL_MEASURES = ("params",)  # measured for any model


def measure(backend: Any, functions: Mapping[str, Callable[[Any], float]], names: Iterable[str]) -> dict[str, float]:
    """The measures among `names` (the others are the run's own metrics)."""
    out: dict[str, float] = {}
    for name in names:
        if name == "params":
            out[name] = float(backend.num_params)
        elif name in functions:
            try:
                value = float(functions[name](backend.model))
            except Exception as exc:  # the user's function: one error naming it
                raise UserError(
                    f"the objective function {name!r} failed on the trained model: {type(exc).__name__}: {exc}"
                ) from None
            if not math.isfinite(value):
                raise UserError(f"the objective function {name!r} gave {value} for the trained model")
            out[name] = value
    return out
