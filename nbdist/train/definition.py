"""What the user provides: a model factory, optionally a loss, a metric and data.

From a file (`--model examples/digits_mlp.py`) or from Python objects (the API and the
notebook cell). Every rank runs the file or the factory itself, so each builds its own
model and its own data; nothing is pickled between processes. A GAN (`--gan`) is a
generator and a discriminator factory and the latent size instead of one model.
"""

from __future__ import annotations

import runpy
import stat
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nbdist.backends.base import ModelError
from nbdist.data.base import Data
from nbdist.errors import UserError
from nbdist.gan.model import GanModel

__all__ = ["ModelDefinition", "definition_of", "load_model_file", "definition_from_namespace", "prefer_fresh"]

# Names that stand in for one another: a cell that defines one of them replaces the others.
_ALTERNATIVES = (
    ("build_model", "model"),
    ("build_generator", "generator"),
    ("build_discriminator", "discriminator"),
    ("load_data", "data"),
)


@dataclass(slots=True)
class ModelDefinition:
    build_model: Callable[[], Any] | None
    loss: Any = None
    metric: Any = "accuracy"
    data: Callable[[], Data] | Data | None = None
    source: str = "<python>"
    build_generator: Callable[[], Any] | None = None
    build_discriminator: Callable[[], Any] | None = None
    latent_dim: int | None = None
    build_stages: Callable[[], Any] | None = None  # --worker-parallel pipeline: the model as stages
    # A study's objectives measured on the trained model: name -> function of the model.
    objectives: dict[str, Callable[[Any], float]] = field(default_factory=dict)

    def make_data(self) -> Data:
        if self.data is None:
            from nbdist.datasets import digits

            return digits()
        data = self._load_data() if callable(self.data) else self.data
        if not isinstance(data, Data):
            raise ModelError(
                f"{self.source}: data must be an nbdist.data.ArrayData or HDF5Data (or a function returning "
                f"one), got {type(data).__name__}"
            )
        return data

    def _load_data(self) -> Any:
        """The model file's load_data() (or the API's data function), its own failure
        reported as the user's, where it failed; nbdist's errors from inside it as they are."""
        assert callable(self.data)
        try:
            return self.data()
        except UserError:
            raise
        except Exception as exc:
            name = getattr(self.data, "__name__", "data")
            raise ModelError(f"{self.source}: {name}() failed: {_short(exc)}") from exc

    def make_model(self) -> Any:
        if self.build_model is None:
            raise ModelError(
                f"{self.source} defines a generator and a discriminator but no model: train them with --gan"
            )
        return _call(self.build_model, f"{self.source}: build_model()")

    def make_stages(self, count: int) -> list[Any]:
        """The model's pipeline stages, one per process of a worker (--worker-parallel
        pipeline); the whole model is these in a row (nbdist.backends.stages.stage_model)."""
        if self.build_stages is None:
            raise ModelError(
                f"--worker-parallel pipeline: {self.source} defines no build_stages(); add a function "
                f"returning the model as a list of {count} modules, one per pipeline stage"
            )
        stages = _call(self.build_stages, f"{self.source}: build_stages()")
        if not isinstance(stages, (list, tuple)) or len(stages) != count:
            got = f"{len(stages)} stages" if isinstance(stages, (list, tuple)) else f"a {type(stages).__name__}"
            raise ModelError(
                f"--worker-parallel pipeline: {self.source}: build_stages() must return a list of "
                f"{count} modules (one per process of a worker, --procs-per-worker {count}), got {got}"
            )
        return list(stages)

    def make_gan(self, d_steps: int) -> GanModel:
        """The generator and discriminator (or a GanModel that build_model() returns)."""
        if self.build_generator is None and self.build_discriminator is None and self.build_model is not None:
            built = self.make_model()
            if isinstance(built, GanModel):
                built.d_steps = d_steps
                return built
            raise ModelError(f"--gan: {self.source} defines a model but no generator and discriminator")
        build_generator, build_discriminator = self.build_generator, self.build_discriminator
        missing = [
            name
            for name, build in (("generator", build_generator), ("discriminator", build_discriminator))
            if build is None
        ]
        if build_generator is None or build_discriminator is None:
            raise ModelError(
                f"--gan: {self.source} defines no {' and no '.join(missing)}: define "
                f"`generator` and `discriminator` (or build_generator() and build_discriminator())"
            )
        if self.latent_dim is None:
            raise ModelError(
                f"--gan: {self.source} defines no latent_dim (the size of the generator's "
                f"input noise), e.g. latent_dim = 16"
            )
        generator = _call(build_generator, f"{self.source}: build_generator()")
        discriminator = _call(build_discriminator, f"{self.source}: build_discriminator()")
        return GanModel(generator, discriminator, int(self.latent_dim), d_steps)


