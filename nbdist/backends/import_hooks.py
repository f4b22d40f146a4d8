"""A call made the moment a module is first imported: how a framework the user's code
imports itself is configured before that code's next line.

`configure_frameworks` seeds the frameworks already imported, before and after the user's
code runs. A model that code builds right after its own `import torch` (at the top of a
model file or a notebook cell, or in a `build_model()` that imports inside) is drawn in
between, from an unseeded generator: `--seed` would not reproduce it. `on_first_import`
puts a finder first on `sys.meta_path` that, for the one module named, wraps its loader
to make the call once the module has run. The wrapper hands the module its real loader
before it runs (as wrapt's post-import hooks do), so nothing that reads `__loader__` or
`__spec__.loader` ever sees it.
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable, Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

__all__ = ["on_first_import"]

# Module name -> what to call once it has been imported (the latest registered).
_PENDING: dict[str, Callable[[ModuleType], None]] = {}


def on_first_import(name: str, call: Callable[[ModuleType], None]) -> None:
    """`call(module)` right after the top-level module `name`, not imported yet, is
    imported, in place of a call registered for it before."""
    _PENDING[name] = call
    if not any(isinstance(finder, _CallAfterImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _CallAfterImport())


class _CallAfterImport(importlib.abc.MetaPathFinder):
    """Finds a pending module through the other finders and wraps the loader they give."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname not in _PENDING:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _LoaderThenCall(spec.loader, fullname)
        return spec


class _LoaderThenCall(importlib.abc.Loader):
    def __init__(self, loader: Any, name: str):
        self.loader, self.name = loader, name

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        self.loader.exec_module(module)
        call = _PENDING.pop(self.name, None)
        if call is not None:
            call(module)
