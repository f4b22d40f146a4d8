"""The ask/tell interface of every searcher, without a cluster: several points at once,
results told in any order, failures, the registry, and the state round trip (a restored
searcher continues exactly as the original would). Evolution's formulas against values
computed by hand."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from nbdist.errors import UserError
from nbdist.hpo import (
    SEARCHERS,
    BayesSearcher,
    EvolutionSearcher,
    GridSearcher,
    RandomSearcher,
    SearcherError,
    make_searcher,
    restore_searcher,
)
from nbdist.hpo.evolution import crossover, elite_count, mutation, mutation_fraction, tournament
from nbdist.hpo.functions import BRANIN_SPACE, branin
from nbdist.specs import SpecError

MIXED = "lr=log(1e-4,1e-1) hidden=int(16,256) optimizer=cat(adam,sgd,rmsprop)"


def quadratic(p: dict) -> float:
    """A made-up figure of merit on MIXED, lowest at lr=1e-2, hidden=100, sgd."""
    return (
        (math.log10(p["lr"]) + 2) ** 2
        + ((p["hidden"] - 100) / 100) ** 2
        + {"adam": 0.5, "sgd": 0.0, "rmsprop": 1.0}[p["optimizer"]]
    )


# Cheap settings for the tests that exercise the interface rather than the search itself.
FAST = {
    "bayes": "bayes(initial_points=3, n_points=200)",
    "evolution": "evolution(population=4, generations=3)",
    "grid": "grid(points=3)",
    "random": "random",
    "optuna": "optuna(sampler='tpe', n_startup_trials=3)",
}


def searcher(name: str, seed: int = 0, space: str = MIXED, **kw):
    return make_searcher(FAST[name], space, seed=seed, **kw)


# ----------------------------------------------------------------------------- registry
def test_registry_and_specs():
    assert set(SEARCHERS) == {"bayes", "evolution", "grid", "optuna", "random"}
    s = make_searcher("evolution(population=6, generations=2)", MIXED, direction="maximize", seed=3)
    assert isinstance(s, EvolutionSearcher) and (s.population, s.generations, s.seed) == (6, 2, 3)
    assert s.direction == "maximize" and s.planned == 12
    # a study's trial budget sets evolution's generations unless they are given
    assert make_searcher("evolution(population=8)", MIXED, trials=30).generations == 4
    assert make_searcher("evolution(population=8, generations=2)", MIXED, trials=30).generations == 2
    assert isinstance(make_searcher("bayes", MIXED, trials=30), BayesSearcher)
    with pytest.raises(
        SpecError,
        match=r"unknown searcher 'bayesian' \(did you mean 'bayes'\?\); "
        r"choose one of: bayes, evolution, grid, optuna, random",
    ):
        make_searcher("bayesian", MIXED)
    with pytest.raises(
        SpecError,
        match="searcher 'evolution' takes no parameter 'pop'; it takes: direction, "
        "seed, population, generations, reevaluate_elite",
    ):
        make_searcher("evolution(pop=4)", MIXED)
    for spec, message in [
        ("evolution(population=1)", "evolution population must be an integer >= 2, got 1"),
        ("bayes(acq_func='gp_hedge')", "bayes acq_func must be one of EI, LCB, PI, got 'gp_hedge'"),
        ("bayes(noise=0)", "bayes noise must be 'gaussian' .* or a positive variance, got 0"),
        ("grid(points=0)", "grid points must be a positive integer, got 0"),
    ]:
        with pytest.raises(SearcherError, match=message) as err:
            make_searcher(spec, MIXED)
        assert isinstance(err.value, UserError)
    with pytest.raises(SearcherError, match="direction must be 'minimize' or 'maximize', got 'min'"):
        make_searcher("random", MIXED, direction="min")


# ----------------------------------------------------------------------------- the interface
@pytest.mark.parametrize("name", sorted(FAST))
def test_ask_many_tell_out_of_order(name):
    s = searcher(name)
    points = s.ask(3)
    assert len(points) == 3 and len({json.dumps(p, sort_keys=True) for p in points}) == 3
    for p in points:
        assert list(p) == ["lr", "hidden", "optimizer"]
        assert type(p["lr"]) is float and type(p["hidden"]) is int and p["optimizer"] in ("adam", "sgd", "rmsprop")
        assert 1e-4 <= p["lr"] <= 1e-1 and 16 <= p["hidden"] <= 256
    s.tell(points[2], quadratic(points[2]))
    s.tell(dict(reversed(list(points[0].items()))), quadratic(points[0]))  # any key order
    more = s.ask(1)
    assert len(more) == 1 and more[0] not in points
    s.tell(more[0], None)  # a failed trial
    s.tell(json.loads(json.dumps(points[1])), float("nan"))  # through JSON, as from a store; NaN = failed
    assert s.pending == []
    assert [f for _, f in s.told] == [quadratic(points[2]), quadratic(points[0]), None, None]
    best_params, best = s.best
    assert best == min(quadratic(points[0]), quadratic(points[2])) and quadratic(best_params) == best
    with pytest.raises(SearcherError, match="it was not asked, or was told already"):
        s.tell(points[0], 1.0)
    with pytest.raises(SearcherError, match="parameter 'hidden': 1000 is outside"):
        s.tell({**points[0], "hidden": 1000}, 1.0)
    with pytest.raises(SearcherError, match="ask.n. needs a positive integer n, got 0"):
        s.ask(0)
    with pytest.raises(SearcherError, match="the figure of merit must be a number or None"):
        p = s.ask(1)[0]
        s.tell(p, "0.5")


def drive_with_pending(s, steps: int, seed: int) -> list[dict]:
    """A run with results told out of order and points left pending: asks of 1 to 3
    points, a random share of the pending ones told (some as failures) after each ask."""
    rng = np.random.default_rng(seed)
    asked = []
    for _ in range(steps):
        points = s.ask(int(rng.integers(1, 4)))
        asked += points
        chosen = [s.pending[i] for i in rng.permutation(len(s.pending))[: int(rng.integers(0, len(s.pending) + 1))]]
        for p in chosen:
            s.tell(p, None if rng.random() < 0.1 else quadratic(p))
    return asked


@pytest.mark.parametrize("name", sorted(FAST))
def test_state_round_trip_continues_exactly(name):
    original = searcher(name, seed=5)
    drive_with_pending(original, 3, seed=1)
    blob = json.dumps(original.state(), allow_nan=False)
    restored = restore_searcher(json.loads(blob))
    assert type(restored) is type(original) and restored.state() == original.state()
    # the same calls from here on give the same points
    assert drive_with_pending(restored, 3, seed=2) == drive_with_pending(original, 3, seed=2)
    assert json.dumps(restored.state()) == json.dumps(original.state())
    assert restored.pending == original.pending and restored.told == original.told


@pytest.mark.parametrize("sampler", ["tpe", "cmaes", "gp", "nsga2", "qmc", "random"])
def test_every_optuna_sampler_restored_continues_exactly(sampler):
    """QMC's place in its sequence is a note on Optuna's study, not on its trials: restored
    without it, a QMC searcher proposed its first point again (and a study that reloads its
    searcher from the store between asks failed on the repeated point)."""
    original = make_searcher(f"optuna(sampler='{sampler}')", MIXED, seed=5)
    drive_with_pending(original, 3, seed=1)
    restored = restore_searcher(json.loads(json.dumps(original.state(), allow_nan=False)))
    assert drive_with_pending(restored, 3, seed=2) == drive_with_pending(original, 3, seed=2)


def test_state_errors():
    state = searcher("random").state()
    with pytest.raises(SpecError, match="unknown searcher 'anneal'"):
        restore_searcher({**state, "searcher": "anneal"})
    with pytest.raises(SearcherError, match="not a random searcher state of version 1"):
        restore_searcher({**state, "version": 0})


@pytest.mark.parametrize("name", sorted(FAST))
def test_seeds_make_searchers_reproducible(name):
    runs = [drive_with_pending(searcher(name, seed=s), 3, seed=0) for s in (7, 7, 8)]
    assert runs[0] == runs[1]
    if name != "grid":  # the grid has no randomness
        assert runs[0] != runs[2]


@pytest.mark.parametrize("name", ["evolution", "bayes"])
def test_maximize_is_minimize_of_the_negative(name):
    mins, maxs = searcher(name, seed=2), searcher(name, seed=2, direction="maximize")
    for _ in range(4):
        a, b = mins.ask(2), maxs.ask(2)
        assert a == b
        for p in a:
            mins.tell(p, quadratic(p))
            maxs.tell(p, -quadratic(p))
    assert maxs.best == (mins.best[0], -mins.best[1])


# ----------------------------------------------------------------------------- random, grid
def test_random_points_do_not_depend_on_how_they_are_asked():
    one, two = RandomSearcher(MIXED, seed=4), RandomSearcher(MIXED, seed=4)
    assert one.ask(3) + one.ask(2) == two.ask(1) + two.ask(4)
    assert not one.exhausted and one.planned is None


def test_grid_enumerates_every_combination_once():
    s = GridSearcher("x=real(0,1) n=int(1,2) act=cat(relu,tanh)", points=3)
    assert s.planned == 12
    points = s.ask(5) + s.ask(5) + s.ask(5)
    assert len(points) == 12 and s.exhausted and s.ask(3) == []
    assert points[:3] == [
        {"x": 0.0, "n": 1, "act": "relu"},
        {"x": 0.0, "n": 1, "act": "tanh"},
        {"x": 0.0, "n": 2, "act": "relu"},
    ]
    assert {(p["x"], p["n"], p["act"]) for p in points} == {
        (x, n, a) for x in (0.0, 0.5, 1.0) for n in (1, 2) for a in ("relu", "tanh")
    }


# ----------------------------------------------------------------------------- evolution
def test_crossover_formula_by_hand():
    # p_child = r (p_A - p_B) + p_A, A the fitter parent
    assert crossover(2.0, 1.0, 0.25, 0.0, 10.0) == pytest.approx(2.25)
    assert crossover(1.0, 2.0, 0.25, 0.0, 10.0) == pytest.approx(0.75)  # away from B, whichever side
    assert crossover(4.0, 4.0, 0.9, 0.0, 10.0) == 4.0  # same parents: the parent itself
    assert crossover(9.0, 1.0, 0.5, 0.0, 10.0) == 10.0  # 13 clipped to the upper bound
    assert crossover(1.0, 9.0, 0.5, 0.0, 10.0) == 0.0  # -3 clipped to the lower bound


def test_mutation_formula_by_hand():
    # m = (1 - r1^((1 - g/G)^3)) * (p_max - p if r2 > 0.5 else p_low - p)
    # g=1, G=2: exponent (1/2)^3 = 0.125; r1 = 0.5: 1 - 0.5^0.125 = 0.0829960
    assert mutation_fraction(0.5, 1, 2) == pytest.approx(0.08299596)
    assert mutation(2.0, 0.5, 0.7, 1, 2, 0.0, 10.0) == pytest.approx(2.0 + 0.08299596 * 8.0)  # 2.66397
    assert mutation(2.0, 0.5, 0.3, 1, 2, 0.0, 10.0) == pytest.approx(2.0 - 0.08299596 * 2.0)  # 1.83401
    assert mutation(2.0, 0.5, 0.5, 1, 2, 0.0, 10.0) == pytest.approx(1.83401, abs=1e-5)  # r2 = 0.5 goes low
    # g=0: exponent 1, m = (1 - r1) * distance: r1 = 0.25 moves 3/4 of the way
    assert mutation(2.0, 0.25, 0.9, 0, 4, 0.0, 10.0) == pytest.approx(2.0 + 0.75 * 8.0)
    # g=3, G=4: exponent 1/64; r1 = 0.2: 1 - 0.2^(1/64) = 0.0248339
    assert mutation(6.0, 0.2, 0.1, 3, 4, -4.0, 6.0) == pytest.approx(6.0 - 0.0248339 * 10.0, abs=1e-6)
    # the last generation does not mutate
    assert mutation(2.0, 0.3, 0.9, 5, 5, 0.0, 10.0) == 2.0


def test_tournament_and_elite():
    assert [elite_count(p) for p in (2, 4, 5, 10, 12, 20)] == [1, 1, 1, 2, 2, 4]
    rng = np.random.default_rng(0)
    losses = [3.0, 1.0, 2.0, math.inf]
    wins = np.bincount([tournament(losses, rng) for _ in range(6000)], minlength=4) / 6000
    # each pair of distinct members is drawn with probability 1/6; the fitter one wins:
    # member 1 wins its 3 pairs, member 2 two, member 0 one, member 3 (failed) none
    np.testing.assert_allclose(wins, [1 / 6, 3 / 6, 2 / 6, 0], atol=0.02)


def test_evolution_generations():
    s = EvolutionSearcher(MIXED, seed=1, population=5, generations=3)
    assert s.planned == 15 and elite_count(5) == 1
    first = s.ask(3) + s.ask(3)  # one generation at most
    assert len(first) == 5 and s.generation == 0
    assert s.ask(2) == []  # the generation must be told before the next is bred
    for p in reversed(first):
        s.tell(p, quadratic(p))
    second = s.ask(10)
    assert len(second) == 5 and s.generation == 1
    fittest = min(first, key=quadratic)
    assert second[0] == fittest  # the 20% fittest are carried over, and evaluated again
    for p in second:
        assert type(p["hidden"]) is int and p["optimizer"] in ("adam", "sgd", "rmsprop")
        s.tell(p, quadratic(p))
    third = s.ask(5)
    assert s.generation == 2 and s.exhausted and len(third) == 5
    assert min(map(quadratic, third)) <= min(map(quadratic, second)) <= min(map(quadratic, first))


def test_evolution_can_keep_the_elite_fitness():
    s = EvolutionSearcher(MIXED, seed=1, population=5, generations=3, reevaluate_elite=False)
    assert s.planned == 5 + 2 * 4
    for p in s.ask(5):
        s.tell(p, quadratic(p))
    second = s.ask(5)
    assert len(second) == 4 and s.generation == 1  # the elite is not asked again


def test_evolution_children_follow_the_formulas():
    """One bred child recomputed by hand from the same random draws."""
    space = "x=real(-2,6) n=int(1,9) lr=log(1e-4,1e-1)"
    s = EvolutionSearcher(space, seed=3, population=2, generations=4)
    parents = s.ask(2)
    foms = [1.0, 2.0]
    for p, f in zip(parents, foms, strict=True):
        s.tell(p, f)
    child = s.ask(2)[1]  # [0] is the carried-over elite
    rng = s.rng(3, 0)  # the breeding stream of generation 0
    a, b = tournament([1.0, 2.0], rng), tournament([1.0, 2.0], rng)
    a, b = (b, a) if foms[b] < foms[a] else (a, b)
    bounds = {"x": (-2, 6), "n": (1, 9), "lr": (math.log(1e-4), math.log(1e-1))}
    expected = {}
    for name, (low, high) in bounds.items():
        to = math.log if name == "lr" else float
        p = crossover(to(parents[a][name]), to(parents[b][name]), rng.random(), low, high)
        p = mutation(p, rng.random(), rng.random(), 0, 4, low, high)
        expected[name] = {"x": p, "n": int(math.floor(p + 0.5)), "lr": math.exp(p)}[name]
    assert child["x"] == pytest.approx(expected["x"]) and child["n"] == expected["n"]
    assert child["lr"] == pytest.approx(expected["lr"])
    assert type(child["n"]) is int


def test_evolution_categories_settle():
    """A child takes the fitter parent's category, which mutates half the time in the
    first generation and rarely in the last ones."""
    s = EvolutionSearcher("act=cat(a,b,c,d)", seed=0, population=400, generations=8)

    def generation() -> list[dict]:
        points = s.ask(400)
        for p in points:
            s.tell(p, 0.0 if p["act"] == "a" else 1.0)
        return points

    q = np.mean([p["act"] != "a" for p in generation()])
    children = generation()[elite_count(400) :]
    # a tournament winner is not 'a' when both members drawn are not (about q^2), the
    # fitter parent A when both winners are not: (q^2)^2; then P(switch) = P(r2 < 1 - r1) = 1/2
    a_not = (q**2) ** 2
    expected = (1 - a_not) * 0.5 + a_not * 0.5 / 3
    assert np.mean([c["act"] == "a" for c in children]) == pytest.approx(expected, abs=0.06)
    for _ in range(6):
        last = generation()
    assert s.generation == 7 and np.mean([p["act"] == "a" for p in last]) > 0.97


# ----------------------------------------------------------------------------- bayes
def test_bayes_asks_distinct_points_around_pending_ones():
    s = BayesSearcher(BRANIN_SPACE, seed=0, initial_points=4)
    design = s.ask(4)  # the Latin hypercube: one point per quarter of each axis
    for axis, (low, high) in (("x1", (-5, 10)), ("x2", (0, 15))):
        assert sorted(int((p[axis] - low) / (high - low) * 4) for p in design) == [0, 1, 2, 3]
    for p in design[:3]:
        s.tell(p, branin(p))
    # one design point still pending: the model's points avoid it and each other
    model = s.ask(3)
    near = [min(abs(q["x1"] - p["x1"]) + abs(q["x2"] - p["x2"]) for p in design + model if p is not q) for q in model]
    assert min(near) > 0.05
    assert s.theta is not None and len(s.theta) == 4  # amplitude, two length scales, noise


def test_bayes_failures_and_no_result_yet():
    s = BayesSearcher(BRANIN_SPACE, seed=1, initial_points=2)
    first = s.ask(2)
    assert len(s.ask(2)) == 2  # nothing told yet: random points, no model
    for p in first:
        s.tell(p, None)
    assert len(s.ask(1)) == 1  # only failures: still random
    assert s.theta is None
