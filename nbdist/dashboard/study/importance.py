"""Hyper-parameter importances, from Optuna's evaluators (not computed here): the study's
complete trials become an in-memory Optuna study (`optuna.trial.create_trial` with each
parameter's distribution), and `optuna.importance.get_param_importances` ranks the
parameters by how much of the objective's variance each explains.

Evaluators (the dashboard's choice):

- `random forest`: mean decrease in impurity of scikit-learn's random forest fitted to the
  trials (Optuna's MeanDecreaseImpurityImportanceEvaluator), the default: it answers in
  well under a second for a thousand trials;
- `fanova`: functional ANOVA (Hutter et al. 2014) on a random forest (Optuna's default
  evaluator, with a smaller forest here: its 64 trees of depth 64 took over a minute for
  a thousand trials on a two-core machine);
- `ped-anova`: PED-ANOVA (Watanabe et al. 2023), the top quantile's distribution against all.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from nbdist.dashboard.study.frames import ParamAxis, value_of
from nbdist.store import TrialRow

__all__ = ["EVALUATORS", "param_importances", "ImportanceError"]

EVALUATORS = ("random forest", "fanova", "ped-anova")
MIN_TRIALS = 4  # fewer complete trials say nothing about importance


class ImportanceError(ValueError):
    """Why no importances can be given (too few trials, one value only): shown in the view."""


def _evaluator(name: str, optuna: Any, seed: int) -> Any:
    importance = optuna.importance
    if name == "random forest":
        return importance.MeanDecreaseImpurityImportanceEvaluator(seed=seed)
    if name == "fanova":
        return importance.FanovaImportanceEvaluator(n_trees=16, max_depth=8, seed=seed)
    if name == "ped-anova":
        return importance.PedAnovaImportanceEvaluator()
    raise ImportanceError(f"unknown importance evaluator {name!r}: choose one of {', '.join(EVALUATORS)}")


def _distribution(axis: ParamAxis, values: list[Any], optuna: Any) -> Any | None:
    dists = optuna.distributions
    if axis.kind == "category":
        return dists.CategoricalDistribution(sorted({str(v) for v in values}))
    low, high = min(values), max(values)
    if low == high:
        return None  # one value: nothing to explain
    if all(isinstance(v, int) for v in values):
        return dists.IntDistribution(int(low), int(high), log=axis.kind == "log" and low > 0)
    return dists.FloatDistribution(float(low), float(high), log=axis.kind == "log" and low > 0)


def param_importances(
    trials: Sequence[TrialRow],
    axes: dict[str, ParamAxis],
    k: int,
    maximize: bool,
    evaluator: str = "random forest",
    seed: int = 0,
) -> list[tuple[str, float]]:
    """(parameter, importance) for objective k over the complete trials, most important
    first (importances sum to 1). Raises ImportanceError when they cannot be given."""
    try:
        import optuna
    except ImportError:  # pragma: no cover - installed with nbdist[hpo]
        raise ImportanceError("parameter importances need optuna: pip install 'nbdist[hpo]'") from None
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    done = [(t, v) for t in trials if t.state == "complete" and (v := value_of(t, k)) is not None]
    names = [n for n in axes if done and all(n in t.params for t, _ in done)]
    if len(done) < MIN_TRIALS:
        raise ImportanceError(f"{len(done)} complete trial(s): importances need at least {MIN_TRIALS}")
    dists = {}
    for name in names:
        dist = _distribution(axes[name], [_plain(t.params[name], axes[name]) for t, _ in done], optuna)
        if dist is not None:
            dists[name] = dist
    if not dists:
        raise ImportanceError("every parameter took one value only: nothing to rank")
    made = [
        optuna.trial.create_trial(
            params={n: _plain(t.params[n], axes[n]) for n in dists}, distributions=dists, value=float(v)
        )
        for t, v in done
    ]
    study = optuna.create_study(direction="maximize" if maximize else "minimize")
    study.add_trials(made)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "experimental" warnings of the newer evaluators
        ranked = optuna.importance.get_param_importances(study, evaluator=_evaluator(evaluator, optuna, seed))
    return [(name, float(value)) for name, value in ranked.items()]


def _plain(value: Any, axis: ParamAxis) -> Any:
    return str(value) if axis.kind == "category" else value
