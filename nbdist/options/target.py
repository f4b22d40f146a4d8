"""--target and a study's --goal: a condition on a metric, e.g. 'val_acc > 0.97'."""

from __future__ import annotations

import re
from dataclasses import dataclass

from nbdist.errors import OptionsError

__all__ = ["Target", "parse_target"]

_TARGET = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*(>=|<=|>|<)\s*([-+0-9.eE]+)\s*$")
_COMPARE = {">": float.__gt__, ">=": float.__ge__, "<": float.__lt__, "<=": float.__le__}


@dataclass(frozen=True, slots=True)
class Target:
    metric: str
    op: str
    value: float

    def reached(self, metrics: dict[str, float]) -> bool:
        if self.metric not in metrics:
            return False
        return _COMPARE[self.op](float(metrics[self.metric]), self.value)

    def __str__(self) -> str:
        return f"{self.metric} {self.op} {self.value:g}"


def parse_target(text: str, option: str = "--target") -> Target:
    """`option`: the option `text` was given as, for the error (a study's is --goal)."""
    match = _TARGET.match(text)
    if not match:
        raise OptionsError(f"cannot read {option} {text!r}: write metric, comparison, number, e.g. 'val_acc > 0.97'")
    try:
        value = float(match.group(3))
    except ValueError:
        raise OptionsError(f"{option} {text!r}: {match.group(3)!r} is not a number") from None
    return Target(match.group(1), match.group(2), value)
