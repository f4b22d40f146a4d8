"""Hyper-parameter search: spaces, and searchers behind one ask/tell interface.

    from nbdist.hpo import make_searcher
    searcher = make_searcher("evolution(population=20)", "lr=log(1e-4,1e-1) hidden=int(16,256)",
                             direction="minimize", seed=0, trials=200)
    points = searcher.ask(2); searcher.tell(points[0], 0.12)

Searchers are looked up by name once, in `SEARCHERS` (bayes, evolution, grid, random, and
optuna(sampler=tpe|cmaes|gp|nsga2|nsga3|qmc|random), Optuna's samplers);
schedulers, which decide how long each trial trains, in `SCHEDULERS` (nbdist.hpo.schedulers:
fifo, median, asha, hyperband, pbt, pb2). Nothing here touches MPI or a framework; only `bayes`
imports scikit-optimize, when used.
"""

from __future__ import annotations

from nbdist.hpo.bayes import BayesSearcher
from nbdist.hpo.evolution import EvolutionSearcher
from nbdist.hpo.grid import GridSearcher
from nbdist.hpo.inprocess import TrialStopped, optimize
from nbdist.hpo.optuna_searcher import OptunaSearcher
from nbdist.hpo.random_search import RandomSearcher
from nbdist.hpo.schedulers import SCHEDULERS, Scheduler, SchedulerError
from nbdist.hpo.searcher import (
    DIRECTIONS,
    SEARCHERS,
    Searcher,
    SearcherError,
    make_searcher,
    register,
    restore_searcher,
)
from nbdist.hpo.space import Categorical, Dimension, Integer, Real, Space, SpaceError
from nbdist.hpo.space_input import as_space, parse_space

__all__ = [
    "Space",
    "Dimension",
    "Real",
    "Integer",
    "Categorical",
    "SpaceError",
    "as_space",
    "parse_space",
    "Searcher",
    "SearcherError",
    "SEARCHERS",
    "DIRECTIONS",
    "register",
    "make_searcher",
    "restore_searcher",
    "BayesSearcher",
    "EvolutionSearcher",
    "GridSearcher",
    "RandomSearcher",
    "OptunaSearcher",
    "SCHEDULERS",
    "Scheduler",
    "SchedulerError",
    "optimize",
    "TrialStopped",
]
