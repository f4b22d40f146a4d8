"""docs/howto/custom-rule.md, executed as written: its Python files are written out, its
command trains digits with the rule on three MPI ranks, and its contract-test module runs
nbdist's contract tests on the rule (as optuna's user-defined sampler recipe is run)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from nbdist.launch import mpi_env

PAGE = ROOT / "docs" / "howto" / "custom-rule.md"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def page_blocks() -> tuple[dict[str, str], list[str]]:
    """The page's files (python blocks whose first line is `# NAME.py`) and its commands
    (the lines of its bash blocks)."""
    files, commands = {}, []
    for language, body in BLOCK.findall(PAGE.read_text()):
        first = body.splitlines()[0] if body.strip() else ""
        if language == "python" and re.fullmatch(r"# [\w.]+\.py", first):
            files[first[2:]] = body
        elif language == "bash":
            commands += [line for line in body.splitlines() if line.strip()]
    return files, commands


def _env() -> dict[str, str]:
    env = mpi_env()
    # `python` and `mpiexec` in the page are this environment's; nbdist is this checkout.
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_the_custom_rule_page_trains_digits_and_passes_the_contract_tests(tmp_path):
    files, commands = page_blocks()
    assert set(files) == {"signsgd.py", "model.py", "test_my_rule_contracts.py"}, sorted(files)
    assert len(commands) == 1 and commands[0].startswith("mpiexec -n 3 python -m nbdist train")
    for name, source in files.items():
        (tmp_path / name).write_text(source)

    done = subprocess.run(
        ["bash", "-c", commands[0]], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=480
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = tmp_path / "runs" / "signsgd-digits"
    assert json.loads((run_dir / "options.json").read_text())["algorithm"] == "signsgd(lr=0.002)"
    summary = json.loads((run_dir / "summary.json").read_text())
    history = summary["history"]
    assert [h["epoch"] for h in history] == [1, 2, 3, 4]
    losses = [h["train_loss"] for h in history]
    assert losses[-1] < 0.8 * losses[0], losses  # it learns
    assert summary["final"]["val_acc"] > 0.5, summary["final"]  # ten digits: chance is 0.1

    # The page's contract-test module, run from nbdist's tests (they are on its path).
    env = _env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT / "tests"), env["PYTHONPATH"]])
    contracts = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_my_rule_contracts.py", "-k", "signsgd"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert contracts.returncode == 0, contracts.stdout[-4000:]
    counts = re.search(r"(\d+) passed", contracts.stdout)
    assert counts and int(counts.group(1)) >= 8, contracts.stdout[-2000:]
