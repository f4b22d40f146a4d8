"""The searchers on functions whose minimum is known, as the issue asks: bayes reaches
within 1% of Branin's minimum in at most 30 evaluations on at least 8 of 10 seeds;
evolution finds Hartmann-6 below -3.0 within its budget. Default settings throughout,
except the evolution budget (population x generations), which a study always sets."""

from __future__ import annotations

import multiprocessing
import os

import pytest

from nbdist.hpo import BayesSearcher, EvolutionSearcher, RandomSearcher
from nbdist.hpo.functions import BRANIN_MIN, BRANIN_SPACE, HARTMANN6_MIN, HARTMANN6_SPACE, branin, drive, hartmann6

TARGET = BRANIN_MIN * 1.01


def evaluations_to_target(searcher, budget: int = 30) -> int | None:
    values = drive(searcher, branin, budget, stop=lambda v: v <= TARGET)
    return len(values) if values[-1] <= TARGET else None


def bayes_evaluations_to_target(seed: int) -> int | None:
    return evaluations_to_target(BayesSearcher(BRANIN_SPACE, seed=seed))


@pytest.mark.slow  # 10 seeds of 30 Gaussian-process fits each: minutes of CPU
def test_bayes_reaches_branin_minimum_within_30_evaluations():
    # the peer in the same conditions: random search rarely gets there in 30
    random_runs = [evaluations_to_target(RandomSearcher(BRANIN_SPACE, seed=seed)) for seed in range(10)]
    random_reached = sum(n is not None for n in random_runs)
    # The seeds are independent and each fit uses one core: they share the machine's cores
    # (fresh processes: forking a process that has torch's threads running may hang). Once
    # enough seeds have reached the target for both claims below, the seeds still running
    # cannot change either: the pool is ended without them.
    workers = max(1, min(4, os.cpu_count() or 1))
    runs: dict[int, int | None] = {}
    with multiprocessing.get_context("spawn").Pool(workers) as pool:  # leaving it terminates it
        for seed, n in pool.imap_unordered(_seed_and_evaluations, range(10)):
            runs[seed] = n
            if sum(n is not None for n in runs.values()) >= max(8, random_reached + 1):
                break
    reached = [n for n in runs.values() if n is not None]
    assert len(reached) >= 8, f"evaluations to within 1% of the minimum, per seed: {runs}"
    assert random_reached < len(reached), f"random search, per seed: {random_runs}; bayes: {runs}"


def _seed_and_evaluations(seed: int) -> tuple[int, int | None]:
    return seed, bayes_evaluations_to_target(seed)


def test_evolution_finds_hartmann6_below_minus_3():
    for seed in range(10):
        s = EvolutionSearcher(HARTMANN6_SPACE, seed=seed, population=40, generations=30)
        values = drive(s, hartmann6, s.planned, batch=8)
        assert len(values) == 1200 and s.exhausted
        best = s.best[1]
        assert HARTMANN6_MIN <= best < -3.0, f"seed {seed}: best {best}"
        # the population improves as it evolves: the last generation is better on average
        assert sum(values[-40:]) / 40 < sum(values[:40]) / 40 - 1.0
