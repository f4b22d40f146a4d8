"""The one interface every searcher offers: ask for points, tell their figure of merit.

    searcher = make_searcher("bayes", "lr=log(1e-4,1e-1) hidden=int(16,256)", seed=1)
    points = searcher.ask(2)                 # one point per free group of ranks
    searcher.tell(points[1], 0.31)           # results in any order, as trials end
    searcher.tell(points[0], None)           # a failed trial (NaN or inf count as failed too)
    blob = json.dumps(searcher.state())      # persist; restore_searcher(json.loads(blob))
                                             # continues exactly as this one would

A point is a dict of plain Python values (float, int, a category). `ask(n)` may give fewer
than n points: an evolution waits for the last members of a generation to be told before
it breeds the next, and grid runs out; `exhausted` says that no point will ever come again.

Searchers register on SEARCHERS (nbdist.registry) with `@SEARCHERS.register` (or
`register`): the class carries its name, its options (the constructor's keyword parameters
after direction and seed, with defaults, and `parameter_help`) and, in its docstring's
first paragraph, what it does; --searcher's help is made from them.

Randomness never lives in a generator object that would have to be saved: each searcher
draws from `rng(...)`, a generator made afresh from the seed and a counter of what it is
drawing (the k-th random point, the g-th generation), so a searcher's state is its
counters and its history, all JSON, and a restored searcher draws exactly what the
original would have.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from numbers import Real as RealNumber
from typing import Any, ClassVar

import numpy as np

from nbdist.errors import UserError
from nbdist.hpo.space import Space
from nbdist.hpo.space_input import as_space
from nbdist.registry import Registry
from nbdist.specs import Spec, SpecError, check_kwargs, parse_spec, unknown_name

__all__ = ["Searcher", "SearcherError", "DIRECTIONS", "SEARCHERS", "register", "make_searcher", "restore_searcher"]

DIRECTIONS = ("minimize", "maximize")
STATE_VERSION = 1


class SearcherError(UserError, ValueError):
    pass


class Searcher(ABC):
    """What proposes a study's parameters: ask for points, tell their figures of merit.

    Every searcher (`bayes`, `evolution`, `random`, `grid`) has the same ask/tell
    interface; points are dicts of plain Python values. A study's coordinator asks for
    one point per free group of ranks and tells each trial's figure of merit as it
    arrives, in any order. Subclasses give `name`, `_propose(n)` and, when they keep more
    than the history, `_extra_state()` / `_load_extra_state()`; the base class keeps the
    history: the points asked and not yet told (`pending`), and those told with their
    figure of merit (`told`). `make_searcher` builds one from its name.

    Args:
        space: The search space: a string such as `"lr=log(1e-4,1e-1) hidden=int(16,256)"`,
            scikit-optimize dimensions, or an `nbdist.hpo.Space`.
        direction: `"minimize"` or `"maximize"` the figure of merit.
        seed: The seed of every random choice: the same seed and the same results
            give the same points.

    Raises:
        SearcherError: A bad direction or seed; `ask` and `tell` raise it for a bad count
            or a point that was not asked.

    Example:
        >>> from nbdist.hpo import make_searcher
        >>> searcher = make_searcher("random", "lr=log(1e-4,1e-1) hidden=int(16,256)", seed=0)
        >>> points = searcher.ask(2)          # one per free group of ranks
        >>> sorted(points[0])
        ['hidden', 'lr']
        >>> searcher.tell(points[1], 0.31)    # in any order, as trials finish
        >>> searcher.tell(points[0], None)    # a failed trial
        >>> [fom for _, fom in searcher.told]
        [0.31, None]
    """

    name: ClassVar[str]
    parameter_help: ClassVar[dict[str, str]] = {}
    multi_objective: ClassVar[bool] = False  # it may run a study of several objectives (a Pareto front)
    takes_values: ClassVar[bool] = False  # it is told a list of values in a study of several objectives

    def __init__(self, space: Any, *, direction: str = "minimize", seed: int = 0):
        if direction not in DIRECTIONS:
            raise SearcherError(f"direction must be 'minimize' or 'maximize', got {direction!r}")
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
            raise SearcherError(f"seed must be a non-negative integer, got {seed!r}")
        self.space: Space = as_space(space)
        self.direction = direction
        self.seed = int(seed)
        self.pending: list[dict] = []  # asked, not told yet, in the order asked
        self._pending_keys: list[str] = []  # space.key of each pending point
        self.told: list[tuple[dict, float | None]] = []  # in the order told; None = failed
        self.stopped: dict[str, int] = {}  # space.key of a told point stopped early -> its epochs

    # -- what the runner calls --------------------------------------------------------
    def ask(self, n: int = 1) -> list[dict]:
        """Propose `n` points to train next (they stay `pending` until told).

        Args:
            n: How many points: one per free group of ranks.

        Returns:
            `n` dicts of parameter name to a plain Python value, inside the space.
        """
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise SearcherError(f"ask(n) needs a positive integer n, got {n!r}")
        points = [self.space.coerce(p) for p in self._propose(int(n))]
        self.pending.extend(points)
        self._pending_keys.extend(self.space.key(p, coerced=True) for p in points)
        return [dict(p) for p in points]

    def tell(self, params: Mapping[str, Any], fom: float | None, *, stopped_at: int | None = None) -> None:
        """Record the figure of merit of a point asked earlier; None, NaN or an infinity
        marks a failed trial. `stopped_at`: the trial was stopped after that many epochs
        (pruned, paused at a rung, out of budget) and `fom` is its value there, not a
        finished trial's (`losses()` ranks it after the finished ones). A stopped point may
        be told again (a paused trial promoted, then finished): the new value replaces it."""
        try:
            key = self.space.key(params)
        except ValueError as exc:
            raise SearcherError(f"cannot tell {params!r}: {exc}") from None
        if fom is not None and (isinstance(fom, bool) or not isinstance(fom, RealNumber)):
            raise SearcherError(f"the figure of merit must be a number or None (failed), got {fom!r}")
        value = float(fom) if fom is not None and math.isfinite(fom) else None
        if key not in self._pending_keys and key in self.stopped:
            index = next(i for i, (p, _) in enumerate(self.told) if self.space.key(p, coerced=True) == key)
            self.told[index] = (self.told[index][0], value)
            self._mark_stopped(key, stopped_at)
            return
        if key not in self._pending_keys:
            raise SearcherError(f"cannot tell {dict(params)!r}: it was not asked, or was told already")
        index = self._pending_keys.index(key)
        point = self.pending.pop(index)
        del self._pending_keys[index]
        self.told.append((point, value))
        self._mark_stopped(key, stopped_at)
        self._on_told(point, value)

    def _mark_stopped(self, key: str, stopped_at: int | None) -> None:
        if stopped_at is None:
            self.stopped.pop(key, None)
        else:
            self.stopped[key] = int(stopped_at)

    def losses(self) -> list[tuple[dict, float]]:
        """(point, loss) of every told point, for a model of the objective: a failure is
        +inf; a stopped trial's value is an earlier epoch's, so the stopped ones are moved,
        in their order, behind the worst finished one (as Optuna's TPE ranks pruned trials
        after complete ones)."""
        points = [p for p, _ in self.told]
        return list(zip(points, self.ranked([f for _, f in self.told], points), strict=True))

    def ranked(self, foms: list[float | None], points: list[dict]) -> list[float]:
        """The losses of `foms` (those of `points`), the stopped ones behind the finished."""
        stopped = [self.space.key(p, coerced=True) in self.stopped for p in points]
        losses = [self.loss(f) for f in foms]
        finished = [loss for loss, early in zip(losses, stopped, strict=True) if not early and math.isfinite(loss)]
        early = [loss for loss, early in zip(losses, stopped, strict=True) if early and math.isfinite(loss)]
        shift = max(0.0, max(finished) - min(early)) if finished and early else 0.0
        return [
            loss + shift if early and math.isfinite(loss) else loss for loss, early in zip(losses, stopped, strict=True)
        ]

    def notes(self) -> list[str]:
        """What the user should know of this set-up before it runs (one line each)."""
        return []

    @property
    def exhausted(self) -> bool:
        """True when `ask` will never give another point."""
        return False

    @property
    def planned(self) -> int | None:
        """How many points the searcher gives in all, when that is fixed (grid, evolution)."""
        return None

    @property
    def generation(self) -> int | None:
        """The generation that the points of the last `ask` belong to (None: no generations)."""
        return None

    @property
    def best(self) -> tuple[dict, float] | None:
        """(params, fom) of the best point told so far, or None."""
        done = [(p, f) for p, f in self.told if f is not None]
        if not done:
            return None
        p, f = min(done, key=lambda pf: self.loss(pf[1]))
        return dict(p), f

    def loss(self, fom: float | None) -> float:
        """The figure of merit as a value to minimise; a failure is +inf."""
        if fom is None:
            return math.inf
        return fom if self.direction == "minimize" else -fom

    def rng(self, *stream: int) -> np.random.Generator:
        """A generator determined by the seed and `stream` (e.g. (RANDOM_POINT, k))."""
        return np.random.default_rng([self.seed, *stream])

    # -- persistence ------------------------------------------------------------------
    def options(self) -> dict:
        """The constructor's keyword options (besides space, direction, seed)."""
        return {}

    def state(self) -> dict:
        return {
            "searcher": self.name,
            "version": STATE_VERSION,
            "space": self.space.to_json(),
            "direction": self.direction,
            "seed": self.seed,
            "options": self.options(),
            "pending": [dict(p) for p in self.pending],
            "told": [[dict(p), f] for p, f in self.told],
            "stopped": dict(self.stopped),
            "extra": self._extra_state(),
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Searcher:
        if state.get("version") != STATE_VERSION or state.get("searcher") != cls.name:
            raise SearcherError(
                f"this is not a {cls.name} searcher state of version {STATE_VERSION} "
                f"(searcher {state.get('searcher')!r}, version {state.get('version')!r})"
            )
        searcher = cls(
            Space.from_json(state["space"]), direction=state["direction"], seed=state["seed"], **state["options"]
        )
        searcher.pending = [searcher.space.coerce(p) for p in state["pending"]]
        searcher._pending_keys = [searcher.space.key(p, coerced=True) for p in searcher.pending]
        searcher.told = [(searcher.space.coerce(p), None if f is None else float(f)) for p, f in state["told"]]
        searcher.stopped = {str(k): int(v) for k, v in state.get("stopped", {}).items()}
        searcher._load_extra_state(state["extra"])
        return searcher

    # -- what subclasses give ---------------------------------------------------------
    @abstractmethod
    def _propose(self, n: int) -> list[dict]:
        """Up to n new points (they join `pending` when returned)."""

    def _on_told(self, point: dict, fom: float | None) -> None:  # noqa: B027
        """Called after a point moved from `pending` to `told`. By default nothing more
        happens: a searcher that reads only `told` when it proposes needs no hook."""

    def _extra_state(self) -> dict:
        return {}

    def _load_extra_state(self, extra: Mapping[str, Any]) -> None:  # noqa: B027
        """Take back what `_extra_state` gave; by default there is nothing."""

    @classmethod
    def create(cls, space: Any, *, direction: str, seed: int, trials: int | None, **options: Any) -> Searcher:
        """Build from a study's settings; `trials` is the study's budget, which a searcher
        whose plan depends on it (evolution's generations) may use."""
        return cls(space, direction=direction, seed=seed, **options)

    def __repr__(self) -> str:
        opts = "".join(f", {k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({str(self.space)!r}, direction={self.direction!r}, seed={self.seed}{opts})"


# The space is the first constructor parameter; direction and seed are the study's own
# options (--direction, --seed): a searcher's listed options are the rest.
SEARCHERS: Registry[Searcher] = Registry("searcher", skip=1, supplied=("direction", "seed"))
register = SEARCHERS.register


def make_searcher(
    spec: str | Spec | Mapping[str, Any],
    space: Any,
    *,
    direction: str = "minimize",
    seed: int = 0,
    trials: int | None = None,
) -> Searcher:
    """`spec` names the searcher, with options: `"bayes"`, `"evolution(population=20)"`."""
    spec = parse_spec(spec, what="searcher")
    cls = SEARCHERS.get(spec.name)
    check_kwargs(f"searcher {spec.name!r}", cls.__init__, spec.kwargs, skip=2)
    kwargs = {"direction": direction, "seed": seed, **spec.kwargs}
    try:
        return cls.create(space, trials=trials, **kwargs)
    except UserError:
        raise
    except (ValueError, TypeError) as exc:
        raise SpecError(f"searcher {spec}: {exc}") from None


def restore_searcher(state: Mapping[str, Any]) -> Searcher:
    """The searcher that `state()` described, continuing exactly where it was."""
    name = str(state.get("searcher"))
    if name not in SEARCHERS:
        raise unknown_name("searcher", name, SEARCHERS.names())
    return SEARCHERS.get(name).from_state(state)
