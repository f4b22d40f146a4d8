"""Population-based training (Jaderberg et al. 2017): the population's trials train at the
same time, one per group of ranks, and every `interval` epochs the worst are replaced by
copies of the best, with their hyper-parameters moved a little.

At each interval's end every member pauses with its checkpoint. Once all have, they are
ranked by their objective there; each member of the bottom `quantile` takes the training
state (weights, optimiser, rule state) of a member of the top `quantile` drawn at random
(exploit), and that member's hyper-parameters, each then multiplied by 1 + perturb or
1 - perturb (a category: its neighbour), or with probability `resample` drawn anew from
the space (explore). All then train on to the next interval's end. The copy goes from the
source's ranks to the receiver's as flat buffers over MPI (nbdist.roles.study), never
through files; a member's lineage and schedule are the study's trial events.

Only hyper-parameters that can change while a run trains may be in the space (learning
rates, momenta, a rule's own such as EASGD's elastic force, dropout): the copied weights
must fit the receiver's model and optimiser.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from nbdist.hpo.schedulers.base import (
    PAUSED,
    SCHEDULERS,
    Exchange,
    Scheduler,
    SchedulerError,
    Setting,
    Work,
)
from nbdist.hpo.space import Categorical, Integer, Real, Space

__all__ = ["PBT", "explore"]

EXPLORE = 7  # rng stream: the explore step of (boundary, member)


def explore(params: Mapping[str, Any], space: Space, perturb: float, resample: float, rng: np.random.Generator) -> dict:
    """`params` moved as PBT's explore step does."""
    moved = {}
    for name, dim in space.items():
        value = params[name]
        if rng.random() < resample:
            moved[name] = dim.sample(rng)
        elif isinstance(dim, Categorical):
            step = 1 if rng.random() < 0.5 else -1
            moved[name] = dim.categories[min(max(dim.index(value) + step, 0), len(dim.categories) - 1)]
        elif isinstance(dim, (Real, Integer)):
            factor = 1.0 + perturb if rng.random() < 0.5 else 1.0 - perturb
            moved[name] = dim.coerce_clip(float(value) * factor)
        else:
            moved[name] = value
    return moved


