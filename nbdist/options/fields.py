"""How an option is declared: a dataclass field that carries its --help text (and the
registry whose entries its help lists), its --flag, and the kind of value it holds."""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import field, fields
from typing import Any

from nbdist.errors import OptionsError
from nbdist.registry import Registry

__all__ = ["flag", "field_kind", "check_types"]


def _opt(default: Any, help: str, **extra: Any) -> Any:
    """A field with its --help text; `registry` (a Registry, or the kind of one made in a
    package the options may not import) lists its entries after the text, `listed_default`
    the entry marked as the default there."""
    return field(default=default, metadata={"help": help, **extra})


def _registry_help(registry: Registry[Any] | str, default: str | None) -> str:
    entries = Registry.named(registry) if isinstance(registry, str) else registry
    return entries.help_text(default=default)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


_KINDS = {
    "int": (int, "a whole number"),
    "float": (float, "a number"),
    "str": (str, "a string"),
    "bool": (bool, "True or False"),
}


def field_kind(f: dataclasses.Field) -> tuple[type, bool]:
    """An option's value type and whether it may be None, from its annotation ('int | None')."""
    text = str(f.type)
    return _KINDS[text.removesuffix(" | None")][0], text.endswith(" | None")


def check_types(config: Any) -> None:
    """Each option of a TrainOptions or StudyOptions holds its kind of value: from Python
    (nbdist.train(..., epochs="5")) a wrong one would fail deep inside the run."""
    for f in fields(config):
        kind, optional = field_kind(f)
        value = getattr(config, f.name)
        if value is None and optional:
            continue
        if kind is bool:
            fits = isinstance(value, bool)
        elif kind is str:
            fits = isinstance(value, str)
        else:  # numbers, not flags; numpy's count too
            fits = (
                isinstance(value, numbers.Integral if kind is int else numbers.Real)
                and not isinstance(value, bool)
                and math.isfinite(value)
            )
        if not fits:
            name = _KINDS[str(f.type).removesuffix(" | None")][1]
            raise OptionsError(f"{flag(f.name)} must be {name}{' or None' if optional else ''}, got {value!r}")
