"""torch.optim without importing torch._dynamo, until something does import it.

Two wrappers of torch.optim import torch._dynamo on their first call: the one around
`Optimizer`'s add_param_group, zero_grad, state_dict and load_state_dict
(`torch._compile._disable_dynamo`, so that torch.compile never traces them), and the one
around each optimiser's `step` (`_use_grad_for_differentiable`: the grad mode, and graph
breaks for torch.compile). Every rank of every nbdist job builds and steps an optimiser
(and checks the user's at set-up), so every rank paid that import, about as much CPU again
as importing torch itself (bench/results/2026-11-27-startup.md), in runs that compile
nothing.

`step_without_dynamo(opt)` is `opt.step()` while torch._dynamo is not imported and the
wrappers around the step would do nothing else (no optimiser hook anywhere, no profiler):
the step function itself under the grad mode the wrapper sets. Otherwise it is `opt.step()`.

`defer_dynamo_import()` fills the first wrapper's caches with the plain functions instead, only while
torch._dynamo is not imported: until then no frame can be traced by dynamo, so calling the
plain function is exactly what the disabled one does. A finder at the head of
`sys.meta_path` takes the caches out again the moment anything imports torch._dynamo
(torch.compile, torch.export, a user's own import), before dynamo's code runs; from then on
the wrapper builds dynamo's disabled function on the next call, as it always does.
tests/test_torch_dynamo_deferred.py checks both sides: a plain run never imports dynamo,
its steps are opt.step()'s bit for bit, and a compiled model still trains, with the
methods disabled for dynamo again.
"""

from __future__ import annotations

import importlib.abc
import inspect
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["defer_dynamo_import", "deferred_functions", "step_without_dynamo"]

DYNAMO = "torch._dynamo"
CACHE = "__dynamo_disable"  # the attribute torch._compile._disable_dynamo caches in

_lock = threading.RLock()  # re-entrant: an import under it may call the finder
_deferred: list[Callable[..., Any]] = []  # the wrapped functions whose cache holds themselves


def _disabled_wrappers(owner: type) -> list[Callable[..., Any]]:
    """The functions of `owner` that torch._compile._disable_dynamo wrapped (the
    undecorated ones, whose cache attribute the wrapper reads)."""
    from torch._compile import _disable_dynamo

    wrapper_code = _disable_dynamo(_disabled_wrappers).__code__  # every such wrapper runs this code
    found = []
    for value in vars(owner).values():
        inner = getattr(value, "__wrapped__", None)
        if getattr(value, "__code__", None) is wrapper_code and callable(inner):
            found.append(inner)
    return found


class _UndeferOnImport(importlib.abc.MetaPathFinder):
    """Empties the primed caches when torch._dynamo is about to be imported (and then
    leaves sys.meta_path); it finds nothing itself, so the import goes on as usual."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: Any = None) -> None:
        if fullname == DYNAMO:
            _undefer()
        return None


_finder = _UndeferOnImport()


def _undefer() -> None:
    with _lock:
        for fn in _deferred:
            if getattr(fn, CACHE, None) is fn:
                delattr(fn, CACHE)
        _deferred.clear()
        if _finder in sys.meta_path:
            sys.meta_path.remove(_finder)


def defer_dynamo_import() -> None:
    """Let torch.optim's optimisers run without importing torch._dynamo while nothing
    compiles (a no-op once it is imported). Idempotent."""
    import torch.optim

    wrapped = _disabled_wrappers(torch.optim.Optimizer)
    with _lock:
        if DYNAMO in sys.modules or _deferred:
            return
        for fn in wrapped:
            if getattr(fn, CACHE, None) is None:
                setattr(fn, CACHE, fn)
                _deferred.append(fn)
        if _deferred:
            sys.meta_path.insert(0, _finder)


def deferred_functions() -> list[Callable[..., Any]]:
    """The functions whose dynamo wrapper currently calls them plain (for the tests)."""
    with _lock:
        return list(_deferred)


def step_without_dynamo(opt: Any) -> None:
    """`opt.step()` (a torch.optim optimiser), without importing torch._dynamo where the
    wrappers around the step would do nothing but that import."""
    import torch
    from torch.optim import optimizer as optim_module

    if (
        DYNAMO in sys.modules  # nothing left to save
        or opt.defaults.get("differentiable")  # the wrapper then keeps autograd on
        or opt._optimizer_step_pre_hooks
        or opt._optimizer_step_post_hooks
        or getattr(optim_module, "_global_optimizer_pre_hooks", True)  # True: a torch without them
        or getattr(optim_module, "_global_optimizer_post_hooks", True)
        or torch.autograd.profiler._is_profiler_enabled
    ):
        opt.step()
        return
    with torch.no_grad():  # what the step wrapper sets for a non-differentiable optimiser
        inspect.unwrap(type(opt).step)(opt)
