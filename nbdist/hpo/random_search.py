"""Random search: independent draws from the priors (log-uniform where the space says so)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nbdist.hpo.searcher import SEARCHERS, Searcher

__all__ = ["RandomSearcher"]

RANDOM_POINT = 1  # rng stream of the k-th random point


@SEARCHERS.register
class RandomSearcher(Searcher):
    """Independent draws from the priors (log-uniform where the space says so).

    The k-th point is drawn from its own generator (seed, k): the sequence of points is
    the same however the runner splits its asks (ask(2) == ask(1) + ask(1))."""

    name = "random"
    multi_objective = True  # it models nothing: several objectives are as good as one

    def __init__(self, space: Any, *, direction: str = "minimize", seed: int = 0):
        super().__init__(space, direction=direction, seed=seed)
        self.drawn = 0

    def _propose(self, n: int) -> list[dict]:
        points = [self.space.sample(self.rng(RANDOM_POINT, self.drawn + i)) for i in range(n)]
        self.drawn += n
        return points

    def _extra_state(self) -> dict:
        return {"drawn": self.drawn}

    def _load_extra_state(self, extra: Mapping[str, Any]) -> None:
        self.drawn = int(extra["drawn"])
