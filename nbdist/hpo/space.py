"""Search spaces: named dimensions, parsed once at the edge, JSON-able for the run store.

Three kinds of dimension, as in scikit-optimize (whose `Real`, `Integer` and `Categorical`
objects are accepted too and converted):

    Real(1e-4, 1e-1, prior="log-uniform")   Integer(16, 256)   Categorical(["adam", "sgd"])

and a compact text form for the command line and the magics:

    "lr=log(1e-4,1e-1) hidden=int(16,256) optimizer=cat(adam,sgd,rmsprop) dropout=real(0,0.5)"

These are nbdist's own small classes rather than skopt's: a space is parsed where the user
types it (a cell, a command line) and stored in the run store, and importing skopt costs
seconds (it pulls in scikit-learn's estimators) while its dimensions do not serialise. Only
the `bayes` searcher imports skopt, through `to_skopt()`.

Every value a dimension gives is a plain Python value (`float`, `int`, a category), so a
trial's parameters are a dict that JSON and the user's `build_model(params)` take as is.
"""

from __future__ import annotations

import ast
import json
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from nbdist.errors import UserError

__all__ = ["Dimension", "Real", "Integer", "Categorical", "Space", "SpaceError", "category_from_text", "category_text"]

PRIORS = ("uniform", "log-uniform")
EXAMPLE = "lr=log(1e-4,1e-1) hidden=int(16,256) optimizer=cat(adam,sgd,rmsprop)"


class SpaceError(UserError, ValueError):
    pass


def _same(a: Any, b: Any) -> bool:
    # True == 1 in Python, but a category True is not the category 1.
    return type(a) is type(b) and a == b


def plain_value(value: Any) -> Any:
    """numpy scalars (what skopt hands back) as Python values."""
    return value.item() if isinstance(value, np.generic) else value


