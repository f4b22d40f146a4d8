"""Bayesian optimisation with scikit-optimize's `Optimizer` and its Gaussian process.

How points come:

1. the first `initial_points` points are a Latin hypercube over the space (seeded), which
   covers it more evenly than as many random draws;
2. after that, each `ask(n)` fits the GP (skopt's Matern 5/2 kernel, fitted noise) to the
   points told so far and hands out the n maximisers of the acquisition function, one after
   the other, using the *constant liar* strategy: each point already chosen, and each point
   still pending from an earlier ask (a group is still training it), is told to the model
   with a made-up value (by default the best value seen, `cl_min`), so the next point goes
   elsewhere instead of next to a point being evaluated. Results are told as they arrive,
   in any order.

A failed trial is told to the model as the worst value seen so far: the region that made
it fail (a learning rate that diverges) is then avoided, without a made-up number that
would distort the GP's scale.

Two choices keep it fast (less CPU per point than skopt's `gp_minimize`, and better on
Branin: bench/results/2026-11-23-hpo_parallel.md):
- the kernel's hyper-parameters are fitted once per ask, on the real results only, by
  maximum likelihood from two starts: skopt's default and the previous fit (`theta` in the
  state), the better one kept (the previous fit alone can stay stuck in a poor optimum,
  a length scale at its bound, for the rest of a study); the liars then only condition
  the GP, without a refit per lie, which is the usual way of running constant liar;
- the GP's numerical work runs with one BLAS thread: its matrices are tiny (one row per
  trial) and threads would only spin, on the same cores as the training ranks.

Defaults that differ from skopt's: `xi=1e-4` (skopt: 0.01, in the figure of merit's units:
larger than the differences that matter near an optimum, such as 1% of a loss of 0.4);
`n_points=1000` random candidates for the acquisition (skopt: 10000) before L-BFGS refines
the best five, a tenth of the work and no worse on Branin; a Latin hypercube start
(skopt: random points).

`acq_func` is one of EI (default), LCB, PI: skopt's `gp_hedge` keeps gains across
successive fits inside one long-lived optimizer, which this searcher does not have (each ask
builds its optimizer from the state, so that a restored study asks exactly what the
original would have).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np

from nbdist.hpo.searcher import SEARCHERS, Searcher, SearcherError
from nbdist.hpo.space import Integer, Real

__all__ = ["BayesSearcher"]

ACQ_FUNCS = ("EI", "LCB", "PI")
LIARS: dict[str, Callable[[list[float]], float]] = {
    "cl_min": min,
    "cl_mean": lambda ys: sum(ys) / len(ys),
    "cl_max": max,
}
DESIGNS = ("lhs", "random")
DESIGN_SEED, RANDOM_POINT, GP_ASK = 4, 5, 6  # rng streams


@contextmanager
def _quiet_single_thread() -> Iterator[None]:
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"), warnings.catch_warnings():
        # skopt warns when a proposal repeats a told point (it then picks another) and
        # scikit-learn when a kernel parameter sits on its bound: neither needs the user.
        warnings.simplefilter("ignore")
        yield


@SEARCHERS.register
class BayesSearcher(Searcher):
    """Bayesian optimisation: a Gaussian process fitted to the results so far proposes the
    points (scikit-optimize; constant liar for the points still training)."""

    name = "bayes"
    parameter_help = {
        "initial_points": "points of the initial design, before the GP proposes any",
        "initial_design": "lhs (a Latin hypercube) or random",
        "acq_func": "the acquisition function: EI, LCB or PI",
        "xi": "EI's and PI's exploration margin, in the figure of merit's units",
        "kappa": "LCB's exploration weight",
        "liar": "what a pending point is told as: cl_min, cl_mean or cl_max of the results",
        "n_points": "random candidates for the acquisition before L-BFGS refines the best",
        "noise": "'gaussian' (fitted) or a fixed noise variance",
    }

    def __init__(
        self,
        space: Any,
        *,
        direction: str = "minimize",
        seed: int = 0,
        initial_points: int = 10,
        initial_design: str = "lhs",
        acq_func: str = "EI",
        xi: float = 0.0001,
        kappa: float = 1.96,
        liar: str = "cl_min",
        n_points: int = 1000,
        noise: str | float = "gaussian",
    ):
        super().__init__(space, direction=direction, seed=seed)
        if isinstance(initial_points, bool) or not isinstance(initial_points, int) or initial_points < 1:
            raise SearcherError(f"bayes initial_points must be a positive integer, got {initial_points!r}")
        if isinstance(n_points, bool) or not isinstance(n_points, int) or n_points < 1:
            raise SearcherError(f"bayes n_points must be a positive integer, got {n_points!r}")
        for what, value, allowed in (
            ("initial_design", initial_design, DESIGNS),
            ("acq_func", acq_func, ACQ_FUNCS),
            ("liar", liar, tuple(LIARS)),
        ):
            if value not in allowed:
                raise SearcherError(f"bayes {what} must be one of {', '.join(allowed)}, got {value!r}")
        if noise != "gaussian" and (isinstance(noise, bool) or not isinstance(noise, (int, float)) or not noise > 0):
            raise SearcherError(f"bayes noise must be 'gaussian' (fitted) or a positive variance, got {noise!r}")
        self.initial_points = initial_points
        self.initial_design = initial_design
        self.acq_func = acq_func
        self.xi = float(xi)
        self.kappa = float(kappa)
        self.liar = liar
        self.n_points = n_points
        self.noise = noise
        self.theta: list[float] | None = None  # the kernel's fitted log-hyper-parameters
        self._design: list[dict] | None = None  # made from the seed when first needed

    def options(self) -> dict:
        return {
            "initial_points": self.initial_points,
            "initial_design": self.initial_design,
            "acq_func": self.acq_func,
            "xi": self.xi,
            "kappa": self.kappa,
            "liar": self.liar,
            "n_points": self.n_points,
            "noise": self.noise,
        }

    def _extra_state(self) -> dict:
        return {"theta": self.theta}

    def _load_extra_state(self, extra: Mapping[str, Any]) -> None:
        self.theta = None if extra["theta"] is None else [float(t) for t in extra["theta"]]

    # -- proposing --------------------------------------------------------------------
    def _propose(self, n: int) -> list[dict]:
        asked = len(self.pending) + len(self.told)
        points = [self._design_point(k) for k in range(asked, min(asked + n, self.initial_points))]
        if len(points) < n:
            points += self._model_points(n - len(points), asked + len(points), fresh=points)
        return points

    def _design_point(self, k: int) -> dict:
        if self.initial_design == "random":
            return self.space.sample(self.rng(RANDOM_POINT, k))
        if self._design is None:
            from skopt.sampler import Lhs

            seed = int(self.rng(DESIGN_SEED).integers(2**31 - 1))
            with _quiet_single_thread():
                rows = Lhs(criterion="maximin", iterations=100).generate(
                    self.space.to_skopt(), self.initial_points, random_state=seed
                )
            self._design = [self._from_skopt(row) for row in rows]
        return self._design[k]

    def _model_points(self, n: int, asked: int, fresh: list[dict]) -> list[dict]:
        told = self.losses()
        ok = [loss for _, loss in told if math.isfinite(loss)]
        if not ok:  # nothing to model yet (all pending or failed): random points
            return [self.space.sample(self.rng(RANDOM_POINT, asked + i)) for i in range(n)]
        worst = max(ok)
        x = [self._to_skopt(p) for p, _ in told]
        y = [loss if math.isfinite(loss) else worst for _, loss in told]
        lie = LIARS[self.liar](ok)
        waiting = [self._to_skopt(p) for p in self.pending + fresh]
        seed = int(self.rng(GP_ASK, asked).integers(2**31 - 1))
        with _quiet_single_thread():
            optimizer = self._optimizer(x, y, seed)
            optimizer.tell(x + waiting, y + [lie] * len(waiting))
            points = []
            for i in range(n):
                point = optimizer.ask()
                points.append(self._from_skopt(point))
                if i < n - 1:
                    optimizer.tell(point, lie)
        return points

    def _optimizer(self, x: list[list], y: list[float], seed: int):
        """A skopt Optimizer whose GP has the kernel fitted to (x, y) (see the module
        docstring), then fixed: what it is told from here on only conditions it."""
        from sklearn.gaussian_process import GaussianProcessRegressor as FitGP
        from skopt import Optimizer
        from skopt.learning import GaussianProcessRegressor
        from skopt.learning.gaussian_process.kernels import WhiteKernel
        from skopt.space import Space as SkoptSpace
        from skopt.utils import cook_estimator, normalize_dimensions

        dims = self.space.to_skopt()
        options = dict(
            n_initial_points=0,
            acq_func=self.acq_func,
            random_state=seed,
            acq_func_kwargs={"xi": self.xi, "kappa": self.kappa},
            acq_optimizer_kwargs={"n_points": self.n_points},
        )
        template = cook_estimator("GP", space=dims, random_state=seed)
        white = WhiteKernel() if self.noise == "gaussian" else WhiteKernel(self.noise, noise_level_bounds="fixed")
        kernel = template.kernel + white
        starts = [kernel]
        if self.theta is not None and len(self.theta) == len(kernel.theta):
            starts.append(kernel.clone_with_theta(np.array(self.theta)))
        transformed = SkoptSpace(normalize_dimensions(dims)).transform(x)  # as the Optimizer sees x
        fits = [FitGP(kernel=k, normalize_y=True, n_restarts_optimizer=0).fit(transformed, y) for k in starts]
        fitted = max(fits, key=lambda f: f.log_marginal_likelihood_value_)
        self.theta = [float(t) for t in fitted.kernel_.theta]
        gp = GaussianProcessRegressor(kernel=fitted.kernel_, optimizer=None, normalize_y=True, noise=self.noise)
        return Optimizer(dims, gp, **options)

    def _to_skopt(self, params: dict) -> list:
        return [params[name] for name in self.space]

    def _from_skopt(self, row) -> dict:
        # skopt hands back numpy scalars, and reals a rounding error outside their bounds.
        return {
            name: dim.coerce_clip(v) if isinstance(dim, (Real, Integer)) else dim.coerce(v)
            for (name, dim), v in zip(self.space.items(), row, strict=True)
        }