@SCHEDULERS.register
class PBT(Scheduler):
    """Population-based training: every interval, the worst take the best's state and perturb it."""

    name = "pbt"
    parameter_help = {
        "interval": "epochs between exploits",
        "quantile": "the fraction of the population replaced at each exploit (the bottom), and copied (the top)",
        "perturb": "explore: each hyper-parameter is multiplied by 1 + perturb or 1 - perturb",
        "resample": "explore: the probability that a hyper-parameter is drawn anew from the space instead",
    }
    pauses = True

    def __init__(self, interval: int = 1, quantile: float = 0.25, perturb: float = 0.2, resample: float = 0.25):
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise SchedulerError(f"{self.name} interval must be an integer >= 1 (epochs), got {interval!r}")
        for what, value, high in (("quantile", quantile, 0.5), ("perturb", perturb, 1.0), ("resample", resample, 1.0)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= high:
                raise SchedulerError(f"{self.name} {what} must be a number in [0, {high}], got {value!r}")
        if quantile <= 0:
            raise SchedulerError(f"{self.name} quantile must be above 0 (the fraction replaced), got {quantile!r}")
        self.interval, self.quantile = interval, float(quantile)
        self.perturb, self.resample = float(perturb), float(resample)
        self.members: list[int] = []
        self.boundary = 0  # the epoch the population last met at (0: starting)
        self.values: dict[int, float] = {}  # member -> its value at the next meeting
        self.queue: list[Work] = []
        self.done: set[int] = set()  # failed members, out of the population

    def bind(self, setting: Setting) -> None:
        super().bind(setting)
        if setting.in_process:
            raise SchedulerError(
                f"{self.name} copies a trial's training state from one group of ranks to another: run the study on "
                "ranks (python -m nbdist study under mpiexec, or %%distnn study on a cluster)"
            )
        population = setting.groups
        if population < 2 or math.floor(population * self.quantile) < 1:
            need = max(2, math.ceil(1 / self.quantile - 1e-9))
            raise SchedulerError(
                f"{self.name}(quantile={self.quantile:g}) replaces the bottom {self.quantile:.0%} of a population of "
                f"one trial per group: it needs at least {need} groups, this study has {population}; give --groups "
                f"{need} or a larger quantile (at most 0.5)"
            )
        if self.interval >= setting.epochs:
            raise SchedulerError(
                f"{self.name}(interval={self.interval}) with --epochs {setting.epochs} never exploits: give an "
                f"interval below --epochs"
            )
        fixed = [name for name in setting.space if not setting.changeable(name)]
        if fixed:
            raise SchedulerError(
                f"{self.name} changes hyper-parameters while the trials train, and {', '.join(map(repr, fixed))} "
                f"cannot change once a run has started (it shapes the model or the run's set-up); {self.name} can tune "
                f"{setting.changeable_help}: take {'them' if len(fixed) > 1 else 'it'} out of --space, or use "
                f"--scheduler asha"
            )

    def trials(self) -> int:
        return self.setting.groups

    def _pause_after(self, boundary: int) -> int | None:
        end = boundary + self.interval
        return end if end < self.setting.epochs else None

    def next(self, new_allowed: bool, epochs_left: float) -> Work | None:
        if len(self.members) < self.setting.groups:
            return Work(None, self._pause_after(0)) if new_allowed and self.interval <= epochs_left else None
        if not self.queue:
            live = [n for n in self.members if n not in self.done]
            meeting = self.boundary + self.interval
            if not live or meeting >= self.setting.epochs or any(n not in self.values for n in live):
                return None
            if len(live) * min(self.interval, self.setting.epochs - meeting) > epochs_left:
                return None
            self.queue = self._exploit(live, meeting)
            self.boundary, self.values = meeting, {}
        return self.queue.pop(0)

    def _exploit(self, live: list[int], boundary: int) -> list[Work]:
        order = sorted(live, key=lambda n: (-self.values[n] if self.setting.maximize else self.values[n], n))
        count = math.floor(len(order) * self.quantile)
        top, bottom = order[:count], order[len(order) - count :] if count else []
        works = {n: Work(n, self._pause_after(boundary)) for n in live}
        for n in bottom:
            rng = np.random.default_rng([self.setting.seed, EXPLORE, boundary, n])
            source = top[int(rng.integers(len(top)))]
            works[n].exchange = Exchange(source, boundary)
            works[n].tag = source
            works[source].send_to.append(n)
        return [works[n] for n in live]

    def params_for(self, work: Work, source_params: Mapping[str, Any]) -> dict[str, Any]:
        """The explored parameters of a member that takes `source_params`' trial's state."""
        assert work.exchange is not None and work.trial is not None
        rng = np.random.default_rng([self.setting.seed, EXPLORE, work.exchange.epoch, work.trial, 1])
        return explore(source_params, self.setting.space, self.perturb, self.resample, rng)

    def started(self, number: int, work: Work) -> None:
        if work.trial is None:
            self.members.append(number)

    def reached(self, number: int, epochs: int, value: float | None, outcome: str) -> None:
        if outcome == PAUSED and value is not None:
            self.values[number] = value
        elif outcome != PAUSED:
            self.done.add(number)

    def describe(self, number: int, epochs: int) -> str:
        return f"interval {epochs // self.interval} (epoch {epochs})"

    def state(self) -> dict[str, Any]:
        return {
            "members": list(self.members),
            "boundary": self.boundary,
            "values": {str(n): v for n, v in self.values.items()},
            "queue": [
                {
                    "trial": w.trial,
                    "pause_at": w.pause_at,
                    "exchange": [w.exchange.source, w.exchange.epoch] if w.exchange else None,
                    "send_to": list(w.send_to),
                }
                for w in self.queue
            ],
            "done": sorted(self.done),
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        self.members = [int(n) for n in state.get("members", [])]
        self.boundary = int(state.get("boundary", 0))
        self.values = {int(n): float(v) for n, v in state.get("values", {}).items()}
        self.queue = [
            Work(
                w["trial"],
                w["pause_at"],
                exchange=Exchange(*w["exchange"]) if w["exchange"] else None,
                send_to=list(w["send_to"]),
            )
            for w in state.get("queue", [])
        ]
        self.done = {int(n) for n in state.get("done", [])}
