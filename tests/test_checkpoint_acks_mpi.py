"""A synchronous worker whose shares of two epoch checkpoints are written between two of
its messages: both checkpoints are committed, not only the later one."""

from __future__ import annotations

import json

import pytest
from conftest import ROOT, run_mpi

pytestmark = pytest.mark.mpi

MODEL = ROOT / "tests" / "models" / "digits_mlp_shares_written_together.py"


@pytest.mark.parametrize("algorithm", ["downpour", "easgd"])
def test_epoch_shares_written_together_are_each_committed(tmp_path, algorithm):
    argv = ["-m", "nbdist", "train", "--model", str(MODEL), "--algorithm", algorithm, "--synchronous"]
    argv += ["--epochs", "4", "--runs-dir", str(tmp_path), "--run-name", "run"]
    done = run_mpi(3, argv, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    root = tmp_path / "run" / "checkpoints"
    kept = sorted(p.name for p in root.iterdir() if p.is_dir())
    # --keep-checkpoints 3 (the default): the last three epochs, each with every rank's share.
    assert kept == ["epoch-0002", "epoch-0003", "epoch-0004"], kept
    for label in kept:
        assert sorted(p.name for p in (root / label).glob("rank-*.json")) == [f"rank-0000{r}.json" for r in range(3)]
    assert json.loads((root / "LATEST.json").read_text())["label"] == "epoch-0004"
