"""Parsing `name(key=value, ...)` specifications: optimizers and algorithms by name.

One syntax serves the command line, the magics and Python calls:
`adam`, `adam(lr=1e-3, betas=(0.9, 0.99))`, `easgd(elastic_force=0.5)`.
Only literals are accepted (parsed with `ast`, nothing is evaluated), and names are
resolved once, at the edge, in a registry, so a typo is one clear error.
"""

from __future__ import annotations

import ast
import difflib
import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nbdist.errors import UserError

__all__ = [
    "Spec",
    "SpecError",
    "ValueRange",
    "parse_spec",
    "check_kwargs",
    "unknown_name",
    "did_you_mean",
    "check_value_kinds",
]


class SpecError(UserError, ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Spec:
    name: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        if not self.kwargs:
            return self.name
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.name}({args})"

    def with_defaults(self, **defaults: Any) -> Spec:
        return Spec(self.name, {**defaults, **self.kwargs})


def parse_spec(
    text: str | Spec | Mapping[str, Any], *, what: str = "option", positional: Mapping[str, str] | None = None
) -> Spec:
    """`adam(lr=0.01)` -> Spec('adam', {'lr': 0.01}); a Spec or {'name':..., ...} passes.
    `positional`: the names that take their one parameter by position too, and what it
    is called (`topk(0.01)` == `topk(ratio=0.01)` with {'topk': 'ratio'})."""
    if isinstance(text, Spec):
        return text
    if isinstance(text, Mapping):
        kwargs = dict(text)
        try:
            name = kwargs.pop("name")
        except KeyError:
            raise SpecError(f"{what} {dict(text)!r} needs a 'name'") from None
        return Spec(str(name).lower(), kwargs)
    source = str(text).strip()
    try:
        node = ast.parse(source, mode="eval").body
    except SyntaxError:
        raise SpecError(
            f"cannot read {what} {source!r}: write a name, or name(key=value, ...), e.g. adam(lr=0.001)"
        ) from None
    if isinstance(node, ast.Name):
        return Spec(node.id.lower())
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        name = node.func.id.lower()
        if not node.args:
            return Spec(name, _literal_kwargs(node.keywords, source, what))
        single = (positional or {}).get(name)
        if single is not None and len(node.args) == 1 and not node.keywords:
            return Spec(name, _literal_kwargs([ast.keyword(single, node.args[0])], source, what))
    raise SpecError(
        f"cannot read {what} {source!r}: write a name, or name(key=value, ...) with keyword "
        f"arguments only, e.g. sgd(lr=0.1, momentum=0.9)"
    )


def _literal_kwargs(keywords: list[ast.keyword], source: str, what: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    for kw in keywords:
        if kw.arg is None:
            raise SpecError(f"{what} {source!r}: **kwargs is not allowed")
        if kw.arg in kwargs:
            raise SpecError(f"{what} {source!r}: {kw.arg} is given twice")
        try:
            kwargs[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, TypeError, RecursionError):
            # literal_eval raises TypeError for e.g. {[1]} (an unhashable set member).
            raise SpecError(
                f"{what} {source!r}: the value of {kw.arg} must be a literal (number, string, tuple, True/False/None)"
            ) from None
    return kwargs


def did_you_mean(name: str, known: list[str]) -> str:
    """' (did you mean 'x'?)' for the closest of `known`, or '' when none is close."""
    close = difflib.get_close_matches(name, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_name(what: str, name: str, known: list[str]) -> SpecError:
    return SpecError(f"unknown {what} {name!r}{did_you_mean(name, known)}; choose one of: {', '.join(sorted(known))}")


@dataclass(frozen=True, slots=True)
class ValueRange:
    """Where a numeric argument of a spec may lie: ValueRange(0, 1, high_open=True) is [0, 1).

    Checked when a rule or an optimiser is built during set-up, so that a value out of
    range is one error naming the range, not a diverging run or a traceback mid-training."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __str__(self) -> str:
        if self.low is not None and self.high is not None:
            return f"in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {self.low:g}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {self.high:g}"
        return "a finite number"

    def contains(self, value: float) -> bool:
        above = self.low is None or (value > self.low if self.low_open else value >= self.low)
        below = self.high is None or (value < self.high if self.high_open else value <= self.high)
        return above and below

    def check(self, what: str, name: str, value: Any) -> None:
        """Raise SpecError unless `value` is a finite number in this range."""
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not number or not math.isfinite(value):
            raise SpecError(f"{what}: {name} must be a number {self}, got {value!r}")
        if not self.contains(value):
            raise SpecError(f"{what}: {name} must be {self}, got {value!r}")


def check_kwargs(what: str, func: Callable[..., Any], kwargs: Mapping[str, Any], *, skip: int = 0) -> None:
    """Reject keyword arguments that `func` does not take, listing the ones it does."""
    params = list(inspect.signature(func).parameters.values())[skip:]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return
    accepted = [p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    bad = [k for k in kwargs if k not in accepted]
    if bad:
        takes = f"it takes: {', '.join(accepted)}" if accepted else "it takes no parameters"
        raise SpecError(f"{what} takes no parameter {', '.join(map(repr, bad))}; {takes}")


def check_value_kinds(what: str, func: Callable[..., Any], kwargs: Mapping[str, Any]) -> None:
    """Reject a value of another kind than its parameter's default: a string where the
    default is a number (`lr='fast'`), anything but True/False where it is a flag.
    Frameworks fail on these with a comparison error that names neither."""
    params = inspect.signature(func).parameters
    for name, value in kwargs.items():
        default = params[name].default if name in params else inspect.Parameter.empty
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise SpecError(f"{what}: {name} must be True or False, got {value!r}")
        elif isinstance(default, (int, float)) and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise SpecError(f"{what}: {name} must be a number, got {value!r}")
