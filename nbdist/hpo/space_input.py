"""Search spaces from what users type or hand over: the compact text of the command line
and the magics (`lr=log(1e-4,1e-1) hidden=int(16,256) optimizer=cat(adam,sgd)`), a dict
of dimensions, scikit-optimize's dimensions. Each becomes an `nbdist.hpo.space.Space`,
or one `SpaceError` naming what could not be read and how to write it.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from nbdist.hpo.space import (
    EXAMPLE,
    Categorical,
    Dimension,
    Integer,
    Real,
    Space,
    SpaceError,
    category_from_text,
    plain_value,
)
from nbdist.specs import unknown_name

__all__ = ["as_space", "parse_space"]


def as_space(space: Any) -> Space:
    """A Space from what a user may hand over: a Space, the compact text, a dict of
    name -> dimension (nbdist's, skopt's, or compact text like 'log(1e-4,1e-1)'), or a list
    of skopt dimensions that have names."""
    if isinstance(space, Space):
        return space
    if isinstance(space, str):
        return parse_space(space)
    if isinstance(space, Mapping):
        return Space({name: _dimension(name, dim) for name, dim in space.items()})
    if isinstance(space, Sequence):
        dims = {}
        for dim in space:
            name = getattr(dim, "name", None)
            if not name:
                raise SpaceError(
                    f"{dim!r} has no name; give skopt dimensions a name=..., or pass a dict name -> dimension"
                )
            if name in dims:
                raise SpaceError(f"parameter {name!r} is given twice")
            dims[name] = _dimension(name, dim)
        return Space(dims)
    raise SpaceError(f"cannot make a search space from {space!r}; write e.g. {EXAMPLE!r}")


def _dimension(name: str, dim: Any) -> Dimension:
    if isinstance(dim, Dimension):
        return dim
    if isinstance(dim, str):
        parts = list(_parts(f"{name}={dim}"))
        if len(parts) != 1:
            raise SpaceError(f"parameter {name!r}: write one dimension such as 'log(1e-4,1e-1)', got {dim!r}")
        return _parse_part(*parts[0])
    skopt_space = sys.modules.get("skopt.space")  # a skopt object means skopt is imported
    if skopt_space is not None:
        if isinstance(dim, skopt_space.Categorical):
            return Categorical(list(dim.categories))
        if isinstance(dim, (skopt_space.Real, skopt_space.Integer)):
            cls = Integer if isinstance(dim, skopt_space.Integer) else Real
            try:
                return cls(plain_value(dim.low), plain_value(dim.high), prior=dim.prior)
            except SpaceError as exc:
                raise SpaceError(f"parameter {name!r}: {exc}") from None
    raise SpaceError(
        f"parameter {name!r}: {dim!r} is not a dimension; use Real, Integer or Categorical "
        f"(nbdist.hpo or skopt.space), or text such as 'log(1e-4,1e-1)'"
    )


# ----------------------------------------------------------------------------- compact text
def _real(prior: str):
    def make(args: list[str]) -> Real:
        low, high = _numbers(args, 2)
        return Real(low, high, prior=prior)

    return make


def _int(prior: str):
    def make(args: list[str]) -> Integer:
        low, high = _numbers(args, 2)
        return Integer(low, high, prior=prior)

    return make


def _cat(args: list[str]) -> Categorical:
    if not args or args == [""]:
        raise SpaceError("no category given")
    return Categorical([category_from_text(a) for a in args])


# One registry, looked up once per part: kind -> (constructor from the argument texts, usage).
KINDS = {
    "real": (_real("uniform"), "real(low,high) for a uniform real"),
    "uniform": (_real("uniform"), "uniform(low,high) for a uniform real"),
    "log": (_real("log-uniform"), "log(low,high) for a log-uniform real, 0 < low"),
    "loguniform": (_real("log-uniform"), "loguniform(low,high) for a log-uniform real, 0 < low"),
    "int": (_int("uniform"), "int(low,high) for integers from low to high included"),
    "logint": (_int("log-uniform"), "logint(low,high) for log-uniform integers, 0 < low"),
    "cat": (_cat, "cat(a,b,...) for one of the categories"),
}


def _numbers(args: list[str], count: int) -> list[float | int]:
    if any(not a.strip() for a in args) and args != [""]:
        raise SpaceError("an argument is empty")
    if len(args) != count or args == [""]:
        raise SpaceError(f"expected {count} numbers (low,high), got {len(args) if args != [''] else 0}")
    out = []
    for a in args:
        try:
            value = ast.literal_eval(a.strip())
        except (ValueError, SyntaxError):
            value = None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SpaceError(f"{a.strip()!r} is not a number")
        out.append(value)
    return out


def _split_args(text: str) -> list[str]:
    """Split on commas that are outside quotes."""
    args, current, quote = [], [], None
    for ch in text:
        if quote:
            current.append(ch)
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
            current.append(ch)
        elif ch == ",":
            args.append("".join(current))
            current = []
        else:
            current.append(ch)
    args.append("".join(current))
    return args


# name = kind (   -- loose on purpose, so that a bad name or kind gets its own message
_HEAD = re.compile(r"([^\s=(),;]+)\s*=\s*([^\s=(),;]*)\s*\(")
_SEPARATORS = " \t\n,;"


def _parts(text: str) -> Iterator[tuple[str, str, str, str]]:
    """Yield (part, name, kind, argument text) for each `name=kind(args)` of the text;
    parts are separated by blanks, commas or semicolons."""
    i, n = 0, len(text)
    while True:
        while i < n and text[i] in _SEPARATORS:
            i += 1
        if i >= n:
            return
        head = _HEAD.match(text, i)
        if head is None:
            bad = text[i:].strip()
            bad = bad if len(bad) <= 40 else bad[:37] + "..."
            raise SpaceError(f"cannot read {bad!r} in the space: write name=kind(args), e.g. {EXAMPLE!r}")
        j, depth, quote = head.end(), 1, None
        while j < n and depth:
            ch = text[j]
            if quote:
                quote = None if ch == quote else quote
            elif ch in "'\"":
                quote = ch
            elif ch == "(":
                depth += 1
            elif ch == ")":
                depth -= 1
            j += 1
        if depth:
            raise SpaceError(f"{text[i:].strip()!r}: missing ')'")
        yield text[i:j], head.group(1), head.group(2).lower(), text[head.end() : j - 1]
        i = j


def _parse_part(part: str, name: str, kind: str, inner: str) -> Dimension:
    if not name.isidentifier():
        raise SpaceError(f"{part!r}: parameter name {name!r} must be a Python identifier (letters, digits, _)")
    if kind not in KINDS:
        raise SpaceError(f"{part!r}: {unknown_name('kind', kind, list(KINDS))}")
    make, usage = KINDS[kind]
    try:
        return make(_split_args(inner))
    except SpaceError as exc:
        raise SpaceError(f"{part!r}: {exc}; write {usage}") from None


def parse_space(text: str) -> Space:
    """The compact form: `"lr=log(1e-4,1e-1) hidden=int(16,256) optimizer=cat(adam,sgd)"`.

    A malformed space is one SpaceError that quotes the part at fault."""
    dims: dict[str, Dimension] = {}
    for part, name, kind, inner in _parts(str(text)):
        if name in dims:
            raise SpaceError(f"{part!r}: parameter {name!r} is given twice")
        dims[name] = _parse_part(part, name, kind, inner)
    return Space(dims)
