"""The docs reference pages that must never drift from the code, written at every build.

When the builder starts, this extension writes these pages (git ignores them) from what
the code itself declares:

- reference/options.md: the options of `python -m nbdist train` / `study`, `%%distnn` and
  `nbdist.train(...)`, from the fields of TrainOptions and StudyOptions (their help, type,
  default, choices);
- reference/cli.md: the command line, from the argparse parsers of `python -m nbdist` and
  of `%distnn`;
- reference/registries.md: the registries' entries (update rules, codecs, ...), from
  `nbdist.registry.Registry.every()` after importing every nbdist module that makes a
  registry or registers on one;
- tutorials/*.ipynb: copies of notebooks/*.ipynb, rendered without running them (the test
  suite runs them), and results/*.md: copies of the dated bench/results/*.md.

An option or a command-line argument without help stops the build with one error naming
it (tests/test_docs_reference.py checks the same without building). The functions below
take no Sphinx object, so the tests call them directly.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
import shutil
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parent.parent
ROOT = DOCS.parent

# Modules that make a registry or register a class on one: what must be imported before
# Registry.every() lists them all.
_REGISTERS = re.compile(r"\bRegistry\(|@\w+\.register\b|\b\w+\.register\(")


class MissingHelp(Exception):
    """An option or argument that would show in the reference without saying what it does."""


# -- Markdown helpers ---------------------------------------------------------------------
_MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]<>|#])")
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*(?:=[^\s),;]+)?)")


def text(value: object) -> str:
    """Help text as Markdown on one line: Markdown's own characters escaped, except that a
    `quoted` span stays code, as the help texts mean it."""
    parts = " ".join(str(value).split()).split("`")
    if len(parts) % 2 == 0:  # an odd backtick: no code spans
        parts = ["`".join(parts)]
    return "".join(code(part) if i % 2 else _plain(part) for i, part in enumerate(parts))


def _plain(part: str) -> str:
    """Markdown's own characters escaped; a flag (`--epochs`) set as code."""
    pieces = _FLAG.split(part)
    return "".join(code(p) if i % 2 else _MARKDOWN_SPECIAL.sub(r"\\\1", p) for i, p in enumerate(pieces))


def code(value: object) -> str:
    """Inline code for a table cell (a backtick inside takes a longer fence)."""
    value = " ".join(str(value).split()).replace("|", "\\|")
    fence = "``" if "`" in value else "`"
    return f"{fence}{value}{fence}" if value else ""


def table(header: Iterable[str], rows: Iterable[Iterable[str]]) -> list[str]:
    header = list(header)
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return [*lines, ""]


