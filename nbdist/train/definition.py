"""What the user provides: a model factory, optionally a loss, a metric and data.

From a file (`--model examples/digits_mlp.py`) or from Python objects (the API and the
notebook cell). Every rank runs the file or the factory itself, so each builds its own
model and its own data; nothing is pickled between processes.
"""

from __future__ import annotations

import runpy
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from nbdist.backends.base import ModelError
from nbdist.data.base import Data

__all__ = ["ModelDefinition", "load_model_file", "definition_from_namespace"]


@dataclass(slots=True)
class ModelDefinition:
    build_model: Callable[[], Any]
    loss: Any = None
    metric: Any = "accuracy"
    data: Callable[[], Data] | Data | None = None
    source: str = "<python>"

    def make_data(self) -> Data:
        if self.data is None:
            from nbdist.datasets import digits

            return digits()
        data = self.data() if callable(self.data) else self.data
        if not isinstance(data, Data):
            raise ModelError(
                f"{self.source}: data must be an nbdist.data.ArrayData or HDF5Data (or a function returning "
                f"one), got {type(data).__name__}"
            )
        return data

    def make_model(self) -> Any:
        try:
            return self.build_model()
        except Exception as exc:  # the user's code: report it as theirs, where it failed
            raise ModelError(f"{self.source}: build_model() failed: {_short(exc)}") from exc


def _short(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({Path(frames[-1].filename).name}, line {frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def load_model_file(path: str | Path) -> ModelDefinition:
    """Run a model file and collect build_model (or model), loss, metric and data from it."""
    file = Path(path)
    if not file.exists():
        raise ModelError(f"model file {str(path)!r} not found")
    if file.is_dir() or file.suffix != ".py":
        raise ModelError(f"model file {str(path)!r} must be a Python file (.py)")
    try:
        namespace = runpy.run_path(str(file), run_name="__nbdist_model__")
    except SyntaxError as exc:
        raise ModelError(f"model file {file}: syntax error on line {exc.lineno}: {exc.msg}") from None
    except Exception as exc:
        raise ModelError(f"model file {file} failed while loading: {_short(exc)}") from exc

    return definition_from_namespace(namespace, f"model file {file}")


def definition_from_namespace(namespace: dict[str, Any], source: str) -> ModelDefinition:
    """build_model (or a ready `model`), loss, metric and load_data (or `data`) from the
    names a model file or a notebook cell defined."""
    build = namespace.get("build_model")
    if build is None and "model" in namespace:
        model = namespace["model"]
        build = lambda: model  # noqa: E731 - a ready-made model object
    if not callable(build):
        raise ModelError(
            f"{source} defines no build_model() function (or `model` object); "
            f"add e.g.  def build_model(): return torch.nn.Sequential(...)"
        )
    data = namespace.get("load_data", namespace.get("data"))
    return ModelDefinition(
        build_model=build,
        loss=namespace.get("loss"),
        metric=namespace.get("metric", "accuracy"),
        data=data,
        source=source,
    )
