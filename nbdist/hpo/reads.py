"""Which of a study's parameters the run reads, checked when the study is set up.

A trial's parameters reach its run two ways (hpo/trial.py): a parameter named like a
training option sets that option (`optimizer`, `lr` and `momentum` set the optimiser),
and every parameter goes to the model's builders that take an argument
(`build_model(params)`). A parameter that neither reads, a typo such as `momentom`, is
searched over for nothing: the searcher spends trials on a dimension that changes
nothing, and the study says nothing of it.

What a builder reads is found two ways, the cheap one first: the strings its code and
the code of the other functions and classes of its file hold (`params["hidden"]`,
`params.get("hidden", 64)`); then, only for names still unexplained, the keys it looks
up when called once with a point of the space (a name made at run time,
`params[f"units{i}"]`). A builder that takes no argument reads nothing; one that goes
through all the parameters (`Net(**params)`, `for k in params`) reads them all.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from nbdist.hpo.space import Space
from nbdist.hpo.space_input import parse_space
from nbdist.hpo.trial import OPTIMIZER_PARAMS, TrialError, takes_params
from nbdist.options import StudyOptions, TrainOptions
from nbdist.specs import did_you_mean

__all__ = ["check_space_is_read", "check_params_read", "unread_params"]

BUILDERS = ("build_model", "build_generator", "build_discriminator")


def check_space_is_read(study: StudyOptions, train: TrainOptions, definition: Any) -> None:
    """At a study's set-up: TrialError when a parameter of its --space is read by no part
    of the run. `definition`: the model's ModelDefinition, or a function that makes it
    (loads the model file: its errors are the trials' own)."""
    if not study.space:
        return
    space = parse_space(study.space)
    definition = definition() if callable(definition) else definition
    check_params_read(space, definition, space.sample(np.random.default_rng(train.seed)))


def check_params_read(space: Space, definition: Any, point: dict[str, Any]) -> None:
    """TrialError naming the parameters of `space` that no part of the run reads, and
    the ones that are read. `definition`: the model's (a ModelDefinition); `point`: a
    point of the space, for a builder whose reads only a call shows."""
    unread, read_by = unread_params(list(space), definition, point)
    if not unread:
        return
    names = ", ".join(repr(n) for n in unread)
    known = sorted({*read_by_options(), *(n for _, reads in read_by.values() for n in reads)})
    hints = "".join(did_you_mean(n, known) for n in unread)
    read = ", ".join(n for n in space if n not in unread) or "none"
    builders = " and ".join(
        f"{name}(params)" if takes else f"{name}(), which takes no parameters" for name, (takes, _) in read_by.items()
    )
    one = len(unread) == 1
    raise TrialError(
        f"--space: {'the parameter' if one else 'the parameters'} {names} {'is' if one else 'are'} read by no "
        f"part of the run{hints}; those read are: {read}. A parameter sets the training option of its name "
        f"(optimizer, lr and momentum set the optimiser) or goes to {builders or 'the model builder'}; "
        f"rename {'it' if one else 'them'} or leave {'it' if one else 'them'} out of --space"
    )


def read_by_options() -> list[str]:
    """The parameter names a trial's training options take (hpo/trial.py, trial_options)."""
    return [f.name for f in dataclasses.fields(TrainOptions)] + list(OPTIMIZER_PARAMS)


def unread_params(
    names: list[str], definition: Any, point: dict[str, Any]
) -> tuple[list[str], dict[str, tuple[bool, set[str]]]]:
    """(the names no part of the run reads, and for each builder: whether it takes the
    parameters and which of `names` it reads)."""
    left = [n for n in names if n not in read_by_options()]
    builders = {name: build for name in BUILDERS if (build := getattr(definition, name, None)) is not None}
    read_by: dict[str, tuple[bool, set[str]]] = {}
    for name, build in builders.items():
        takes = takes_params(build)
        read_by[name] = (takes, _strings_of(build) & set(names) if takes else set())
    left = [n for n in left if not any(n in reads for _, reads in read_by.values())]
    for name, build in builders.items():
        if not left or not read_by[name][0]:
            continue
        looked_up = _looked_up(build, point)
        if looked_up is None:  # it failed: its trials will say why; nothing is known here
            return [], read_by
        read_by[name][1].update(set(names) if looked_up is _ALL else looked_up & set(names))
        left = [n for n in left if n not in read_by[name][1]]
    return left, read_by


def _strings_of(build: Callable[..., Any]) -> set[str]:
    """Every string constant in the code of `build` and of the functions and classes
    defined beside it (the model file, the cell): where `params["name"]` names them."""
    code = getattr(build, "__code__", None)
    if code is None:
        return set()
    codes = [code]
    for value in getattr(build, "__globals__", {}).values():
        functions = [value] if inspect.isfunction(value) else []
        if inspect.isclass(value):
            functions = [v for v in vars(value).values() if inspect.isfunction(v)]
        codes += [f.__code__ for f in functions if f.__code__.co_filename == code.co_filename]
    return {c for each in codes for c in _constants(each) if isinstance(c, str)}


def _constants(code: types.CodeType) -> Iterator[Any]:
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            yield from _constants(constant)
        else:
            yield constant


_ALL: set[str] = set()  # a builder that went through every parameter


class _Recording(dict):
    """The parameters, noting which a builder looks up."""

    def __init__(self, values: dict[str, Any]):
        super().__init__(values)
        self.seen: set[str] = set()
        self.everything = False

    def __getitem__(self, key: Any) -> Any:
        self.seen.add(key)
        return super().__getitem__(key)

    def get(self, key: Any, default: Any = None) -> Any:
        self.seen.add(key)
        return super().get(key, default)

    def __contains__(self, key: Any) -> bool:
        self.seen.add(key)
        return super().__contains__(key)

    def _all(self) -> None:
        self.everything = True

    def __iter__(self) -> Iterator[Any]:
        self._all()
        return super().__iter__()

    def keys(self) -> Any:
        self._all()
        return super().keys()

    def items(self) -> Any:
        self._all()
        return super().items()

    def values(self) -> Any:
        self._all()
        return super().values()

    def copy(self) -> dict[str, Any]:
        self._all()
        return dict(super().items())


def _looked_up(build: Callable[..., Any], point: dict[str, Any]) -> set[str] | None:
    """The keys `build` looks up when called with `point` (_ALL: it went through them all;
    None: it failed)."""
    params = _Recording(point)
    try:
        build(params)
    except Exception:  # noqa: BLE001 - the user's builder: its trials report its failure
        return None
    return _ALL if params.everything else params.seen
