"""One registry pattern for every extension point: update rules, codecs, reducers,
searchers, schedulers.

A registry maps a name to a class. The class carries everything the rest of nbdist needs
to know about it, so that adding one is one file plus its registration:

    RULES = Registry("update rule")

    @RULES.register
    class Downpour(Algorithm):
        '''The master applies each worker's gradient as it arrives (Dean et al. 2012).'''

        name = "downpour"
        parameter_help = {"lr": "the master's learning rate"}

        def __init__(self, lr: float = 0.05): ...

    RULES.build("downpour(lr=0.1)")        # one clear error for an unknown name or parameter
    RULES.help_text()                       # what --help and the docs reference print

The parameters, their defaults and their order come from the constructor's signature, the
help of each from `parameter_help`, the one-line summary from the docstring's first line:
the command-line help, the docs reference and the contract tests' parametrisation are all
generated from here, so none of them can drift from the code.

The registries of nbdist (each made where its base class lives, so that it is filled as its
entries are imported; none of these modules imports MPI or a framework):

    nbdist.algorithms.RULES             update rules       --algorithm
    nbdist.transport.compression.CODECS codecs             --compression
    nbdist.transport.reducers.REDUCERS  allreduce backends --allreduce-backend
    nbdist.hpo.searcher.SEARCHERS       searchers          --searcher

`Registry.every()` lists those of the modules imported so far.
"""

from __future__ import annotations

import inspect
import itertools
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from nbdist.errors import UserError
from nbdist.specs import Spec, SpecError, parse_spec, unknown_name

__all__ = ["Registry", "Parameter"]

T = TypeVar("T")

_NO_DEFAULT = inspect.Parameter.empty


@dataclass(frozen=True, slots=True)
class Parameter:
    """One keyword parameter of a registered class: its name, default and help."""

    name: str
    default: Any
    help: str

    @property
    def required(self) -> bool:
        return self.default is _NO_DEFAULT

    def __str__(self) -> str:
        return self.name if self.required else f"{self.name}={self.default!r}"


class Registry(Generic[T]):
    """Classes of one kind by name.

    `kind` names the extension point in messages ("update rule", "codec"). The constructor
    parameters that nbdist fills itself are neither user parameters nor listed in the help:
    the first `skip` of them (a searcher's space, a codec's vector length) and those named in
    `supplied` (a searcher's direction and seed, the parameter shapes PowerSGD is given).
    """

    # Weak references: a registry a test makes for its toys goes when the test is done
    # (or when the test removes it: `Registry._every.remove(toys)`).
    _every: weakref.WeakSet[Registry[Any]] = weakref.WeakSet()
    _made = itertools.count()

    def __init__(self, kind: str, *, skip: int = 0, supplied: Iterable[str] = ()) -> None:
        self.kind = kind
        self._skip = skip
        self._supplied = frozenset(supplied)
        self._entries: dict[str, type[T]] = {}
        self._order = next(Registry._made)
        Registry._every.add(self)

    @classmethod
    def every(cls) -> list[Registry[Any]]:
        """Every registry made so far (of the modules imported): what the docs reference
        and the contract tests walk over."""
        return sorted(cls._every, key=lambda registry: registry._order)

    @classmethod
    def named(cls, kind: str) -> Registry[Any]:
        """The registry of `kind` (the first made), for a part that may not import the
        module that makes it (the options and the searchers: nbdist.hpo imports the options)."""
        for registry in cls.every():
            if registry.kind == kind:
                return registry
        raise LookupError(f"no {kind} registry has been made: import the module that makes it first")

    # -- registering ---------------------------------------------------------------------
    def register(self, cls: type[T]) -> type[T]:
        """Class decorator: register `cls` under its `name` class attribute."""
        name = getattr(cls, "name", None)
        if not isinstance(name, str) or not name:
            raise TypeError(f"a {self.kind} class needs a non-empty `name` class attribute: {cls!r}")
        if name in self._entries and self._entries[name] is not cls:
            raise ValueError(f"a {self.kind} named {name!r} is registered already: {self._entries[name]!r}")
        self._entries[name] = cls
        return cls

    def unregister(self, name: str) -> None:
        """Remove an entry (a test's toy class, once the test is done)."""
        self._entries.pop(name, None)

    # -- looking up ----------------------------------------------------------------------
    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> list[str]:
        return list(self._entries)

    def items(self) -> list[tuple[str, type[T]]]:
        return list(self._entries.items())

    def get(self, name: str) -> type[T]:
        try:
            return self._entries[name]
        except KeyError:
            raise unknown_name(self.kind, name, self.names()) from None

    # -- describing ----------------------------------------------------------------------
    def parameters(self, name: str) -> list[Parameter]:
        """The user parameters of `name`'s constructor, in order, with defaults and help."""
        cls = self.get(name)
        helps: Mapping[str, str] = getattr(cls, "parameter_help", {}) or {}
        params = list(inspect.signature(cls).parameters.values())[self._skip :]
        kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        return [
            Parameter(p.name, p.default, helps.get(p.name, ""))
            for p in params
            if p.kind in kinds and p.name not in self._supplied
        ]

    def check_parameters(self, spec: Spec) -> None:
        """One SpecError naming the parameters `spec.name` takes, for any other in `spec`."""
        takes = [p.name for p in self.parameters(spec.name)]
        bad = [k for k in spec.kwargs if k not in takes]
        if bad:
            accepted = f"it takes: {', '.join(takes)}" if takes else "it takes no parameters"
            raise SpecError(f"{self.kind} {spec.name!r} takes no parameter {', '.join(map(repr, bad))}; {accepted}")

    def summary(self, name: str) -> str:
        """The first paragraph of the class's own docstring, as one line ('' without one:
        a base class's docstring says nothing about this entry)."""
        doc = inspect.cleandoc(self.get(name).__doc__ or "")
        return " ".join(doc.split("\n\n")[0].split())

    def describe(self, name: str) -> str:
        """`name(param=default, ...)`, or the bare name when it takes no parameters."""
        params = self.parameters(name)
        return f"{name}({', '.join(map(str, params))})" if params else name

    def help_text(self, *, default: str | None = None) -> str:
        """`describe: summary` of every entry, the default first, for --help."""
        names = sorted(self._entries, key=lambda name: name != default)
        lines = []
        for name in names:
            mark = " (default)" if name == default else ""
            summary = self.summary(name).rstrip(".")
            lines.append(f"{self.describe(name)}{mark}" + (f": {summary}" if summary else ""))
        return "; ".join(lines)

    # -- building ------------------------------------------------------------------------
    def build(self, spec: str | Spec | Mapping[str, Any], *args: Any, **fixed: Any) -> T:
        """An instance from a spec (`"easgd(elastic_force=0.5)"`): `args` and `fixed` are the
        values nbdist supplies itself, the spec's keywords the user's. An unknown name or
        parameter, or a value the constructor refuses with ValueError, is one SpecError."""
        spec = parse_spec(spec, what=self.kind)
        cls = self.get(spec.name)
        self.check_parameters(spec)
        try:
            return cls(*args, **fixed, **spec.kwargs)
        except UserError:
            raise
        except (ValueError, TypeError) as exc:
            raise SpecError(f"{self.kind} {spec}: {exc}") from None
