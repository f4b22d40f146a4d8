"""The registry every extension point uses: lookup, description and building from a spec."""

from __future__ import annotations

import pytest

from nbdist.registry import Registry
from nbdist.specs import SpecError


def _toys() -> Registry:
    toys: Registry = Registry("toy rule")

    @toys.register
    class Plain:
        """Adds nothing: the smallest rule there is.

        More text that the summary leaves out."""

        name = "plain"

        def __init__(self) -> None:
            pass

    @toys.register
    class Scaled:
        """Scales by a factor."""

        name = "scaled"
        parameter_help = {"factor": "what to multiply by"}

        def __init__(self, size: int, *, factor: float = 2.0, shift: float = 0.0) -> None:
            if factor <= 0:
                raise ValueError(f"factor must be > 0, got {factor}")
            self.size, self.factor, self.shift = size, factor, shift

    return toys


def test_describes_each_entry_from_its_signature_docstring_and_help():
    toys = _toys()
    toys_skipping_size: Registry = Registry("toy rule", skip=1)
    toys_skipping_size.register(toys.get("scaled"))
    assert toys.names() == ["plain", "scaled"]
    assert toys.summary("plain") == "Adds nothing: the smallest rule there is."
    assert toys.describe("plain") == "plain"
    params = toys_skipping_size.parameters("scaled")
    assert [(p.name, p.default, p.help) for p in params] == [
        ("factor", 2.0, "what to multiply by"),
        ("shift", 0.0, ""),
    ]
    assert toys_skipping_size.describe("scaled") == "scaled(factor=2.0, shift=0.0)"
    assert toys.help_text(default="plain").startswith("plain (default): Adds nothing")


def test_builds_from_a_spec_with_the_values_nbdist_supplies():
    toys: Registry = Registry("toy rule", skip=1)
    toys.register(_toys().get("scaled"))
    built = toys.build("scaled(factor=3)", 10)
    assert (built.size, built.factor, built.shift) == (10, 3, 0.0)


def test_unknown_names_parameters_and_refused_values_are_one_clear_error():
    toys: Registry = Registry("toy rule", skip=1)
    toys.register(_toys().get("scaled"))
    with pytest.raises(
        SpecError, match=r"unknown toy rule 'scaler' \(did you mean 'scaled'\?\); choose one of: scaled"
    ):
        toys.build("scaler", 1)
    with pytest.raises(SpecError, match="takes no parameter 'size'; it takes: factor, shift"):
        toys.build("scaled(size=3)", 1)
    with pytest.raises(SpecError, match=r"toy rule scaled\(factor=-1\): factor must be > 0, got -1"):
        toys.build("scaled(factor=-1)", 1)


def test_a_name_is_registered_once_and_an_entry_can_be_removed():
    toys = _toys()

    class Other:
        name = "plain"

    with pytest.raises(ValueError, match="named 'plain' is registered already"):
        toys.register(Other)
    with pytest.raises(TypeError, match="needs a non-empty `name`"):
        toys.register(type("Nameless", (), {}))
    toys.unregister("plain")
    assert "plain" not in toys and len(toys) == 1


def test_every_registry_made_is_listed_for_the_docs_and_the_contract_tests():
    toys = _toys()
    assert any(registry is toys for registry in Registry.every())


def test_parameters_nbdist_supplies_are_neither_listed_nor_taken_from_a_spec():
    searchers: Registry = Registry("toy searcher", skip=1, supplied=("seed",))

    @searchers.register
    class Toy:
        """Draws points."""

        name = "toy"

        def __init__(self, space: str, *, seed: int = 0, points: int = 5) -> None:
            self.space, self.seed, self.points = space, seed, points

    assert searchers.describe("toy") == "toy(points=5)"
    assert searchers.build("toy(points=3)", "x=real(0,1)", seed=7).seed == 7
    with pytest.raises(SpecError, match="takes no parameter 'seed'; it takes: points"):
        searchers.build("toy(seed=3)", "x=real(0,1)")


def test_a_registry_is_found_by_its_kind_and_a_test_s_toys_go_with_it():
    import gc

    toys: Registry = Registry("short-lived toy rule")
    assert Registry.named("short-lived toy rule") is toys
    del toys
    gc.collect()
    assert all(registry.kind != "short-lived toy rule" for registry in Registry.every())
    with pytest.raises(LookupError, match="no short-lived toy rule registry"):
        Registry.named("short-lived toy rule")


def test_nbdist_s_registries_load_without_mpi_or_a_framework(pyrun):
    """The options list every registry's entries in --help: the notebook's kernel and the
    launcher's process import them, and must not start MPI or load torch doing so."""
    done = pyrun(
        [
            "-c",
            "import sys, nbdist.options, nbdist.hpo\n"
            "from nbdist.registry import Registry\n"
            "print(sorted(r.kind for r in Registry.every()))\n"
            "print(sorted(m for m in ('mpi4py.MPI', 'torch', 'tensorflow', 'keras') if m in sys.modules))",
        ]
    )
    assert done.returncode == 0, done.output
    kinds, heavy = done.stdout.strip().splitlines()[-2:]
    assert kinds == str(sorted(["update rule", "codec", "allreduce backend", "searcher", "scheduler"]))
    assert heavy == "[]"
