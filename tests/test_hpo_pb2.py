"""PB2 on its own (no ranks): a population whose objective improves fastest in one region
of the hyper-parameters, driven through the scheduler's interface as the runner drives it;
PB2's bandit moves the replaced members there, within the bounds, the same with the same
seed and after its state is saved and loaded; set-ups it cannot serve are one clear error.
The study on real ranks is in test_hpo_mpi.py."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from nbdist.hpo import SCHEDULERS, SchedulerError, optimize
from nbdist.hpo.schedulers import PAUSED, PB2, Setting
from nbdist.hpo.space_input import parse_space
from nbdist.specs import SpecError

SPACE = parse_space("lr=log(1e-4,1e-1) momentum=real(0.5,0.99)")
FASTEST = {"lr": 1e-2, "momentum": 0.9}  # where the loss falls fastest


def _unit(params):
    """The point in PB2's coordinates (log for lr), in [0, 1]^2."""
    return np.array([math.log(params["lr"] / 1e-4) / math.log(1e-1 / 1e-4), (params["momentum"] - 0.5) / (0.99 - 0.5)])


def _distance(params) -> float:
    return float(np.linalg.norm(_unit(params) - _unit(FASTEST)))


def _fall(params) -> float:
    """The loss's fall over one epoch: a bump around FASTEST."""
    return 0.1 * math.exp(-(_distance(params) ** 2) / (2 * 0.2**2))


def _setting(**changes) -> Setting:
    values = {"epochs": 10, "groups": 8, "trials": 8, "space": SPACE, "maximize": False, "seed": 0}
    return Setting(**{**values, "changeable": lambda name: True, **changes})


class Population:
    """Members trained as the runner would, with a synthetic loss: each epoch it falls by
    `_fall(params)`; a receiver takes its source's loss (its weights) with the state."""

    def __init__(self, seed: int, groups: int = 8):
        self.pb2 = PB2(interval=1, quantile=0.25)
        self.pb2.bind(_setting(seed=seed, groups=groups, trials=groups))
        draw = np.random.default_rng(100)  # the searcher's initial points: the same for every seed
        self.params, self.loss = {}, {}
        for number in range(groups):
            work = self.pb2.next(True, math.inf)
            work.params = SPACE.sample(draw)
            self.pb2.started(number, work)
            self.params[number], self.loss[number] = work.params, 1.0
        self.epoch = 0

    def meet(self) -> list[tuple[dict, dict]]:
        """Train one epoch, meet: each replaced member's (new parameters, how PB2 chose)."""
        self.epoch += 1
        for number, params in self.params.items():
            self.loss[number] -= _fall(params)
            self.pb2.reached(number, self.epoch, self.loss[number], PAUSED)
        works = [self.pb2.next(False, math.inf) for _ in self.params]
        met, chosen = dict(self.loss), []
        for work in works:
            self.pb2.started(work.trial, work)
            if work.exchange is not None:
                source = work.exchange.source
                self.params[work.trial] = self.pb2.params_for(work, self.params[source])
                self.loss[work.trial] = met[source]
                chosen.append((self.params[work.trial], self.pb2.explore_note(work)))
        return chosen


def _in_bounds(params) -> bool:
    return 1e-4 <= params["lr"] <= 1e-1 and 0.5 <= params["momentum"] <= 0.99


def test_pb2_moves_the_replaced_members_to_where_the_objective_improves_fastest():
    population = Population(seed=0)
    first = population.meet()  # no interval observed yet: drawn within the bounds
    modelled = population.meet() + population.meet()
    assert [how["acquisition"] for _, how in first] == ["uniform", "uniform"]
    assert [how["acquisition"] for _, how in modelled] == ["ucb"] * 4
    assert all(_in_bounds(params) for params, _ in first + modelled)
    # A draw from the space lands, on average, about 0.45 from the fastest point: PB2's
    # choices, fitted to the population's intervals, land much nearer.
    draws = np.random.default_rng(7)
    uniform = np.mean([_distance(SPACE.sample(draws)) for _ in range(2000)])
    chosen = np.mean([_distance(params) for params, _ in modelled])
    assert chosen < 0.6 * uniform, (chosen, uniform, modelled)
    # The two members replaced at one meeting are not sent to the same point.
    assert _distance(modelled[0][0]) != _distance(modelled[1][0])
    assert all(how["observations"] >= 8 and how["sigma"] >= 0 for _, how in modelled)


def test_pb2_chooses_the_same_with_the_same_seed_and_after_a_resume():
    one, two, other = Population(seed=3), Population(seed=3), Population(seed=4)
    assert one.meet() == two.meet() != other.meet()
    assert one.meet() == two.meet()
    # The state as the study saves it (JSON), loaded into a new scheduler: the same choices.
    restored = PB2(interval=1, quantile=0.25)
    restored.bind(_setting(seed=3))
    restored.load_state(json.loads(json.dumps(one.pb2.state())))
    assert restored.state() == one.pb2.state()
    two.pb2 = restored
    assert one.meet() == two.meet()


@pytest.mark.parametrize(
    ("spec", "setting", "message"),
    [
        (
            "pb2",
            {"groups": 2},
            r"pb2\(quantile=0.25\) replaces the bottom 25% .* it needs at least 4 groups, this study has 2",
        ),
        ("pb2(quantile=0.5)", {"groups": 1}, r"it needs at least 2 groups, this study has 1"),
        (
            "pb2",
            {"space": parse_space("opt=cat(adam,sgd)")},
            r"pb2 chooses continuous hyper-parameters .* --space has none",
        ),
        (
            "pb2",
            {"space": parse_space("lr=log(1e-3,1) opt=cat(adam,sgd)")},
            r"opt=cat\(adam,sgd\) has no bounds \(a category\): give it as a range",
        ),
        (
            "pb2",
            {"changeable": lambda name: name == "lr", "space": parse_space("lr=log(1e-3,1) hidden=int(8,64)")},
            r"pb2 changes hyper-parameters while the trials train, and 'hidden' cannot change",
        ),
        ("pb2(interval=10)", {}, r"pb2\(interval=10\) with --epochs 10 never exploits"),
        ("pb2", {"in_process": True}, r"pb2 copies a trial's training state .* run the study on ranks"),
    ],
)
def test_pb2_refuses_what_it_cannot_serve_with_one_clear_error(spec, setting, message):
    with pytest.raises(SchedulerError, match=message):
        SCHEDULERS.build(spec).bind(_setting(**setting))


def test_pb2_is_spelled_as_the_other_schedulers_and_names_its_parameters():
    assert SCHEDULERS.build("pb2(interval=2, quantile=0.5)").interval == 2
    with pytest.raises(SpecError, match=r"perturb.*interval, quantile"):
        SCHEDULERS.build("pb2(perturb=0.2)")
    with pytest.raises(SchedulerError, match=r"pb2 quantile must be a number in \[0, 0.5\], got 0.7"):
        SCHEDULERS.build("pb2(quantile=0.7)")
    # The API takes the same spelling, and a function's study has no ranks to copy between.
    with pytest.raises(SchedulerError, match=r"run the study on ranks"):
        optimize(lambda p: p["lr"], space="lr=log(1e-3,1)", scheduler="pb2", say=lambda _line: None)
