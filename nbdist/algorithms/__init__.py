"""Update rules, looked up by name once, at the edge."""

from __future__ import annotations

from nbdist.algorithms.adag import ADAG
from nbdist.algorithms.base import Algorithm, RuleState, Update
from nbdist.algorithms.downpour import Downpour
from nbdist.algorithms.dynsgd import DynSGD
from nbdist.algorithms.easgd import EASGD
from nbdist.algorithms.gem import GEM
from nbdist.specs import Spec, SpecError, check_kwargs, unknown_name

__all__ = [
    "Algorithm",
    "RuleState",
    "Update",
    "Downpour",
    "EASGD",
    "GEM",
    "ADAG",
    "DynSGD",
    "MASTER_WORKER_ALGORITHMS",
    "make_algorithm",
]

MASTER_WORKER_ALGORITHMS: dict[str, type[Algorithm]] = {cls.name: cls for cls in (Downpour, EASGD, GEM, ADAG, DynSGD)}


def make_algorithm(spec: Spec) -> Algorithm:
    if spec.name not in MASTER_WORKER_ALGORITHMS:
        raise unknown_name("algorithm", spec.name, list(MASTER_WORKER_ALGORITHMS) + ["sgd"])
    cls = MASTER_WORKER_ALGORITHMS[spec.name]
    check_kwargs(f"algorithm {spec.name!r}", cls.__init__, spec.kwargs, skip=1)
    try:
        return cls(**spec.kwargs)
    except ValueError as exc:
        raise SpecError(str(exc)) from None
