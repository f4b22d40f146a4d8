"""Population-based bandits, PB2 (Parker-Holder et al. 2020): PBT's population and
exploit, with the explore step chosen by a GP bandit instead of at random.

The population trains and meets every `interval` epochs as under `pbt`; the bottom
`quantile` takes the training state of a top member (weights, optimiser and rule state,
copied group to group over MPI). Where PBT then moves the copied hyper-parameters at
random, PB2 picks them within the bounds of the space: a time-varying Gaussian process,
fitted to every member's recent intervals (where an interval started, with which
hyper-parameters, how fast the objective moved), predicts the objective's change over the
next interval, and the upper confidence bound picks the point (nbdist.hpo.schedulers.
pb2_model has the kernel and the acquisition). With few members the GP's model of the
whole population's history places each new point better than a random perturbation can:
PB2's case over PBT is small populations.

Every hyper-parameter of the space must be a range (real, log or int): PB2 chooses within
bounds. Ray Tune's `PB2` is the reference; what differs: an observation's context is the
interval's start (time, objective there), and the first meeting, with no interval yet
observed, draws uniformly within the bounds (the flat prior's tie-break).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from nbdist.hpo.schedulers.base import PAUSED, SCHEDULERS, SchedulerError, Setting, Work
from nbdist.hpo.schedulers.pbt import PBT
from nbdist.hpo.space import Integer, Real

__all__ = ["PB2"]

CHOOSE = 11  # rng stream: the choice of (boundary, member)


@SCHEDULERS.register
class PB2(PBT):
    """Population-based bandits: PBT's exploit, with a GP bandit choosing the new hyper-parameters."""

    name = "pb2"
    parameter_help = {
        "interval": "epochs between exploits",
        "quantile": "the fraction of the population replaced at each exploit (the bottom), and copied (the top)",
    }

    def __init__(self, interval: int = 1, quantile: float = 0.25):
        super().__init__(interval=interval, quantile=quantile, perturb=0.0, resample=0.0)
        self.params: dict[int, dict[str, Any]] = {}  # member -> what it trains with now
        self.starts: dict[int, list[float]] = {}  # member -> [epoch, value] its interval started from
        self.observations: list[list[float]] = []  # [t, r, y, *x] (pb2_model's rows)
        self.batch: dict[int, dict[str, Any]] = {}  # member -> its choice at the current meeting
        self.explained: dict[int, dict[str, Any]] = {}  # member -> how its last choice was made
        self.dims: dict[str, Real | Integer] = {}  # what PB2 chooses, in the space's order

    def bind(self, setting: Setting) -> None:
        super().bind(setting)
        self.dims = {name: dim for name, dim in setting.space.items() if isinstance(dim, (Real, Integer))}
        ranges = list(self.dims)
        if not ranges:
            raise SchedulerError(
                "pb2 chooses continuous hyper-parameters within their bounds, and --space has none: give at least "
                "one range that can change during a run (lr=log(1e-3,0.3), momentum=real(0.5,0.95)), or use "
                "--scheduler pbt"
            )
        unbounded = [f"{name}={setting.space[name]}" for name in setting.space if name not in ranges]
        if unbounded:
            verb = "have" if len(unbounded) > 1 else "has"
            raise SchedulerError(
                f"pb2 chooses each hyper-parameter within its bounds, and {', '.join(unbounded)} {verb} no bounds "
                f"(a category): give it as a range (real(low,high), log(low,high) or int(low,high)), take it out "
                f"of --space, or use --scheduler pbt"
            )

    # -- the population's history ----------------------------------------------------------
    def started(self, number: int, work: Work) -> None:
        super().started(number, work)
        if work.trial is None and work.params is not None:
            self.params[number] = dict(work.params)

    def reached(self, number: int, epochs: int, value: float | None, outcome: str) -> None:
        super().reached(number, epochs, value, outcome)
        start, params = self.starts.get(number), self.params.get(number)
        if outcome != PAUSED or value is None or start is None or params is None or epochs <= start[0]:
            return
        gain = (self._oriented(value) - self._oriented(start[1])) / (epochs - start[0])
        t = start[0] / self.setting.epochs
        self.observations.append([t, self._oriented(start[1]), gain, *self._unit(params)])

    def _oriented(self, value: float) -> float:
        return value if self.setting.maximize else -value

    def _unit(self, params: Mapping[str, Any]) -> list[float]:
        out = []
        for name, dim in self.dims.items():
            low, high = dim.search_bounds
            out.append(float(np.clip((dim.to_search(params[name]) - low) / (high - low), 0.0, 1.0)))
        return out

    def _from_unit(self, x: np.ndarray, base: Mapping[str, Any]) -> dict[str, Any]:
        params = dict(base)
        for u, (name, dim) in zip(x, self.dims.items(), strict=True):
            low, high = dim.search_bounds
            params[name] = dim.from_search(low + float(u) * (high - low))
        return params

    # -- the meeting -----------------------------------------------------------------------
    def _exploit(self, live: list[int], boundary: int) -> list[Work]:
        works = super()._exploit(live, boundary)
        self.batch = {}
        for work in works:
            assert work.trial is not None
            origin = work.exchange.source if work.exchange is not None else work.trial
            # A receiver starts the next interval from the state, and so the value, it takes.
            self.starts[work.trial] = [boundary, self.values[origin]]
        return works

    def params_for(self, work: Work, source_params: Mapping[str, Any]) -> dict[str, Any]:
        """The hyper-parameters PB2's bandit chooses for a member taking `source_params`' state."""
        assert work.exchange is not None and work.trial is not None
        number, boundary = work.trial, work.exchange.epoch
        if number in self.batch:  # asked again (a resume): the same choice
            return dict(self.batch[number])
        from nbdist.hpo.schedulers.pb2_model import choose  # scikit-learn: only when first needed

        start = self.starts.get(number, [boundary, 0.0])
        seed = int(np.random.default_rng([self.setting.seed, CHOOSE, boundary, number]).integers(2**31 - 1))
        choice = choose(
            self.observations,
            (boundary / self.setting.epochs, self._oriented(start[1])),
            [self._unit(p) for p in self.batch.values()],
            len(self.dims),
            seed,
        )
        params = self._from_unit(choice.x, source_params)
        self.batch[number] = params
        self.params[number] = params
        self.explained[number] = choice.how
        return dict(params)

    def explore_note(self, work: Work) -> dict[str, Any]:
        return dict(self.explained.get(work.trial, {})) if work.trial is not None else {}

    # -- saved with the study ----------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {
            **super().state(),
            "params": {str(n): p for n, p in self.params.items()},
            "starts": {str(n): s for n, s in self.starts.items()},
            "observations": self.observations,
            "batch": {str(n): p for n, p in self.batch.items()},
            "explained": {str(n): h for n, h in self.explained.items()},
        }

    def load_state(self, state: Mapping[str, Any]) -> None:
        super().load_state(state)
        self.params = {int(n): dict(p) for n, p in state.get("params", {}).items()}
        self.starts = {int(n): [float(s[0]), float(s[1])] for n, s in state.get("starts", {}).items()}
        self.observations = [[float(v) for v in row] for row in state.get("observations", [])]
        self.batch = {int(n): dict(p) for n, p in state.get("batch", {}).items()}
        self.explained = {int(n): dict(h) for n, h in state.get("explained", {}).items()}
