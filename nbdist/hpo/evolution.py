"""The seeds' evolutionary algorithm (NNLO's `GA`, described in the HEP review and slides).

A population of `population` points steps through `generations` generations:

1. generation 0 is drawn at random from the priors;
2. when every member of generation g has been told, generation g+1 is bred:
   - the 20% fittest (population // 5, at least 1) are carried over;
   - each other member is a child of two parents, each chosen by a binary tournament
     (two distinct members drawn at random, the fitter one wins);
   - crossover, per parameter, with A the fitter parent and r in (0, 1):
         p_child = r (p_A - p_B) + p_A                      clipped to the bounds
   - non-uniform mutation (Michalewicz), per parameter, with r1, r2 in (0, 1):
         m = (1 - r1^((1 - g/G)^3)) * (p_high - p_child  if r2 > 0.5
                                       p_low  - p_child  otherwise)
         p_child = p_child + m
     so mutations shrink from "anywhere up to the bound" in the first generations to
     nothing in the last (g: the generation just evaluated, G: the number of generations).

As in the seeds, the carried-over members are evaluated again in the next generation (a
figure of merit from training is noisy: a lucky trial should not stay on top for ever
untested); `reevaluate_elite=False` keeps their figure of merit instead, and saves those
trials. Fitness is the figure of merit itself (a float, the direction decides which is
fitter), not the seeds' 1/loss, which broke on negative or zero values.

How each kind of parameter moves:
- reals and integers move in search coordinates: the value for a uniform prior, its
  logarithm for a log-uniform one (a learning rate mutates across decades evenly);
- integers are rounded to the nearest integer after crossover and mutation, so the
  population holds exactly the values that are evaluated (the seeds truncated a float
  gene at evaluation time, which made the upper bound all but unreachable);
- categories have no order, so the arithmetic has no meaning for them: a child inherits
  the category of the fitter parent A (crossover leans towards A), and mutation switches
  it to another category, drawn uniformly, when r2 < 1 - r1^((1 - g/G)^3), the fraction
  of the way to a bound that a numeric mutation travels: categories then change often in
  the first generations (half the time at g = 0) and settle as the numbers do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from nbdist.hpo.searcher import SEARCHERS, Searcher, SearcherError
from nbdist.hpo.space import Categorical, Integer, Real

__all__ = ["EvolutionSearcher", "crossover", "mutation", "mutation_fraction", "tournament", "elite_count"]

NONUNIFORMITY = 3  # the exponent b of Michalewicz's (1 - g/G)^b, as in the seeds
INITIAL, BREED = 2, 3  # rng streams: generation 0's members; breeding generation g+1


# ----------------------------------------------------------------------------- the formulas
def crossover(p_a: float, p_b: float, r: float, low: float, high: float) -> float:
    """p_child = r (p_A - p_B) + p_A, clipped to [low, high]; A is the fitter parent."""
    return min(max(r * (p_a - p_b) + p_a, low), high)


def mutation_fraction(r1: float, g: int, generations: int) -> float:
    """1 - r1^((1 - g/G)^3): how far towards a bound a mutation moves, in [0, 1)."""
    return 1.0 - r1 ** ((1.0 - g / generations) ** NONUNIFORMITY)


def mutation(p: float, r1: float, r2: float, g: int, generations: int, low: float, high: float) -> float:
    """p + m with m = (1 - r1^((1 - g/G)^3)) * (high - p if r2 > 0.5 else low - p)."""
    m = mutation_fraction(r1, g, generations) * ((high - p) if r2 > 0.5 else (low - p))
    return min(max(p + m, low), high)


def tournament(losses: list[float], rng: np.random.Generator) -> int:
    """Binary tournament: two distinct members at random, the fitter (lower loss) wins;
    on a tie the second one, as in the seeds."""
    a = int(rng.integers(len(losses)))
    b = int(rng.integers(len(losses) - 1))
    b += b >= a  # uniform over the members other than a
    return a if losses[a] < losses[b] else b


def elite_count(population: int) -> int:
    """The 20% fittest carried over: population // 5 as in the seeds, at least one."""
    return max(1, population // 5)


# ----------------------------------------------------------------------------- the searcher
@SEARCHERS.register
class EvolutionSearcher(Searcher):
    """An evolutionary algorithm: tournament selection, crossover and shrinking mutation
    over generations of a population (NNLO's GA)."""

    name = "evolution"
    parameter_help = {
        "population": "points in each generation (at least 2)",
        "generations": "generations in all (default: as many as the study's --trials allow)",
        "reevaluate_elite": "train the fittest fifth carried over again in the next generation",
    }

    def __init__(
        self,
        space: Any,
        *,
        direction: str = "minimize",
        seed: int = 0,
        population: int = 10,
        generations: int = 10,
        reevaluate_elite: bool = True,
    ):
        super().__init__(space, direction=direction, seed=seed)
        self.trials: int | None = None  # the study's budget, when create() was told it
        for what, value, least in (("population", population, 2), ("generations", generations, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise SearcherError(f"evolution {what} must be an integer >= {least}, got {value!r}")
        self.population = population
        self.generations = generations
        self.reevaluate_elite = bool(reevaluate_elite)
        self.gen = 0
        # The current generation: members (params) and their fom (None until told, or
        # failed); `asked[i]` once member i has been handed out.
        self.members: list[dict] = [self.space.sample(self.rng(INITIAL, i)) for i in range(population)]
        self.foms: list[float | None] = [None] * population
        self.asked: list[bool] = [False] * population
        self.done: list[bool] = [False] * population
        self._keys = [self.space.key(m, coerced=True) for m in self.members]

    @classmethod
    def create(cls, space: Any, *, direction: str, seed: int, trials: int | None, **options: Any) -> EvolutionSearcher:
        # A study asks for a number of trials: unless told, evolve as many generations as
        # that budget allows (each generation evaluates `population` points).
        if trials is not None and "generations" not in options:
            population = options.get("population", 10)
            if isinstance(population, int) and population > 0:
                options["generations"] = max(1, math.ceil(trials / population))
        searcher = cls(space, direction=direction, seed=seed, **options)
        searcher.trials = trials
        return searcher

    def notes(self) -> list[str]:
        trials = self.trials
        if trials is None or 3 * self.population <= trials:
            return []
        bred = max(0, min(trials, self.planned) - self.population)
        return [
            f"evolution(population={self.population}) with {trials} trials is one random generation and "
            f"{bred} bred points: too few generations to evolve; give it a population of at most a third of "
            f"the trials (population={max(2, trials // 3)}) or --trials {3 * self.population}"
        ]

    def options(self) -> dict:
        return {
            "population": self.population,
            "generations": self.generations,
            "reevaluate_elite": self.reevaluate_elite,
        }

    @property
    def generation(self) -> int:
        return self.gen

    @property
    def planned(self) -> int:
        return (
            self.population * self.generations
            if self.reevaluate_elite
            else (self.population + (self.generations - 1) * (self.population - elite_count(self.population)))
        )

    @property
    def exhausted(self) -> bool:
        return self.gen == self.generations - 1 and all(self.asked)

    def _propose(self, n: int) -> list[dict]:
        if all(self.done) and self.gen < self.generations - 1:
            self._breed()
        free = [i for i, asked in enumerate(self.asked) if not asked][:n]
        for i in free:
            self.asked[i] = True
        return [dict(self.members[i]) for i in free]

    def _on_told(self, point: dict, fom: float | None) -> None:
        key = self.space.key(point, coerced=True)
        for i, member_key in enumerate(self._keys):
            if self.asked[i] and not self.done[i] and member_key == key:
                self.foms[i], self.done[i] = fom, True
                return
        raise AssertionError("a told point that is not an asked member")  # Searcher.tell checked it

    # -- breeding ---------------------------------------------------------------------
    def _breed(self) -> None:
        """Generation gen+1 from the fully told generation gen."""
        g, rng = self.gen, self.rng(BREED, self.gen)
        losses = self.ranked(self.foms, self.members)
        order = sorted(range(self.population), key=lambda i: losses[i])  # stable: ties keep their order
        elite = order[: elite_count(self.population)]
        keep = not self.reevaluate_elite
        members = [dict(self.members[i]) for i in elite]
        foms: list[float | None] = [self.foms[i] if keep else None for i in elite]
        while len(members) < self.population:
            a, b = tournament(losses, rng), tournament(losses, rng)
            if losses[b] < losses[a]:  # A is the fitter parent (the first one on a tie)
                a, b = b, a
            members.append(self._child(self.members[a], self.members[b], g, rng))
            foms.append(None)
        self.members, self.foms = members, foms
        self.asked = [keep and i < len(elite) for i in range(self.population)]
        self.done = list(self.asked)
        self._keys = [self.space.key(m, coerced=True) for m in members]
        self.gen = g + 1

    def _child(self, parent_a: dict, parent_b: dict, g: int, rng: np.random.Generator) -> dict:
        child = {}
        for name, dim in self.space.items():
            if isinstance(dim, Categorical):
                value = parent_a[name]
                r1, r2 = rng.random(), rng.random()
                count = len(dim.categories)
                if count > 1 and r2 < mutation_fraction(r1, g, self.generations):
                    # one of the other categories, uniformly
                    value = dim.categories[(dim.index(value) + 1 + int(rng.integers(count - 1))) % count]
                child[name] = value
                continue
            if not isinstance(dim, (Real, Integer)):
                raise TypeError(f"evolution cannot breed a {type(dim).__name__} dimension ({name})")
            low, high = dim.search_bounds
            p = crossover(dim.to_search(parent_a[name]), dim.to_search(parent_b[name]), rng.random(), low, high)
            p = mutation(p, rng.random(), rng.random(), g, self.generations, low, high)
            child[name] = dim.from_search(p)
        return child

    # -- persistence ------------------------------------------------------------------
    def _extra_state(self) -> dict:
        return {
            "generation": self.gen,
            "members": [dict(m) for m in self.members],
            "foms": list(self.foms),
            "asked": list(self.asked),
            "done": list(self.done),
        }

    def _load_extra_state(self, extra: Mapping[str, Any]) -> None:
        self.gen = int(extra["generation"])
        self.members = [self.space.coerce(m) for m in extra["members"]]
        self.foms = [None if f is None else float(f) for f in extra["foms"]]
        self.asked = [bool(a) for a in extra["asked"]]
        self.done = [bool(d) for d in extra["done"]]
        self._keys = [self.space.key(m, coerced=True) for m in self.members]
