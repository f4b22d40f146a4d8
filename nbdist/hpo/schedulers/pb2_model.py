"""PB2's bandit (Parker-Holder et al. 2020, "Provably Efficient Online Hyperparameter
Optimization with Population-Based Bandits"): a time-varying Gaussian process over
(time, state, hyper-parameters) -> the objective's change per epoch, and the upper
confidence bound that picks a replaced member's next hyper-parameters.

Each observation is one member's interval: it started at epoch `t` from objective `r`
(its own, or the one of the member whose state it took) with hyper-parameters `x`, and
its objective then moved by `y` per epoch (oriented so that larger is better). The GP's
kernel multiplies a squared exponential over (r, x) by the time-varying kernel of
Bogunovic et al. (2016), so that old intervals count less:

    k((t, r, x), (t', r', x')) = s^2 * (1 - eps)^(|t - t'| / 2) * exp(-|(r, x) - (r', x')|^2 / (2 l^2))

and (1 - eps)^(|t - t'| / 2) = exp(-|t - t'| / l_t) with l_t = -2 / ln(1 - eps): scikit-learn's
Matern kernel with nu = 1/2 on the time column, eps in (0, 1/2] as in Ray Tune's PB2. The
hyper-parameters of the kernel (s, eps, l, the noise) are fitted by maximum likelihood.

A member that takes member j's state at epoch t has its context fixed, c = (t, r_j), and
gets the hyper-parameters (the published acquisition, GP-UCB on the time-varying GP):

    x_t = argmax_{x in bounds}  mu_{t-1}(c, x) + sqrt(beta_t) * sigma_{t-1}(c, x)

where mu and sigma are the GP's posterior mean and standard deviation (Ray Tune's code
adds the variance; this follows the paper). Several members
replaced at the same meeting are chosen one after the other, sigma conditioned on the
points already chosen in this batch (their outcome does not change sigma), so that the
batch spreads out (PB2's parallel selection). beta_t = 0.2 log(0.4 n) as in Ray Tune's
PB2 (n: the observations), held above `BETA_FLOOR` where it would be negative.

Time is the fraction of the study's epochs, r min-max scaled over the observations and the
context, x in [0, 1] (each hyper-parameter's search coordinates: its logarithm for a
log-uniform prior), y standardised and clipped to +-2, as in Ray Tune.

This module imports scikit-learn (seconds), so the scheduler imports it only when it first chooses.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence

import numpy as np
from scipy.optimize import minimize
from sklearn.gaussian_process import GaussianProcessRegressor
from sklearn.gaussian_process.kernels import RBF, ConstantKernel, Hyperparameter, Kernel, Matern, WhiteKernel
from threadpoolctl import threadpool_limits

__all__ = ["Choice", "choose", "ucb_kappa"]

BETA_FLOOR = 0.05
MAX_OBSERVATIONS = 250  # the latest only: the GP's fit is cubic in their number
CANDIDATES = 2048  # random points scored before L-BFGS-B refines the best few
REFINED = 4
EPSILON_BOUNDS = (1e-4, 0.5)


class Columns(Kernel):
    """`kernel` applied to some columns of the inputs only (scikit-learn has no active
    dimensions): how the time kernel and the state kernel multiply."""

    def __init__(self, kernel: Kernel, columns: tuple[int, ...]):
        self.kernel = kernel
        self.columns = columns

    def get_params(self, deep: bool = True) -> dict:
        params = {"kernel": self.kernel, "columns": self.columns}
        if deep:
            params.update(("kernel__" + k, v) for k, v in self.kernel.get_params().items())
        return params

    @property
    def hyperparameters(self) -> list[Hyperparameter]:
        return [
            Hyperparameter("kernel__" + h.name, h.value_type, h.bounds, h.n_elements)
            for h in self.kernel.hyperparameters
        ]

    @property
    def theta(self) -> np.ndarray:
        return self.kernel.theta

    @theta.setter
    def theta(self, theta: np.ndarray) -> None:
        self.kernel.theta = theta

    @property
    def bounds(self) -> np.ndarray:
        return self.kernel.bounds

    def __call__(self, X, Y=None, eval_gradient=False):  # noqa: N803 - scikit-learn's names
        X = np.atleast_2d(X)[:, list(self.columns)]  # noqa: N806
        Y = None if Y is None else np.atleast_2d(Y)[:, list(self.columns)]  # noqa: N806
        return self.kernel(X, Y, eval_gradient=eval_gradient)

    def diag(self, X):  # noqa: N803
        return self.kernel.diag(np.atleast_2d(X)[:, list(self.columns)])

    def is_stationary(self) -> bool:
        return self.kernel.is_stationary()


def _length_scale_of(epsilon: float) -> float:
    return -2.0 / math.log(1.0 - epsilon)


def kernel(dims: int) -> Kernel:
    """The time-varying kernel over (t, r, x_1..x_dims), its hyper-parameters to fit."""
    time = Matern(
        length_scale=_length_scale_of(0.1),
        length_scale_bounds=(_length_scale_of(EPSILON_BOUNDS[1]), _length_scale_of(EPSILON_BOUNDS[0])),
        nu=0.5,
    )
    state = RBF(length_scale=0.5, length_scale_bounds=(0.05, 2.0))
    return ConstantKernel(1.0, (1e-2, 1e2)) * Columns(time, (0,)) * Columns(
        state, tuple(range(1, dims + 2))
    ) + WhiteKernel(0.1, (1e-5, 1.0))


def ucb_kappa(observations: int) -> float:
    return math.sqrt(max(0.2 * math.log(0.4 * max(observations, 1)), BETA_FLOOR))


class Choice:
    """The hyper-parameters chosen (in [0, 1]) and why, for the study's records."""

    def __init__(self, x: np.ndarray, how: dict):
        self.x, self.how = x, how


