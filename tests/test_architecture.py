"""The package layout keeps its arrows one way (docs/explanation/architecture.md,
section 3): no package imports another that imports it back, not even lazily inside a
function, and the update rules import neither MPI nor a framework."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "nbdist"


def _imports(path: Path) -> set[str]:
    """Every nbdist module or name a file imports, at any depth (lazy imports too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return found


def _unit(path: Path) -> str:
    """A sub-package's name, or a top-level module's."""
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return parts[0]


def _graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = defaultdict(set)
    for path in PACKAGE.rglob("*.py"):
        unit = _unit(path)
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "nbdist" and len(parts) > 1 and parts[1] != unit:
                edges[unit].add(parts[1])
    return edges


def _cycle_from(start: str, edges: dict[str, set[str]]) -> list[str] | None:
    stack, seen = [(start, [start])], set()
    while stack:
        unit, path = stack.pop()
        for after in sorted(edges.get(unit, ())):
            if after == start:
                return path + [start]
            if after not in seen:
                seen.add(after)
                stack.append((after, path + [after]))
    return None


def test_no_package_imports_one_that_imports_it_back():
    edges = _graph()
    assert edges["roles"] and edges["train"], "the graph was not read"
    cycles = [c for c in (_cycle_from(unit, edges) for unit in sorted(edges)) if c]
    assert not cycles, "import cycles between packages: " + "; ".join(" -> ".join(c) for c in cycles)


def test_update_rules_import_no_mpi_and_no_framework():
    for path in (PACKAGE / "algorithms").glob("*.py"):
        roots = {name.split(".")[0] for name in _imports(path)}
        assert not roots & {"mpi4py", "torch", "tensorflow", "keras"}, (path.name, roots)


# Role loops that still post MPI requests themselves; each should move to a transport
# channel (transport/master_channel.py, worker_channel.py, study_channel.py), then leave
# this list.
ROLES_STILL_ON_MPI: set[str] = set()


def test_role_loops_leave_mpi_to_the_transport():
    on_mpi = {
        path.name
        for path in (PACKAGE / "roles").glob("*.py")
        if "mpi4py" in {name.split(".")[0] for name in _imports(path)}
    }
    assert not on_mpi - ROLES_STILL_ON_MPI, f"role loops importing mpi4py: {sorted(on_mpi - ROLES_STILL_ON_MPI)}"
    off_mpi = ROLES_STILL_ON_MPI - on_mpi
    assert not off_mpi, f"no longer on MPI, take off the list: {sorted(off_mpi)}"


# scaling/ (ARCHITECTURE.md, section 4): the model, the simulator and what they read and
# report are pure, no MPI, so a notebook kernel can predict from a store's numbers; the
# probe and the sweep use transport/ and roles/. Only the ways in (and the dashboard,
# which draws a study) import scaling/: nothing below it does.
SCALING_PURE = (
    "allreduce_model",
    "analysis",
    "assemble",
    "goodput",
    "inputs",
    "load",
    "measure",
    "model",
    "network",
    "options",
    "queueing",
    "report",
    "setups",
    "simulator",
    "store",
)
# preflight: the checks slurm-script runs before it writes a job script (cli's alone).
ABOVE_SCALING = {"cli", "api", "magics", "engine", "dashboard", "__init__", "scaling", "preflight"}


def test_the_performance_model_and_simulator_are_pure():
    for name in SCALING_PURE:
        imported = _imports(PACKAGE / "scaling" / f"{name}.py")
        roots = {n.split(".")[0] for n in imported}
        assert not roots & {"mpi4py", "torch", "tensorflow", "keras"}, (name, roots)
        below = {n.split(".")[1] for n in imported if n.startswith("nbdist.") and n.count(".") >= 1}
        assert not below & {"transport", "roles", "train", "cluster", "job"}, (name, below)
    package = _imports(PACKAGE / "scaling" / "__init__.py")
    assert all(n.split(".")[-1] in SCALING_PURE for n in package if n.startswith("nbdist.scaling.")), package


def test_nothing_below_scaling_imports_it():
    importers = {unit for unit, after in _graph().items() if "scaling" in after}
    assert importers <= ABOVE_SCALING, f"packages importing scaling/ from below: {sorted(importers - ABOVE_SCALING)}"


def test_the_result_files_the_code_points_at_exist():
    """Measured numbers live in dated files under bench/results/; the code gives the
    reason in words and points there, and every file it points at is there."""
    import re

    pointer = re.compile(r"bench/results/([\w.-]+\.md)")
    named = {
        (path.relative_to(PACKAGE.parent), name)
        for path in PACKAGE.rglob("*.py")
        for name in pointer.findall(path.read_text())
    }
    assert named, "no pointer to bench/results found: the pattern is stale"
    results = PACKAGE.parent / "bench" / "results"
    missing = sorted(f"{path}: {name}" for path, name in named if not (results / name).is_file())
    assert not missing, "pointers to result files that do not exist: " + "; ".join(missing)


def test_role_modules_export_their_public_classes():
    """A public class a role module defines (a loop other modules extend or drive, such as
    allreduce.py's AllreduceRun) is in that module's `__all__`, which the API reference
    and `import *` read."""
    missing = []
    for path in sorted((PACKAGE / "roles").rglob("*.py")):
        tree = ast.parse(path.read_text())
        exported = next(
            (
                set(ast.literal_eval(node.value))
                for node in tree.body
                if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets)
            ),
            set(),
        )
        classes = {node.name for node in tree.body if isinstance(node, ast.ClassDef) and not node.name.startswith("_")}
        missing += [f"{path.relative_to(PACKAGE)}: {name}" for name in sorted(classes - exported)]
    assert not missing, "public classes missing from __all__: " + "; ".join(missing)


# A module longer than this is doing more than one thing (issue 26: small modules).
MODULE_LINES_AT_MOST = 450


def test_no_module_is_longer_than_the_limit():
    long = {
        str(path.relative_to(PACKAGE)): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if (lines := len(path.read_text().splitlines())) > MODULE_LINES_AT_MOST
    }
    assert not long, f"modules over {MODULE_LINES_AT_MOST} lines (split them along what they do): {long}"
