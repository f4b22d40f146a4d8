"""The searchers on functions whose minimum is known, as the issue asks: bayes reaches
within 1% of Branin's minimum in at most 30 evaluations on at least 8 of 10 seeds;
evolution finds Hartmann-6 below -3.0 within its budget. Default settings throughout,
except the evolution budget (population x generations), which a study always sets."""

from __future__ import annotations

import pytest

from nbdist.hpo import BayesSearcher, EvolutionSearcher, RandomSearcher
from nbdist.hpo.functions import BRANIN_MIN, BRANIN_SPACE, HARTMANN6_MIN, HARTMANN6_SPACE, branin, drive, hartmann6

TARGET = BRANIN_MIN * 1.01


def evaluations_to_target(searcher, budget: int = 30) -> int | None:
    values = drive(searcher, branin, budget, stop=lambda v: v <= TARGET)
    return len(values) if values[-1] <= TARGET else None


@pytest.mark.slow  # 10 seeds of 30 Gaussian-process fits each: minutes of CPU
def test_bayes_reaches_branin_minimum_within_30_evaluations():
    runs = {seed: evaluations_to_target(BayesSearcher(BRANIN_SPACE, seed=seed)) for seed in range(10)}
    reached = [n for n in runs.values() if n is not None]
    assert len(reached) >= 8, f"evaluations to within 1% of the minimum, per seed: {runs}"
    # the peer in the same conditions: random search rarely gets there in 30
    random_runs = [evaluations_to_target(RandomSearcher(BRANIN_SPACE, seed=seed)) for seed in range(10)]
    assert sum(n is not None for n in random_runs) < len(reached)


def test_evolution_finds_hartmann6_below_minus_3():
    for seed in range(10):
        s = EvolutionSearcher(HARTMANN6_SPACE, seed=seed, population=40, generations=30)
        values = drive(s, hartmann6, s.planned, batch=8)
        assert len(values) == 1200 and s.exhausted
        best = s.best[1]
        assert HARTMANN6_MIN <= best < -3.0, f"seed {seed}: best {best}"
        # the population improves as it evolves: the last generation is better on average
        assert sum(values[-40:]) / 40 < sum(values[:40]) / 40 - 1.0
