"""Grid search: every combination of a few values per dimension, in a fixed order."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from nbdist.hpo.searcher import SEARCHERS, Searcher, SearcherError

__all__ = ["GridSearcher"]


@SEARCHERS.register
class GridSearcher(Searcher):
    """Every combination of a few values per dimension, in a fixed order.

    `points` values per real dimension (evenly spaced, in log for log-uniform ones), all
    integers of an integer dimension when there are at most `points` of them (else `points`
    of them evenly spread), every category. The last dimension varies fastest. The grid is
    never built: the k-th point is decoded from k, so a grid of millions costs nothing."""

    name = "grid"
    multi_objective = True  # it models nothing: several objectives are as good as one
    parameter_help = {"points": "values per real dimension (and at most per integer one)"}

    def __init__(self, space: Any, *, direction: str = "minimize", seed: int = 0, points: int = 5):
        super().__init__(space, direction=direction, seed=seed)
        if isinstance(points, bool) or not isinstance(points, int) or points < 1:
            raise SearcherError(f"grid points must be a positive integer, got {points!r}")
        self.points = points
        self.axes = {name: dim.grid(points) for name, dim in self.space.items()}
        self.size = math.prod(len(values) for values in self.axes.values())
        self.next = 0

    def options(self) -> dict:
        return {"points": self.points}

    @property
    def exhausted(self) -> bool:
        return self.next >= self.size

    @property
    def planned(self) -> int:
        return self.size

    def point(self, k: int) -> dict:
        out = {}
        for name, values in reversed(self.axes.items()):
            k, i = divmod(k, len(values))
            out[name] = values[i]
        return {name: out[name] for name in self.axes}

    def _propose(self, n: int) -> list[dict]:
        stop = min(self.next + n, self.size)
        points = [self.point(k) for k in range(self.next, stop)]
        self.next = stop
        return points

    def _extra_state(self) -> dict:
        return {"next": self.next}

    def _load_extra_state(self, extra: Mapping[str, Any]) -> None:
        self.next = int(extra["next"])
