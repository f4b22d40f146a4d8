"""The order in which a pipeline stage runs its micro-batches' forward and backward passes.

A schedule is a list of (FORWARD or BACKWARD, micro-batch) for one stage; every stage
runs micro-batches' forwards, and their backwards, in increasing order, so that what one
stage sends the next receives in the same order.

- GPipe (Huang et al. 2019): every forward, then every backward. Simple; a stage holds
  the activations of all M micro-batches at once.
- 1F1B (PipeDream-Flush, Narayanan et al. 2021): stage s runs p - s - 1 forwards to
  fill the pipeline, then alternates one forward and one backward, then drains the
  backwards. The same bubble as GPipe, (p - 1) / (m + p - 1), with at most p - s
  micro-batches' activations held.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["FORWARD", "BACKWARD", "SCHEDULES", "schedule", "ideal_bubble"]

FORWARD, BACKWARD = "F", "B"
Step = tuple[str, int]


def gpipe(stage: int, stages: int, micro: int) -> list[Step]:
    return [(FORWARD, i) for i in range(micro)] + [(BACKWARD, i) for i in range(micro)]


def one_forward_one_backward(stage: int, stages: int, micro: int) -> list[Step]:
    warm_up = min(stages - stage - 1, micro)
    steps = [(FORWARD, i) for i in range(warm_up)]
    backward = 0
    for forward in range(warm_up, micro):
        steps += [(FORWARD, forward), (BACKWARD, backward)]
        backward += 1
    return steps + [(BACKWARD, i) for i in range(backward, micro)]


SCHEDULES: dict[str, Callable[[int, int, int], list[Step]]] = {"gpipe": gpipe, "1f1b": one_forward_one_backward}


def schedule(name: str, stage: int, stages: int, micro: int) -> list[Step]:
    """Stage `stage` of `stages`' steps for `micro` micro-batches (`name` is checked by the options)."""
    return SCHEDULES[name](stage, stages, micro)


def ideal_bubble(stages: int, micro: int) -> float:
    """The fraction of a step each stage idles in either schedule, with equal stages and
    free sends: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (micro + stages - 1)
