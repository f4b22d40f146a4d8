"""The public surface carries structured docstrings (what it takes, what it returns, an
example), which the API reference is built from; the examples that need no cluster run
here as doctests, so that none of them goes stale."""

from __future__ import annotations

import doctest
import inspect

import pytest

from nbdist import api
from nbdist.algorithms.base import Algorithm
from nbdist.backends.base import Backend
from nbdist.cluster import Cluster
from nbdist.hpo.searcher import Searcher
from nbdist.job import Job
from nbdist.notebook_study import Study
from nbdist.transport.compression import Codec
from nbdist.transport.reducers import Reducer

PUBLIC = [api.train, api.study, Study, Cluster, Job, Algorithm, Searcher, Codec, Reducer, Backend]


@pytest.mark.parametrize("obj", PUBLIC, ids=lambda o: o.__qualname__)
def test_the_public_surface_has_structured_docstrings(obj):
    doc = inspect.getdoc(obj) or ""
    assert "Example:" in doc, f"{obj.__qualname__}: no example"
    if inspect.isfunction(obj):
        assert "Args:" in doc and "Returns:" in doc, f"{obj.__qualname__}: no Args or Returns"
    elif "__init__" in vars(obj) and len(inspect.signature(obj).parameters) > 0:
        assert "Args:" in doc, f"{obj.__qualname__}: its constructor's arguments are not described"


RUNNABLE = [obj for obj in PUBLIC if ">>>" in (obj.__doc__ or "")]


def test_the_examples_that_need_no_cluster_are_doctests():
    assert {o.__qualname__ for o in RUNNABLE} >= {"Algorithm", "Searcher", "Codec", "Reducer", "Backend"}


@pytest.mark.parametrize("obj", RUNNABLE, ids=lambda o: o.__qualname__)
def test_the_docstring_example_runs(obj):
    finder = doctest.DocTestFinder(recurse=False)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(obj, obj.__qualname__, globs={}):
        runner.run(test)
    results = runner.summarize(verbose=False)
    assert results.attempted > 0
    assert results.failed == 0, f"{obj.__qualname__}: {results.failed} of its example's lines failed"
