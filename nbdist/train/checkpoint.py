"""Atomic, resumable checkpoints that load without executing code.

A checkpoint is a directory `checkpoints/<label>/` holding one safetensors file and one
JSON file per rank (each rank saves its own state: centre or worker weights, optimiser
state, rule state, RNG, data position) and `meta.json`. Ranks write into
`.tmp-<label>/`; only when every rank's files are there does the run's leader write
`meta.json` and rename the directory into place, then point `LATEST` at it (write to a
temporary file, then rename). A crash at any moment leaves the previous checkpoint and
`LATEST` intact; a half-written directory is never mistaken for a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

from nbdist.errors import UserError

__all__ = ["Checkpoints", "CheckpointError", "flatten_arrays", "unflatten_arrays"]


class CheckpointError(UserError):
    pass


def flatten_arrays(groups: dict[str, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """{'opt': {'exp_avg': a}} -> {'opt/exp_avg': a} (safetensors has flat names)."""
    # Not np.ascontiguousarray: it turns 0-d arrays (Adam's step, a rule's counters) into
    # shape (1,), which then no longer load as scalars on resume.
    return {f"{group}/{name}": np.asarray(value, order="C")
            for group, arrays in groups.items() for name, value in arrays.items()}


def unflatten_arrays(flat: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    groups: dict[str, dict[str, np.ndarray]] = {}
    for key, value in flat.items():
        group, _, name = key.partition("/")
        groups.setdefault(group, {})[name] = value
    return groups


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class Checkpoints:
    def __init__(self, run_dir: Path | str):
        self.root = Path(run_dir) / "checkpoints"

    def _tmp(self, label: str) -> Path:
        return self.root / f".tmp-{label}"

    def write_rank(self, label: str, rank: int, arrays: dict[str, dict[str, np.ndarray]],
                   meta: dict[str, Any]) -> None:
        directory = self._tmp(label)
        directory.mkdir(parents=True, exist_ok=True)
        save_file(flatten_arrays(arrays), str(directory / f"rank-{rank:05d}.safetensors"))
        _write_json(directory / f"rank-{rank:05d}.json", meta)

    def ranks_written(self, label: str) -> int:
        return len(list(self._tmp(label).glob("rank-*.json")))

    def commit(self, label: str, meta: dict[str, Any]) -> Path:
        """Make `.tmp-<label>` the checkpoint `<label>`; every rank must have written."""
        tmp, final = self._tmp(label), self.root / label
        _write_json(tmp / "meta.json", meta)
        if final.exists():  # re-committing a label: move the old one aside, never delete first
            old = self.root / f".old-{label}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _write_json(self.root / "LATEST.json", {"label": label})
        return final

    def latest(self) -> Path | None:
        pointer = self.root / "LATEST.json"
        if not pointer.exists():
            return None
        with open(pointer, encoding="utf-8") as fh:
            path = self.root / json.load(fh)["label"]
        return path if (path / "meta.json").exists() else None

    def discard_incomplete(self) -> None:
        for tmp in self.root.glob(".tmp-*"):
            shutil.rmtree(tmp, ignore_errors=True)

    @staticmethod
    def read_meta(path: Path) -> dict[str, Any]:
        with open(path / "meta.json", encoding="utf-8") as fh:
            return json.load(fh)

    @staticmethod
    def read_rank(path: Path, rank: int) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, Any]]:
        tensors = path / f"rank-{rank:05d}.safetensors"
        if not tensors.exists():
            raise CheckpointError(f"checkpoint {path} has no state for rank {rank}")
        with open(path / f"rank-{rank:05d}.json", encoding="utf-8") as fh:
            meta = json.load(fh)
        return unflatten_arrays(load_file(str(tensors))), meta
