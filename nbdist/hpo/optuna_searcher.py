"""Optuna's samplers as nbdist searchers, through Optuna's ask/tell interface.

    --searcher "optuna(sampler=tpe)"                TPE (Bergstra et al. 2011), Optuna's default
    --searcher "optuna(sampler=tpe, multivariate=True, n_startup_trials=5)"
    --searcher "optuna(sampler=cmaes)"              CMA-ES (numbers only: categories are drawn at random)
    --searcher "optuna(sampler=gp)"                 Optuna's Gaussian process with log-EI
    --searcher "optuna(sampler=nsga2)"              NSGA-II: multi-objective studies (nsga3: NSGA-III)
    --searcher "optuna(sampler=qmc)"                quasi-Monte Carlo (Sobol) points
    --searcher "optuna(sampler=random)"

The sampler's keywords besides `sampler` go to its constructor; the seed is the study's.

The study's trials live in nbdist's run store, as every searcher's do: its state is the
points asked and told, in the order asked (with their values, the epoch a stopped trial
stopped at, what the sampler noted on each trial and on the study), all JSON. A resumed
searcher builds an in-memory Optuna study again from them: each told trial is added as it
ended (complete, pruned at its epoch with its value there, or failed), each pending one is
enqueued and asked again, and the study's notes are set as they were (QMC's place in its
sequence). The sampler is made afresh for every point, seeded from the study's seed and
the point's place, so that a restored searcher proposes what the original would have
(exactly so for TPE, GP, QMC and random sampling; CMA-ES and NSGA-II keep their state in
what they noted on the told trials, which comes back too). A trial that was stopped at a
rung and later promoted and finished is added again, complete, with its final value.

Optuna is imported only when this searcher is used (`pip install nbdist[hpo]`).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from nbdist.hpo.searcher import DIRECTIONS, SEARCHERS, Searcher, SearcherError
from nbdist.hpo.space import Categorical, Integer, Real
from nbdist.specs import unknown_name

__all__ = ["OptunaSearcher", "SAMPLERS"]

# sampler name -> the class's name in optuna.samplers
SAMPLERS = {
    "tpe": "TPESampler",
    "cmaes": "CmaEsSampler",
    "gp": "GPSampler",
    "nsga2": "NSGAIISampler",
    "nsga3": "NSGAIIISampler",
    "qmc": "QMCSampler",
    "random": "RandomSampler",
}
SAMPLE = 11  # rng stream: the sampler's seed for the k-th point
# Samplers whose state lives in what they note on the trials (CMA-ES's optimiser, NSGA's
# generations): those notes are kept with the told points.
KEEPS_STATE_ON_TRIALS = ("cmaes", "nsga2", "nsga3")


def _optuna() -> Any:
    try:
        import optuna
    except ImportError:  # pragma: no cover - installed with nbdist[hpo]
        raise SearcherError("searcher optuna needs the optuna package: pip install 'nbdist[hpo]'") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna


@SEARCHERS.register
class OptunaSearcher(Searcher):
    """Optuna's samplers (TPE, CMA-ES, GP, NSGA-II/III, QMC) through Optuna's ask/tell."""

    name = "optuna"
    parameter_help = {
        "sampler": "Optuna's sampler: " + ", ".join(SAMPLERS) + "; other keywords go to its constructor",
        "directions": "one direction per objective (a study of several objectives sets them)",
    }
    multi_objective = True  # NSGA-II/III, TPE, GP and random take several objectives
    takes_values = True  # told a list of values in a multi-objective study

    def __init__(
        self,
        space: Any,
        *,
        direction: str = "minimize",
        seed: int = 0,
        sampler: str = "tpe",
        directions: Sequence[str] | None = None,
        **sampler_options: Any,
    ):
        super().__init__(space, direction=direction, seed=seed)
        if not isinstance(sampler, str) or sampler not in SAMPLERS:
            raise unknown_name("sampler", str(sampler), list(SAMPLERS))
        given = list(directions) if directions else [direction]
        if any(d not in DIRECTIONS for d in given):
            raise SearcherError(f"directions must each be 'minimize' or 'maximize', got {given!r}")
        self.sampler, self.sampler_options, self.directions = sampler, dict(sampler_options), given
        self._values: dict[str, list[float]] = {}  # a multi-objective point's values, by space key
        self._order: list[str] = []  # the space keys of the points, in the order asked
        self._notes: dict[str, dict[str, Any]] = {}  # what the sampler noted on each told trial
        self._trials: dict[str, list[Any]] = {}  # pending point -> its Optuna trials
        self._study = self._new_study(self.seed)

    def use_directions(self, directions: Sequence[str]) -> None:
        """A multi-objective study's directions, one per objective (before the first ask)."""
        if list(directions) != self.directions:
            if self.pending or self.told:
                raise SearcherError("the directions of an optuna searcher are set before its first point")
            self.directions = list(directions)
            self._study = self._new_study(self.seed)

    def _new_study(self, seed: int) -> Any:
        return _optuna().create_study(sampler=self._new_sampler(seed), directions=self.directions)

    def _new_sampler(self, seed: int) -> Any:
        cls = getattr(_optuna().samplers, SAMPLERS[self.sampler])
        if self.sampler == "qmc":
            seed = self.seed  # its sequence is the study's, indexed by trial number
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Optuna's "experimental feature" warnings
            try:
                return cls(seed=seed, **self.sampler_options)
            except TypeError as exc:
                raise SearcherError(f"optuna sampler {self.sampler}: {exc}") from None

    def _distributions(self) -> dict[str, Any]:
        dists = _optuna().distributions
        out = {}
        for name, dim in self.space.items():
            if isinstance(dim, Categorical):
                out[name] = dists.CategoricalDistribution(list(dim.categories))
            elif isinstance(dim, Integer):
                out[name] = dists.IntDistribution(int(dim.low), int(dim.high), log=dim.log)
            elif isinstance(dim, Real):
                out[name] = dists.FloatDistribution(float(dim.low), float(dim.high), log=dim.log)
        return out

    # -- asking and telling -------------------------------------------------------------
    def _propose(self, n: int) -> list[dict]:
        distributions = self._distributions()
        points = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(n):
                self._study.sampler = self._new_sampler(int(self.rng(SAMPLE, len(self._order)).integers(2**31 - 1)))
                trial = self._study.ask(distributions)
                point = self.space.coerce(trial.params)
                key = self.space.key(point, coerced=True)
                self._trials.setdefault(key, []).append(trial)
                self._order.append(key)
                points.append(point)
        return points

    def tell(self, params: Mapping[str, Any], fom: Any, *, stopped_at: int | None = None) -> None:
        values = [float(v) for v in fom] if isinstance(fom, (list, tuple)) else None
        if values is not None and len(values) != len(self.directions):
            raise SearcherError(f"told {len(values)} values for {len(self.directions)} objectives")
        try:
            key = self.space.key(params)
        except ValueError:
            super().tell(params, fom, stopped_at=stopped_at)  # the base class's error
            return
        again = key not in self._pending_keys  # a stopped trial told again (promoted, then finished)
        super().tell(params, values[0] if values else fom, stopped_at=stopped_at)
        if values is not None:
            self._values[key] = values
        point, told = next((p, f) for p, f in reversed(self.told) if self.space.key(p, coerced=True) == key)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if again:
                self._study.add_trial(self._frozen(point, told, values, stopped_at, self._notes.get(key, {})))
            else:
                trial = self._trials[key].pop(0)
                self._tell_optuna(trial, told, values, stopped_at)
                if self.sampler in KEEPS_STATE_ON_TRIALS:
                    self._notes[key] = _json_only(self._study.trials[trial.number].system_attrs)

    def _tell_optuna(self, trial: Any, fom: float | None, values: list[float] | None, stopped_at: int | None) -> None:
        state = _optuna().trial.TrialState
        if fom is None:
            self._study.tell(trial, state=state.FAIL)
        elif stopped_at is not None and values is None:
            # Pruned at its epoch: Optuna's samplers rank it by its value there, after complete trials.
            trial.report(float(fom), int(stopped_at))
            self._study.tell(trial, state=state.PRUNED)
        else:
            self._study.tell(trial, values if values is not None else float(fom))

    def _frozen(
        self, point: dict, fom: float | None, values: list[float] | None, stopped_at: int | None, notes: dict
    ) -> Any:
        """A finished Optuna trial as this searcher was told it (to add to a study)."""
        optuna = _optuna()
        state = optuna.trial.TrialState
        distributions = self._distributions()
        common = {"params": {name: point[name] for name in distributions}, "distributions": distributions}
        common["system_attrs"] = dict(notes)
        if fom is None:
            return optuna.trial.create_trial(**common, state=state.FAIL)
        if stopped_at is not None and values is None:
            return optuna.trial.create_trial(
                **common, state=state.PRUNED, intermediate_values={int(stopped_at): float(fom)}
            )
        return optuna.trial.create_trial(**common, values=values if values is not None else [float(fom)])

    # -- persistence ------------------------------------------------------------------
    def options(self) -> dict:
        directions = {"directions": self.directions} if len(self.directions) > 1 else {}
        return {"sampler": self.sampler, **directions, **self.sampler_options}

    def _extra_state(self) -> dict:
        study_notes = _json_only(self._study._storage.get_study_system_attrs(self._study._study_id))
        return {
            "values": dict(self._values),
            "order": list(self._order),
            "notes": dict(self._notes),
            "study_notes": study_notes,
        }

    def _load_extra_state(self, extra: Mapping[str, Any]) -> None:
        """Optuna's study again, from the points in the order asked (see the module docstring)."""
        self._values = {str(k): [float(v) for v in vs] for k, vs in extra.get("values", {}).items()}
        self._notes = {str(k): dict(v) for k, v in extra.get("notes", {}).items()}
        told = {self.space.key(p, coerced=True): (p, f) for p, f in self.told}
        pending = {self.space.key(p, coerced=True): p for p in self.pending}
        self._order = [str(k) for k in extra.get("order", [*told, *pending])]
        self._study = self._new_study(self.seed)
        self._trials = {}
        distributions = self._distributions()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for key in self._order:
                if key in told:
                    point, fom = told[key]
                    frozen = self._frozen(
                        point, fom, self._values.get(key), self.stopped.get(key), self._notes.get(key, {})
                    )
                    self._study.add_trial(frozen)
                elif key in pending:
                    self._study.enqueue_trial({name: pending[key][name] for name in distributions})
                    self._trials.setdefault(key, []).append(self._study.ask(distributions))
        # What the sampler noted on the study itself, as it stood (QMC's place in its sequence,
        # which the trials added and asked again above do not move as the original asks did).
        storage, study_id = self._study._storage, self._study._study_id
        for name, value in extra.get("study_notes", {}).items():
            storage.set_study_system_attr(study_id, str(name), value)


def _json_only(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """What a sampler noted on a trial, less anything JSON cannot hold."""
    kept = {}
    for name, value in attrs.items():
        if name == "fixed_params":  # an enqueued trial's, not the sampler's
            continue
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            continue
        kept[name] = value
    return kept