def _standardise(y: np.ndarray) -> np.ndarray:
    return np.clip((y - y.mean()) / (y.std() + 1e-8), -2.0, 2.0)


def choose(
    observations: Sequence[Sequence[float]],
    context: tuple[float, float],
    batch: Sequence[Sequence[float]],
    dims: int,
    seed: int,
) -> Choice:
    """The next hyper-parameters in [0, 1]^dims for a member whose interval starts at
    `context` = (t, r). `observations`: rows (t, r, y, x_1..x_dims); `batch`: the x of the
    members already chosen at this meeting (same context time)."""
    rng = np.random.default_rng(seed)
    rows = np.asarray(observations, dtype=float).reshape(-1, dims + 3)[-MAX_OBSERVATIONS:]
    if len(rows) < 2:
        # No interval observed yet (the first meeting): the GP's prior is flat, every point
        # has the same bound, and a uniform draw is the tie-break.
        return Choice(rng.random(dims), {"acquisition": "uniform", "observations": len(rows)})
    starts = np.append(rows[:, 1], context[1])
    low, span = starts.min(), (starts.max() - starts.min()) or 1.0
    inputs = np.column_stack([rows[:, 0], (rows[:, 1] - low) / span, rows[:, 3:]])
    fixed = np.array([context[0], (context[1] - low) / span])
    # One BLAS thread: the matrices are small, and more threads only contend with the runs.
    with threadpool_limits(limits=1, user_api="blas"), warnings.catch_warnings():
        # scikit-learn warns when a kernel parameter sits on its bound: the bound is meant.
        warnings.simplefilter("ignore")
        gp = GaussianProcessRegressor(kernel(dims), n_restarts_optimizer=1, random_state=seed % 2**31)
        gp.fit(inputs, _standardise(rows[:, 2]))
        spread = gp
        if len(batch):
            chosen = np.column_stack([np.tile(fixed, (len(batch), 1)), np.asarray(batch, dtype=float)])
            # sigma does not depend on the outcomes: the chosen points enter at their mean.
            spread = GaussianProcessRegressor(gp.kernel_, optimizer=None)
            spread.fit(np.vstack([inputs, chosen]), np.concatenate([gp.y_train_, gp.predict(chosen)]))
        kappa = ucb_kappa(len(rows))

        def mean_sigma(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            points = np.column_stack([np.tile(fixed, (len(x), 1)), x])
            return gp.predict(points), spread.predict(points, return_std=True)[1]

        def upper_bound(x: np.ndarray) -> np.ndarray:
            mean, sigma = mean_sigma(x)
            return mean + kappa * sigma

        best = _maximise(upper_bound, dims, rng)
        mean, sigma = mean_sigma(best[None, :])
    how = {"acquisition": "ucb", "observations": len(rows), "mean": float(mean[0]), "sigma": float(sigma[0])}
    return Choice(best, {**how, "kappa": kappa})


def _maximise(bound: Callable[[np.ndarray], np.ndarray], dims: int, rng: np.random.Generator) -> np.ndarray:
    """The point of [0, 1]^dims where `bound` is highest: the best of random candidates,
    refined by L-BFGS-B from the best few."""
    candidates = rng.random((CANDIDATES, dims))
    scores = bound(candidates)
    best, best_score = candidates[int(np.argmax(scores))], float(scores.max())
    for start in candidates[np.argsort(scores)[-REFINED:]]:
        found = minimize(lambda x: -bound(x[None, :])[0], start, method="L-BFGS-B", bounds=[(0.0, 1.0)] * dims)
        if -found.fun > best_score:
            best, best_score = np.clip(found.x, 0.0, 1.0), float(-found.fun)
    return best
