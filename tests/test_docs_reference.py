"""The docs reference is generated from the code (docs/_ext/nbdist_reference.py), so it
cannot drift: every option and command-line argument must carry help (the build stops
otherwise, and so does this test, without building), whatever a registry holds shows on
its page, and the site loads nothing from the internet (docs/_ext/offline_site.py)."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

import nbdist_reference as reference  # noqa: E402
import offline_site  # noqa: E402

from nbdist.options import StudyOptions, TrainOptions  # noqa: E402
from nbdist.registry import Registry  # noqa: E402


def test_every_option_has_help_and_shows_on_the_options_page():
    page = reference.options_page()
    for config in (TrainOptions, StudyOptions):
        for f in reference.option_fields(config):  # raises MissingHelp for an option without
            assert f"`--{f.name.replace('_', '-')}`" in page


def test_an_option_without_help_is_named():
    @dataclasses.dataclass
    class Toy:
        fine: int = dataclasses.field(default=1, metadata={"help": "says what it does"})
        bare: int = dataclasses.field(default=2, metadata={"help": " "})

    with pytest.raises(reference.MissingHelp, match="Toy option.*: bare"):
        reference.option_fields(Toy)


def test_every_command_line_argument_has_help_and_every_command_shows():
    page = reference.cli_page()  # raises MissingHelp for an argument without
    for command in ("train", "study", "launch", "slurm-script", "dashboard", "store import", "layout"):
        assert f"## `python -m nbdist {command}`" in page
    assert "`--hostfile`" in page and "`--token-file`" in page
    assert "--token`" not in page.replace("--token-file`", "")  # the refused flag stays hidden
    assert "%distnn cluster start`" in page


def test_an_argument_without_help_is_named():
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--fine", help="says what it does")
    parser.add_argument("--bare")
    with pytest.raises(reference.MissingHelp, match="toy: argument.*--bare"):
        reference.arguments(parser, "toy")


class _ToyRule:
    """A rule that only tests register."""

    name = "toy-rule"
    parameter_help = {"lr": "the toy's step size"}

    def __init__(self, lr: float = 0.25, momentum: float = 0.0):
        self.lr, self.momentum = lr, momentum


def test_a_class_registered_on_a_registry_shows_on_the_registries_page():
    toys = Registry("toy rule")
    try:
        toys.register(_ToyRule)
        page = reference.registries_page([toys])
        assert "## Toy rules" in page
        assert "`toy-rule(lr=0.25, momentum=0.0)`" in page
        assert "A rule that only tests register." in page
        assert "`lr=0.25`: the toy's step size" in page
    finally:
        Registry._every.remove(toys)


def test_every_registry_of_nbdist_is_listed():
    found = reference.registries()
    page = reference.registries_page(found)
    for registry in found:
        for name in registry.names():
            assert registry.describe(name).split("(")[0] in page


def test_markdown_in_help_text_is_escaped_and_flags_and_quoted_code_are_code():
    assert reference.text("a | b *c* <d>") == r"a \| b \*c\* \<d\>"
    assert reference.text("with --topology allreduce, `x_y`") == "with `--topology` allreduce, `x_y`"


def test_a_page_that_loads_from_another_host_is_found():
    html = """<link rel="stylesheet" href="https://cdn.example.org/x.css">
    <script src="//cdn.example.org/x.js"></script><script src="_static/local.js"></script>
    <a href="https://keepachangelog.com/">a link a reader may follow</a>
    <link rel="canonical" href="https://example.org/page.html">"""
    assert offline_site.remote_loads(html) == ["https://cdn.example.org/x.css", "//cdn.example.org/x.js"]