def _number(value: Any, what: str) -> float:
    if type(value) is float and math.isfinite(value):  # the common case, fast
        return value
    value = plain_value(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpaceError(f"{what} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise SpaceError(f"{what} must be finite, got {value!r}")
    return float(value)


def _integer(value: Any, what: str) -> int:
    v = _number(value, what)
    if v != int(v):
        raise SpaceError(f"{what} must be an integer, got {plain_value(value)!r}")
    return int(v)


class Dimension(ABC):
    """One named axis of a space; `name` is set when the dimension joins a `Space`."""

    kind: ClassVar[str]

    @abstractmethod
    def sample(self, rng: np.random.Generator) -> Any:
        """One value drawn from the prior."""

    @abstractmethod
    def coerce(self, value: Any) -> Any:
        """`value` as this dimension's Python type, or ValueError if it is not a value of it."""

    @abstractmethod
    def grid(self, points: int) -> list:
        """At most `points` values spread over the dimension (all of them when fewer)."""

    @abstractmethod
    def to_json(self) -> dict: ...

    @abstractmethod
    def to_skopt(self, name: str): ...

    @abstractmethod
    def __str__(self) -> str:
        """The compact form, e.g. `log(0.0001,0.1)`; `parse_dimension(str(d)) == d`."""


@dataclass(frozen=True)
class _Bounded(Dimension):
    """Real and Integer: a range and a prior. Searchers that move points about (evolution)
    work in *search coordinates*: the value itself for a uniform prior, its logarithm for a
    log-uniform one, so that a step means the same anywhere from 1e-4 to 1e-1."""

    low: float
    high: float
    prior: str = "uniform"

    @property
    def log(self) -> bool:
        return self.prior == "log-uniform"

    def __post_init__(self) -> None:
        object.__setattr__(self, "low", self._value(self.low, "low"))
        object.__setattr__(self, "high", self._value(self.high, "high"))
        if self.prior not in PRIORS:
            raise SpaceError(f"prior must be one of {', '.join(PRIORS)}, got {self.prior!r}")
        if not self.low < self.high:
            raise SpaceError(f"low must be below high, got low={self.low!r}, high={self.high!r}")
        if self.log and self.low <= 0:
            raise SpaceError(f"a log-uniform prior needs low > 0, got low={self.low!r}")

    def to_search(self, value: float) -> float:
        return math.log(value) if self.log else float(value)

    def from_search(self, x: float) -> Any:
        return self.coerce_clip(math.exp(x) if self.log else x)

    @property
    def search_bounds(self) -> tuple[float, float]:
        return self.to_search(self.low), self.to_search(self.high)

    @staticmethod
    @abstractmethod
    def _value(value: Any, what: str) -> Any:
        """`value` as the dimension's type (float, int), or SpaceError naming `what`."""

    def coerce(self, value: Any) -> Any:
        v = self._value(value, "value")
        if not self.low <= v <= self.high:
            raise ValueError(f"{v!r} is outside [{self.low!r}, {self.high!r}]")
        return v

    @abstractmethod
    def coerce_clip(self, value: float) -> Any:
        """The nearest value of the dimension (clipped to the bounds, rounded for integers)."""

    def to_json(self) -> dict:
        return {"kind": self.kind, "low": self.low, "high": self.high, "prior": self.prior}


@dataclass(frozen=True)
class Real(_Bounded):
    kind: ClassVar[str] = "real"
    _value = staticmethod(_number)

    def sample(self, rng: np.random.Generator) -> float:
        lo, hi = self.search_bounds
        return self.from_search(rng.uniform(lo, hi))

    def coerce_clip(self, value: float) -> float:
        return float(min(max(float(value), self.low), self.high))

    def grid(self, points: int) -> list[float]:
        lo, hi = self.search_bounds
        return [self.from_search(x) for x in np.linspace(lo, hi, max(1, points))]

    def to_skopt(self, name: str):
        from skopt.space import Real as SkReal

        return SkReal(self.low, self.high, prior=self.prior, name=name)

    def __str__(self) -> str:
        return f"{'log' if self.log else 'real'}({self.low!r},{self.high!r})"


@dataclass(frozen=True)
class Integer(_Bounded):
    """Integers from low to high, both included."""

    kind: ClassVar[str] = "int"
    _value = staticmethod(_integer)

    def sample(self, rng: np.random.Generator) -> int:
        # Draw in [low, high + 1) and floor: every integer gets its full share of the prior
        # (rounding would give the two ends half a share each).
        if self.log:
            return self.coerce_clip(math.floor(math.exp(rng.uniform(math.log(self.low), math.log(self.high + 1)))))
        return int(rng.integers(int(self.low), int(self.high) + 1))

    def coerce_clip(self, value: float) -> int:
        return int(min(max(math.floor(float(value) + 0.5), self.low), self.high))

    def grid(self, points: int) -> list[int]:
        if self.high - self.low + 1 <= points:
            return list(range(int(self.low), int(self.high) + 1))
        lo, hi = self.search_bounds
        return sorted({self.from_search(x) for x in np.linspace(lo, hi, max(1, points))})

    def to_skopt(self, name: str):
        from skopt.space import Integer as SkInteger

        return SkInteger(self.low, self.high, prior=self.prior, name=name)

    def __str__(self) -> str:
        return f"{'logint' if self.log else 'int'}({self.low},{self.high})"


@dataclass(frozen=True, init=False)
class Categorical(Dimension):
    """Unordered choices. Categories are JSON scalars (str, int, float, bool, None), so that
    a trial's parameters store and compare exactly."""

    categories: tuple
    kind: ClassVar[str] = "cat"

    def __init__(self, categories: Sequence[Any]):
        if isinstance(categories, (str, bytes)) or not isinstance(categories, Sequence):
            raise SpaceError(f"categories must be a list, got {categories!r}")
        cats = tuple(plain_value(c) for c in categories)
        if not cats:
            raise SpaceError("a categorical dimension needs at least one category")
        for c in cats:
            if not (c is None or isinstance(c, (str, int, float, bool))):
                raise SpaceError(
                    f"category {c!r} is a {type(c).__name__}; categories must be strings, "
                    f"numbers, True/False or None (write a tuple as a string, e.g. '64x64')"
                )
        seen: list[Any] = []
        for c in cats:
            if any(_same(c, s) for s in seen):
                raise SpaceError(f"category {c!r} is given twice")
            seen.append(c)
        object.__setattr__(self, "categories", cats)

    def index(self, value: Any) -> int:
        for i, c in enumerate(self.categories):
            if _same(c, plain_value(value)):
                return i
        raise ValueError(f"{value!r} is not one of {list(self.categories)!r}")

    def sample(self, rng: np.random.Generator) -> Any:
        return self.categories[int(rng.integers(len(self.categories)))]

    def coerce(self, value: Any) -> Any:
        return self.categories[self.index(value)]

    def grid(self, points: int) -> list:
        return list(self.categories)

    def to_json(self) -> dict:
        return {"kind": self.kind, "categories": list(self.categories)}

    def to_skopt(self, name: str):
        from skopt.space import Categorical as SkCategorical

        return SkCategorical(list(self.categories), name=name)

    def __str__(self) -> str:
        return f"cat({','.join(category_text(c) for c in self.categories)})"


# ----------------------------------------------------------------------------- the space
class Space(Mapping[str, Dimension]):
    """An ordered, immutable mapping name -> dimension."""

    def __init__(self, dimensions: Mapping[str, Dimension]):
        if not dimensions:
            raise SpaceError(f"the space is empty; write e.g. {EXAMPLE!r}")
        for name, dim in dimensions.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise SpaceError(f"parameter name {name!r} must be a Python identifier (letters, digits, _)")
            if not isinstance(dim, Dimension):
                raise SpaceError(f"parameter {name!r}: {dim!r} is not a dimension")
        self._dims = dict(dimensions)

    def __getitem__(self, name: str) -> Dimension:
        return self._dims[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._dims)

    def __len__(self) -> int:
        return len(self._dims)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Space) and list(self._dims.items()) == list(other._dims.items())

    def __hash__(self) -> int:
        return hash(tuple(self._dims.items()))

    def __str__(self) -> str:
        return " ".join(f"{name}={dim}" for name, dim in self._dims.items())

    def __repr__(self) -> str:
        return f"Space({str(self)!r})"

    def sample(self, rng: np.random.Generator) -> dict[str, Any]:
        return {name: dim.sample(rng) for name, dim in self._dims.items()}

    def coerce(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """`params` as this space's Python values, in its order; ValueError naming the
        parameter that is missing, unknown or out of range."""
        if not isinstance(params, Mapping):
            raise ValueError(f"parameters must be a dict, got {params!r}")
        if params.keys() != self._dims.keys():
            unknown = [k for k in params if k not in self._dims]
            missing = [k for k in self._dims if k not in params]
            parts = ([f"unknown {', '.join(map(repr, unknown))}"] if unknown else []) + (
                [f"missing {', '.join(map(repr, missing))}"] if missing else []
            )
            raise ValueError(f"parameters {dict(params)!r} do not match the space {str(self)!r}: {'; '.join(parts)}")
        out = {}
        for name, dim in self._dims.items():
            try:
                out[name] = dim.coerce(params[name])
            except (ValueError, SpaceError) as exc:
                raise ValueError(f"parameter {name!r}: {exc}") from None
        return out

    def key(self, params: Mapping[str, Any], *, coerced: bool = False) -> str:
        """A canonical text for a point: equal points (after `coerce`) have equal keys.
        `coerced=True` skips the check for a point that came out of `coerce` already."""
        return json.dumps(list((params if coerced else self.coerce(params)).values()))

    def to_json(self) -> list[dict]:
        return [{"name": name, **dim.to_json()} for name, dim in self._dims.items()]

    @classmethod
    def from_json(cls, items: Sequence[Mapping[str, Any]]) -> Space:
        dims: dict[str, Dimension] = {}
        for item in items:
            item = dict(item)
            name, kind = item.pop("name"), item.pop("kind")
            if kind == Categorical.kind:
                dims[name] = Categorical(item["categories"])
            else:
                dims[name] = _BOUNDED_KINDS[kind](**item)
        return cls(dims)

    def to_skopt(self) -> list:
        return [dim.to_skopt(name) for name, dim in self._dims.items()]


_BOUNDED_KINDS: dict[str, type[_Bounded]] = {Real.kind: Real, Integer.kind: Integer}


def category_from_text(text: str) -> Any:
    text = text.strip()
    if not text:
        raise SpaceError("a category is empty")
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word: adam, relu, ...
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return text


def category_text(c: Any) -> str:
    if isinstance(c, str) and category_from_text(c) == c and not any(ch in c for ch in ",()'\" \t\n"):
        return c
    return repr(c)