def _call(build: Callable[[], Any], what: str) -> Any:
    try:
        return build()
    except Exception as exc:  # the user's code: report it as theirs, where it failed
        raise ModelError(f"{what} failed: {_short(exc)}") from exc


def _short(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({Path(frames[-1].filename).name}, line {frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def definition_of(
    model: Callable[..., Any] | str | Path | None, *, loss: Any = None, metric: Any = "accuracy", data: Any = None
) -> ModelDefinition | Callable[[], ModelDefinition]:
    """What a run trains, from `model` as the Python API takes it: the path of a model file
    (read where the run trains, on each rank) or a function that builds the model."""
    if isinstance(model, (str, Path)):
        return lambda: load_model_file(model)
    return ModelDefinition(
        build_model=model, loss=loss, metric=metric, data=data, source=getattr(model, "__name__", "model")
    )


def load_model_file(path: str | Path) -> ModelDefinition:
    """Run a model file and collect build_model (or model), loss, metric and data from it."""
    file = Path(path)
    if not file.exists():
        raise ModelError(f"model file {str(path)!r} not found")
    if not file.is_file():  # a directory, or a FIFO or a device that reading would block on
        raise ModelError(f"model file {str(path)!r} is {_kind(file)}, not a file: give the path of a Python file (.py)")
    if file.suffix != ".py":
        raise ModelError(f"model file {str(path)!r} must be a Python file (.py)")
    try:
        namespace = runpy.run_path(str(file), run_name="__nbdist_model__")
    except SyntaxError as exc:
        raise ModelError(f"model file {file}: syntax error on line {exc.lineno}: {exc.msg}") from None
    except Exception as exc:
        raise ModelError(f"model file {file} failed while loading: {_short(exc)}") from exc

    return definition_from_namespace(namespace, f"model file {file}")


def _kind(path: Path) -> str:
    """What `path` is when it is not a regular file (without opening it)."""
    mode = path.stat().st_mode
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a device"),
        (stat.S_ISBLK, "a device"),
    ):
        if test(mode):
            return name
    return "something else"


def _builder(namespace: dict[str, Any], name: str) -> Callable[[], Any] | None:
    """build_<name>() or a ready-made object called <name>."""
    build = namespace.get(f"build_{name}")
    if build is None and name in namespace:
        ready = namespace[name]
        build = lambda: ready  # noqa: E731 - a ready-made model object
    return build if callable(build) else None


def _whole_of(build_stages: Callable[[], Any]) -> Callable[[], Any]:
    """build_model for a file that gives only stages: the stages in a row."""

    def build_model() -> Any:
        from nbdist.backends.stages import stage_model

        return stage_model(build_stages())

    return build_model


def prefer_fresh(namespace: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """The namespace after a cell ran, without the stale alternatives of what the cell
    itself defined (a `build_model` left by an earlier cell when this one set `model`)."""
    fresh = {name for name, value in namespace.items() if name not in before or before[name] is not value}
    view = dict(namespace)
    for group in _ALTERNATIVES:
        if fresh & set(group):
            for name in set(group) - fresh:
                view.pop(name, None)
    return view


def definition_from_namespace(namespace: dict[str, Any], source: str) -> ModelDefinition:
    """build_model (or a ready `model`), loss, metric and load_data (or `data`) from the
    names a model file or a notebook cell defined; for a GAN, build_generator and
    build_discriminator (or ready `generator` and `discriminator`) and latent_dim."""
    build = _builder(namespace, "model")
    if build is None and callable(namespace.get("build_stages")):
        build = _whole_of(namespace["build_stages"])
    generator, discriminator = _builder(namespace, "generator"), _builder(namespace, "discriminator")
    if build is None and generator is None and discriminator is None:
        raise ModelError(
            f"{source} defines no build_model() function (or `model` object); "
            f"add e.g.  def build_model(): return torch.nn.Sequential(...)  (a GAN: generator, "
            f"discriminator and latent_dim, trained with --gan)"
        )
    data = namespace.get("load_data", namespace.get("data"))
    return ModelDefinition(
        build_model=build,
        loss=namespace.get("loss"),
        metric=namespace.get("metric", "accuracy"),
        data=data,
        source=source,
        build_generator=generator,
        build_discriminator=discriminator,
        latent_dim=namespace.get("latent_dim"),
        build_stages=namespace.get("build_stages") if callable(namespace.get("build_stages")) else None,
        objectives=_objectives(namespace.get("objectives"), source),
    )


def _objectives(given: Any, source: str) -> dict[str, Callable[[Any], float]]:
    """The `objectives` dict of a model file or cell: name -> function of the trained model."""
    if given is None:
        return {}
    if not isinstance(given, dict) or not all(isinstance(k, str) and callable(v) for k, v in given.items()):
        raise ModelError(
            f"{source}: objectives must be a dict of names to functions of the trained model, e.g. "
            f"objectives = {{'latency': latency}}"
        )
    return dict(given)
