"""Update rules, registered on RULES and looked up by name once, at the edge."""

from __future__ import annotations

from nbdist.algorithms.adag import ADAG
from nbdist.algorithms.allreduce_sgd import SynchronousSGD
from nbdist.algorithms.async_local_sgd import AsyncLocalSGD
from nbdist.algorithms.base import RULES, Algorithm, Rule, RuleState, Update, weighted_mean
from nbdist.algorithms.diloco import DiLoCo
from nbdist.algorithms.downpour import Downpour
from nbdist.algorithms.dynsgd import DynSGD
from nbdist.algorithms.eamsgd import EAMSGD
from nbdist.algorithms.easgd import EASGD
from nbdist.algorithms.gem import GEM
from nbdist.specs import Spec, SpecError, unknown_name

__all__ = [
    "RULES",
    "Rule",
    "Algorithm",
    "RuleState",
    "Update",
    "weighted_mean",
    "Downpour",
    "EASGD",
    "GEM",
    "ADAG",
    "DynSGD",
    "DiLoCo",
    "AsyncLocalSGD",
    "EAMSGD",
    "SynchronousSGD",
    "rule_class",
    "make_algorithm",
]


def rule_class(name: str) -> type[Rule]:
    """The rule registered as `name`, or one error naming the registered ones."""
    if name not in RULES:
        raise unknown_name("algorithm", name, RULES.names())
    return RULES.get(name)


def make_algorithm(spec: Spec) -> Algorithm:
    """The master/worker rule `spec` names, built with its parameters."""
    cls = rule_class(spec.name)
    if not issubclass(cls, Algorithm):
        rules = ", ".join(name for name, entry in RULES.items() if issubclass(entry, Algorithm))
        raise SpecError(
            f"{spec.name} trains the {' and '.join(cls.topologies)} topology; the master-worker topology "
            f"takes one of: {rules}"
        )
    RULES.check_parameters(spec)
    try:
        return cls(**spec.kwargs)
    except ValueError as exc:
        raise SpecError(str(exc)) from None