def write_if_changed(path: Path, content: str) -> None:
    """Rewrite a page only when it changed, so that Sphinx reads again only what did."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text() != content:
        path.write_text(content)


# -- options ------------------------------------------------------------------------------
def option_fields(config: type) -> list[dataclasses.Field]:
    """The fields of an options dataclass; one without help raises MissingHelp."""
    found = dataclasses.fields(config)
    missing = [f.name for f in found if not str(f.metadata.get("help", "")).strip()]
    if missing:
        raise MissingHelp(f"{config.__name__} option(s) without help: {', '.join(missing)} (give _opt(..., help))")
    return list(found)


def options_page() -> str:
    from nbdist.options import StudyOptions, TrainOptions, field_kind, flag

    def rows(config: type) -> list[list[str]]:
        out = []
        for f in option_fields(config):
            kind, optional = field_kind(f)
            choices = f.metadata.get("choices")
            helptext = text(f.metadata["help"])
            if choices:
                helptext = f"{helptext.rstrip('.')}. Choices: {', '.join(map(code, choices))}."
            default = "none" if f.default is None else code(f.default)
            kind_name = kind.__name__ + (" or None" if optional else "")
            out.append([code(flag(f.name)), kind_name, default, helptext])
        return out

    header = ["option", "type", "default", "what it does"]
    lines = [
        "# Options",
        "",
        "Generated at every build from the fields of `nbdist.options.TrainOptions` and",
        "`StudyOptions`: the command line (`python -m nbdist train --epochs 5`), the magics",
        "(`%%distnn train --epochs 5`) and the Python API (`nbdist.train(..., epochs=5)`) take",
        "these options with these names (the keyword is the flag with underscores).",
        "",
        "(training-options)=",
        "## Training options",
        "",
        "`python -m nbdist train`, `%%distnn train`, `nbdist.train(...)`; a study's trials take",
        "them too.",
        "",
        *table(header, rows(TrainOptions)),
        "(study-options)=",
        "## Study options",
        "",
        "`python -m nbdist study`, `%%distnn study`, `nbdist.study(...)`, beside the training",
        "options (except `--resume` and `--run-name`: each trial's run has its own).",
        "",
        *table(header, rows(StudyOptions)),
    ]
    return "\n".join(lines)


# -- command line -------------------------------------------------------------------------
def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _help_of(parser: argparse.ArgumentParser, name: str) -> str:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if choice.dest == name:
                    return choice.help or ""
    return ""


def arguments(parser: argparse.ArgumentParser, where: str) -> list[argparse.Action]:
    """A parser's own arguments (not -h, not the hidden ones); one without help raises
    MissingHelp naming it and `where` it is."""
    found = [
        a
        for a in parser._actions
        if not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) and a.help != argparse.SUPPRESS
    ]
    missing = [("/".join(a.option_strings) or a.dest) for a in found if not (a.help or "").strip()]
    if missing:
        raise MissingHelp(f"{where}: argument(s) without help: {', '.join(missing)}")
    return found


def _argument_rows(parser: argparse.ArgumentParser, where: str, skip: set[str]) -> list[list[str]]:
    rows = []
    for action in arguments(parser, where):
        if action.dest in skip:
            continue
        names = ", ".join(action.option_strings) or (action.metavar or action.dest)
        helptext = (action.help or "") % {"default": action.default, "prog": parser.prog}
        if action.choices and not isinstance(action, argparse._SubParsersAction):
            helptext = f"{helptext.rstrip('.')}. Choices: {', '.join(map(str, action.choices))}."
        default = action.default
        shown = "" if default in (None, False, argparse.SUPPRESS) or action.required else code(default)
        rows.append([code(names), shown, text(helptext)])
    return rows


def _commands(parser: argparse.ArgumentParser, prefix: str, skip: dict[str, set[str]], depth: int = 2) -> list[str]:
    """Markdown for every sub-command of `parser`, depth-first. `skip` names the options
    (by section of the options page) that the options page lists instead."""
    lines: list[str] = []
    for name, child in _subparsers(parser).items():
        title = f"{prefix} {name}"
        lines += [f"{'#' * depth} `{title}`", ""]
        about = child.description or _help_of(parser, name)
        if about:
            lines += [text(about), ""]
        dests = {a.dest for a in child._actions}
        options = set().union(*skip.values())
        usage = " ".join(child.format_usage().split())
        if dests & options:  # every option spelled out would fill a screen
            usage = f"usage: {title} [-h] [OPTIONS]" + (" ..." if _subparsers(child) else "")
        lines += ["```text", usage, "```", ""]
        rows = _argument_rows(child, title, options)
        if rows:
            lines += table(["argument", "default", "what it does"], rows)
        kinds = [ref for ref, names in skip.items() if dests & names]
        if kinds:
            lines += ["Its options are the " + " and the ".join(f"{{ref}}`{ref}`" for ref in kinds) + ".", ""]
        lines += _commands(child, title, skip, depth + 1)
    return lines


def cli_page() -> str:
    from nbdist.cli import build_parser
    from nbdist.options import StudyOptions, TrainOptions

    # The options of train and study are on the options page, once.
    options = {
        "training-options": {f.name for f in dataclasses.fields(TrainOptions)},
        "study-options": {f.name for f in dataclasses.fields(StudyOptions)},
    }
    lines = [
        "# Command line",
        "",
        "Generated at every build from the argparse parsers of `python -m nbdist`",
        "(`nbdist.cli.build_parser`) and of the `%distnn` magics (`nbdist.magics`).",
        "`python -m nbdist COMMAND --help` prints the same.",
        "",
        *_commands(build_parser(), "python -m nbdist", options),
    ]
    magics = _magics_parser()
    if magics is not None:
        lines += [
            "## `%distnn` and `%%distnn`",
            "",
            "In a notebook after `%load_ext nbdist`; `%distnn?` prints the same.",
            "",
            *_commands(magics, "%distnn", options, depth=3),
        ]
    return "\n".join(lines)


def _magics_parser() -> argparse.ArgumentParser | None:
    try:
        from nbdist.magics import DistnnMagics
    except ImportError:  # IPython is the notebook extra's
        return None
    return DistnnMagics.distnn.parser


# -- registries -----------------------------------------------------------------------------
def registering_modules() -> list[str]:
    """The nbdist modules whose source makes a registry or registers a class on one."""
    found = []
    for path in sorted((ROOT / "nbdist").rglob("*.py")):
        if _REGISTERS.search(path.read_text()):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


def registries() -> list[Any]:
    """Every registry of nbdist, its modules imported first (those whose optional framework
    is missing are left out, as the registry itself would be)."""
    from nbdist.registry import Registry

    for name in registering_modules():
        try:
            importlib.import_module(name)
        except ImportError:
            continue
    return Registry.every()


def _parameters(registry: Any, name: str) -> str:
    parts = []
    for p in registry.parameters(name):
        head = code(p.name if p.required else f"{p.name}={p.default!r}")
        parts.append(f"{head}: {text(p.help)}" if p.help else head)
    return "; ".join(parts)


def registries_page(found: list[Any] | None = None) -> str:
    found = registries() if found is None else found
    lines = [
        "# Registries",
        "",
        "Generated at every build from `nbdist.registry.Registry.every()`: every extension point",
        "that nbdist looks names up in, and what is registered on it. A class registered on a",
        "registry shows here with its name, its parameters (defaults from its constructor, help",
        "from its `parameter_help`) and the first line of its docstring; the command line's help",
        "and the contract tests take the same. See {doc}`/reference/api` for the `Registry` class.",
        "",
    ]
    if not found:
        lines += ["No registry has entries yet.", ""]
    for registry in sorted(found, key=lambda r: r.kind):
        lines += [f"## {text(registry.kind[:1].upper() + registry.kind[1:])}s", ""]
        if not len(registry):
            lines += ["Nothing registered yet.", ""]
            continue
        rows = [
            [code(registry.describe(name)), text(registry.summary(name)), _parameters(registry, name)]
            for name in registry.names()
        ]
        lines += table(["spec", "what it is", "parameters"], rows)
    return "\n".join(lines)


# -- copies: tutorials and dated results ------------------------------------------------------
def copy_files(sources: Iterable[Path], into: Path, suffix: str) -> None:
    """The `suffix` files of `into` are exactly copies of `sources` (their times kept, so
    Sphinx reads only what changed); its other files are left alone."""
    into.mkdir(parents=True, exist_ok=True)
    sources = list(sources)
    names = {s.name for s in sources}
    for old in into.glob(f"*{suffix}"):
        if old.name not in names:
            old.unlink()
    for source in sources:
        target = into / source.name
        if not target.exists() or target.stat().st_mtime != source.stat().st_mtime:
            shutil.copy2(source, target)


def generate() -> None:
    """Write every generated page and copy."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    write_if_changed(DOCS / "reference" / "options.md", options_page())
    write_if_changed(DOCS / "reference" / "cli.md", cli_page())
    write_if_changed(DOCS / "reference" / "registries.md", registries_page())
    copy_files(sorted((ROOT / "notebooks").glob("*.ipynb")), DOCS / "tutorials", ".ipynb")
    copy_files(sorted((ROOT / "bench" / "results").glob("*.md")), DOCS / "results", ".md")


def _on_builder_inited(app: Any) -> None:
    from sphinx.errors import ExtensionError

    try:
        generate()
    except MissingHelp as exc:
        raise ExtensionError(str(exc)) from None


def setup(app: Any) -> dict[str, Any]:
    app.connect("builder-inited", _on_builder_inited)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
