"""Atomic, durable, verified checkpoints that load without executing code.

A checkpoint is a directory `checkpoints/<label>/` holding one safetensors file and one
JSON file per rank (each rank saves its own state: centre or worker weights, optimiser
state, rule state, RNG, data position) and `meta.json`. Ranks write into
`.tmp-<label>/`; only when every rank's files are there does the run's leader write
`meta.json` and rename the directory into place, then point `LATEST` at it (write to a
temporary file, then rename). Every file is fsynced, then its directory, before anything
points at it, so a crash or a power cut at any moment leaves the previous checkpoint and
`LATEST` intact; a half-written directory is never mistaken for a checkpoint.

`meta.json` lists every file of the checkpoint with its size and SHA-256 (each rank
records those of the safetensors file it wrote; the committer adds the rank JSONs'), and
a commit sequence number. A resume verifies them and falls back to the newest intact
checkpoint, naming what was damaged. After each commit, the checkpoints beyond the
`keep` newest (commit order: labels of epochs and of stops do not sort in time) are
deleted, never the one `LATEST` points to.

A rank that holds the same weights, optimiser and rule state as another, bit for bit
(allreduce ranks, the processes of one worker), writes only its own arrays and names
the rank whose copy it shares; `read_rank` merges the two.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import load_file

from nbdist.durable import DIGEST, file_digest, fsync_dir, make_dir, write_json
from nbdist.errors import UserError
from nbdist.train.diskspace import checkpoint_disk_full, is_disk_full
from nbdist.train.tensor_files import write_safetensors

__all__ = ["Checkpoints", "CheckpointError", "other_model", "flatten_arrays", "unflatten_arrays"]

LATEST = "LATEST.json"
META = "meta.json"
# How a reader finds what a rank stored beside its own scalars (in the rank's JSON).
STORAGE = "storage"
# Errors that reading a damaged file raises (json's are ValueErrors).
_READ_ERRORS = (OSError, ValueError, SafetensorError)


class CheckpointError(UserError):
    pass


def other_model(path: Path, held: int, rank: int, num_params: int) -> CheckpointError:
    """The error for a resume whose model has `num_params` weights where rank `rank`'s share
    of checkpoint `path` holds `held`: one wording, from the header at set-up
    (train/run_dir.py) or from the share as it is loaded (train/state.py)."""
    return CheckpointError(
        f"checkpoint {path} holds {held} weights for rank {rank}, the model has {num_params}: resume with the "
        f"same model"
    )


def flatten_arrays(groups: dict[str, dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """{'opt': {'exp_avg': a}} -> {'opt/exp_avg': a} (safetensors has flat names)."""
    # Not np.ascontiguousarray: it turns 0-d arrays (Adam's step, a rule's counters) into
    # shape (1,), which then no longer load as scalars on resume.
    return {
        f"{group}/{name}": np.asarray(value, order="C")
        for group, arrays in groups.items()
        for name, value in arrays.items()
    }


def unflatten_arrays(flat: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    groups: dict[str, dict[str, np.ndarray]] = {}
    for key, value in flat.items():
        group, _, name = key.partition("/")
        groups.setdefault(group, {})[name] = value
    return groups


def _file(rank: int, ext: str) -> str:
    return f"rank-{rank:05d}.{ext}"


def _read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


class Checkpoints:
    """The checkpoints of one run. `keep`: how many committed checkpoints a commit leaves
    (None: all)."""

    def __init__(self, run_dir: Path | str, keep: int | None = None):
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep

    def _tmp(self, label: str) -> Path:
        return self.root / f".tmp-{label}"

    # -- writing ------------------------------------------------------------------------
    def write_rank(
        self,
        label: str,
        rank: int,
        arrays: dict[str, dict[str, np.ndarray]],
        meta: dict[str, Any],
        same_as: int | None = None,
        shared: Iterable[str] = (),
    ) -> None:
        """Write rank `rank`'s share of checkpoint `label`. With `same_as` (another rank),
        the arrays named in `shared` (a group such as "opt", or "group/name") are left to
        that rank's file, which holds the same values."""
        directory = self._tmp(label)
        flat = flatten_arrays(arrays)
        storage: dict[str, Any] = {}
        if same_as is not None and same_as != rank:
            shared = set(shared)
            taken = sorted(k for k in flat if k in shared or k.partition("/")[0] in shared)
            flat = {k: v for k, v in flat.items() if k not in taken}
            storage.update(same_as=same_as, shared=taken)
        tensors = _file(rank, "safetensors")
        try:
            make_dir(directory)
            storage["files"] = {tensors: write_safetensors(directory / tensors, flat)}
            # Written last, atomically: `ranks_written` counts a rank once its JSON is there.
            write_json(directory / _file(rank, "json"), {**meta, STORAGE: storage})
        except FileNotFoundError:
            # An asynchronous snapshot commits without a worker that fell an epoch behind or
            # was dropped (roles/master/epochs.py): its share, written meanwhile, is not
            # needed. The temporary directory went from under it (committed, or already
            # rotated away by later checkpoints when the worker was frozen that long).
            # Without its JSON the files it left are no share (`ranks_written`, the manifest).
            if directory.is_dir() and not (self.root / label).is_dir():
                raise
        except OSError as exc:
            if is_disk_full(exc):
                needed = sum(array.nbytes for array in flat.values())
                raise checkpoint_disk_full(exc, directory, label, needed) from None
            raise

    def ranks_written(self, label: str) -> int:
        return len(list(self._tmp(label).glob("rank-*.json")))

    def commit(self, label: str, meta: dict[str, Any]) -> Path:
        """Make `.tmp-<label>` the checkpoint `<label>`; every rank must have written."""
        tmp, final = self._tmp(label), self.root / label
        files = self._manifest(tmp)
        try:
            write_json(tmp / META, {**meta, "sequence": self._next_sequence(), "files": files})
            if final.exists():  # re-committing a label: move the old one aside, never delete first
                old = self.root / f".old-{label}"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(tmp, final)
                fsync_dir(self.root)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
                fsync_dir(self.root)
            write_json(self.root / LATEST, {"label": label})
        except OSError as exc:
            # The commit's small files meet a full disk as a share's big ones do: told the
            # same way, naming the checkpoints' directory and the checkpoint's size.
            if is_disk_full(exc):
                raise checkpoint_disk_full(exc, tmp, label, sum(int(f["bytes"]) for f in files.values())) from None
            raise
        self._prune(label)
        return final

    def _manifest(self, tmp: Path) -> dict[str, dict[str, Any]]:
        """Every file of the checkpoint with its size and digest."""
        files = {}
        for rank_json in sorted(tmp.glob("rank-*.json")):
            files.update(_read_json(rank_json).get(STORAGE, {}).get("files", {}))
            files[rank_json.name] = file_digest(rank_json)
        return files

    def _next_sequence(self) -> int:
        return 1 + max((self._commit_order(path)[0] for path in self._committed()), default=0)

    def _prune(self, latest: str) -> None:
        if self.keep is None:
            return
        for path in self._by_commit_order()[self.keep :]:
            if path.name != latest:
                # Renamed first: a crash half-way through the deletion leaves no damaged
                # checkpoint behind, only a hidden directory (see discard_incomplete).
                doomed = self.root / f".old-{path.name}"
                shutil.rmtree(doomed, ignore_errors=True)
                os.replace(path, doomed)
                shutil.rmtree(doomed, ignore_errors=True)

    def discard_incomplete(self) -> None:
        for leftover in [*self.root.glob(".tmp-*"), *self.root.glob(".old-*")]:
            shutil.rmtree(leftover, ignore_errors=True)

    # -- finding ------------------------------------------------------------------------
    def _committed(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return [p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")]

    @staticmethod
    def _commit_order(path: Path) -> tuple[int, float]:
        """(sequence, time) from meta.json; checkpoints written before sequence numbers
        come first, in time order; an unreadable meta.json sorts oldest of all."""
        try:
            meta = _read_json(path / META)
            return int(meta.get("sequence", 0)), float(meta.get("time", 0.0))
        except (*_READ_ERRORS, AttributeError, TypeError):
            return -1, 0.0

    def _by_commit_order(self) -> list[Path]:
        """Committed checkpoints, newest first."""
        return sorted(self._committed(), key=self._commit_order, reverse=True)

    def _latest_label(self) -> str | None:
        try:
            return str(_read_json(self.root / LATEST)["label"])
        except (*_READ_ERRORS, KeyError, TypeError):
            return None

    def latest(self) -> Path | None:
        """The checkpoint LATEST points to, if it was committed (not verified)."""
        label = self._latest_label()
        if label is None:
            return None
        path = self.root / label
        return path if (path / META).exists() else None

    def latest_intact(self, usable: Callable[[Path], str | None] | None = None) -> tuple[Path | None, list[str]]:
        """The newest checkpoint whose files are all as written (LATEST's first, then the
        others newest first), and one line per damaged checkpoint passed over. `usable`:
        what else would keep a checkpoint from resuming ("it holds no state for master 1")."""
        candidates = self._by_commit_order()
        label = self._latest_label()
        if label is not None:
            pointed = self.root / label
            candidates = [pointed] + [p for p in candidates if p != pointed]
        problems: list[str] = []
        for path in candidates:
            damage = self.damage(path)
            if damage is None:
                lacks = usable(path) if usable is not None else None
                if lacks is None:
                    return path, problems
                problems.append(f"checkpoint {path} cannot be resumed: {lacks}")
                continue
            problems.append(f"checkpoint {path} is damaged: {damage}")
        return None, problems

    @staticmethod
    def damage(path: Path) -> str | None:
        """What is wrong with checkpoint `path` ("rank-00001.safetensors is truncated
        (812 of 9720 bytes)"), or None when every file is as it was written."""
        if not path.is_dir():
            return "its directory is missing"
        try:
            meta = _read_json(path / META)
        except FileNotFoundError:
            return f"{META} is missing"
        except _READ_ERRORS as exc:
            return f"{META} is not valid JSON ({exc})"
        if not isinstance(meta, dict):
            return f"{META} does not describe a checkpoint"
        try:
            files = meta.get("files")
            found = (
                _legacy_damage(path)
                if files is None
                else [f"{name} {what}" for name, want in files.items() if (what := _file_damage(path / name, want))]
            )
        except (AttributeError, KeyError, TypeError) as exc:
            return f"{META} does not describe a checkpoint ({type(exc).__name__}: {exc})"
        if not found:
            return None
        more = f" (and {len(found) - 1} more damaged file{'s' if len(found) > 2 else ''})" if len(found) > 1 else ""
        return found[0] + more

    # -- reading ------------------------------------------------------------------------
    @staticmethod
    def read_meta(path: Path) -> dict[str, Any]:
        try:
            return _read_json(path / META)
        except _READ_ERRORS as exc:
            raise CheckpointError(f"checkpoint {path}: {META} cannot be read ({exc})") from None

    @staticmethod
    def has_rank(path: Path, rank: int) -> bool:
        """Whether checkpoint `path` holds a share of rank `rank` (both of its files)."""
        return (path / _file(rank, "safetensors")).exists() and (path / _file(rank, "json")).exists()

    @staticmethod
    def weights_held(path: Path, rank: int = 0) -> int | None:
        """How many weights rank `rank`'s share of checkpoint `path` holds, from its file's
        header (the weights are not read); None where it holds none of its own."""
        try:
            with safe_open(str(path / _file(rank, "safetensors")), framework="numpy") as tensors:
                if "model/params" not in tensors.keys():
                    return None
                return int(np.prod(tensors.get_slice("model/params").get_shape()))
        except (OSError, SafetensorError):
            return None  # reading the share says what is wrong with it

    @staticmethod
    def read_scalars(path: Path, rank: int) -> dict[str, Any]:
        """Rank `rank`'s scalars (epoch, version, ...), without its arrays."""
        try:
            meta = _read_json(path / _file(rank, "json"))
        except _READ_ERRORS as exc:
            raise CheckpointError(f"checkpoint {path}: the state of rank {rank} cannot be read ({exc})") from None
        meta.pop(STORAGE, None)
        return meta

    @staticmethod
    def read_rank(path: Path, rank: int) -> tuple[dict[str, dict[str, np.ndarray]], dict[str, Any]]:
        """Rank `rank`'s arrays (merged with the copy it shares, if any) and scalars."""
        tensors, scalars = path / _file(rank, "safetensors"), path / _file(rank, "json")
        if not tensors.exists() or not scalars.exists():
            raise CheckpointError(f"checkpoint {path} has no state for rank {rank}")
        try:
            meta = _read_json(scalars)
            storage = meta.pop(STORAGE, {})
            flat = load_file(str(tensors))
            if storage.get("same_as") is not None:
                with safe_open(str(path / _file(int(storage["same_as"]), "safetensors")), framework="numpy") as owner:
                    for key in storage["shared"]:
                        flat[key] = owner.get_tensor(key)
        except _READ_ERRORS as exc:
            raise CheckpointError(f"checkpoint {path}: the state of rank {rank} cannot be read ({exc})") from None
        return unflatten_arrays(flat), meta


def _file_damage(path: Path, want: dict[str, Any]) -> str | None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "is missing"
    if size < want["bytes"]:
        return f"is truncated ({size} of {want['bytes']} bytes)"
    if size > want["bytes"]:
        return f"has {size} bytes, {want['bytes']} were written"
    if file_digest(path)[DIGEST] != want[DIGEST]:
        return f"is corrupt (its {DIGEST} differs from the one recorded when it was written)"
    return None


def _legacy_damage(path: Path) -> list[str]:
    """A checkpoint written before meta.json listed its files: no digests to compare, but
    a truncated safetensors file or JSON does not parse, and each rank needs both files."""
    found = []
    ranks = {p.name.split(".")[0] for ext in ("safetensors", "json") for p in path.glob(f"rank-*.{ext}")}
    for name in sorted(ranks):
        for ext in ("safetensors", "json"):
            file = path / f"{name}.{ext}"
            try:
                if ext == "json":
                    _read_json(file)
                else:
                    with safe_open(str(file), framework="numpy"):
                        pass
            except FileNotFoundError:
                found.append(f"{file.name} is missing")
            except _READ_ERRORS as exc:
                found.append(f"{file.name} cannot be read ({exc})")
    return found
