"""Training data in HDF5 files: lists or globs of files, checked once, read in pieces.

    data = HDF5Data("data/jets/train_*.h5", "data/jets/val_*.h5", cache_dir="/tmp/cache")

Every file holds a features and a labels dataset (by default `features` and `labels`)
with one sample per row. The files are checked when the data is opened (every file
there, both datasets in each, one sample shape in all) so that a mistake is one clear
error before training starts. Training samples are then read a piece of a file at a
time, in the order the plan (sharding.FilePlan) gives, with the next piece read in the
background while the current one trains.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from glob import glob
from pathlib import Path
from typing import Any

import numpy as np

from nbdist.data.base import Data, DataError, DataReadError, class_label_range
from nbdist.data.cache import FileCache
from nbdist.data.sharding import FilePlan, Piece

__all__ = ["HDF5Data", "FileSet", "expand_files"]

DEFAULT_KEYS = ("features", "labels")


def _h5py() -> Any:
    try:
        import h5py
    except ImportError:
        raise DataError("reading HDF5 files needs h5py: pip install 'nbdist[hep]'") from None
    return h5py


def expand_files(patterns: str | Path | Sequence[str | Path], what: str) -> list[Path]:
    """Paths and globs (a comma-separated string or a list) to the files, in order."""
    if isinstance(patterns, (str, Path)):
        patterns = [p.strip() for p in str(patterns).split(",")]
    files: dict[Path, None] = {}  # ordered, without repeats
    for pattern in (str(p) for p in patterns if str(p).strip()):
        pattern = os.path.expanduser(pattern)
        if any(c in pattern for c in "*?["):
            matched = sorted(glob(pattern))
            if not matched:
                raise DataError(f"{what}: no file matches {pattern!r}")
        elif not os.path.isfile(pattern):
            raise DataError(f"{what}: file {pattern!r} not found")
        else:
            matched = [pattern]
        files.update(dict.fromkeys(Path(m) for m in matched))
    if not files:
        raise DataError(f"{what} names no file")
    return list(files)


@dataclass(frozen=True)
class FileSet:
    """Files checked to hold the same kind of samples, and where each begins."""

    paths: tuple[Path, ...]
    keys: tuple[str, str]
    sizes: tuple[int, ...]
    x_shape: tuple[int, ...]  # one sample's
    x_dtype: np.dtype
    y_shape: tuple[int, ...]
    y_dtype: np.dtype
    what: str

    @classmethod
    def open(cls, patterns: Any, keys: Sequence[str], what: str) -> FileSet:
        h5py = _h5py()
        paths = expand_files(patterns, what)
        keys = tuple(keys)
        sizes, first = [], None
        for path in paths:
            try:
                fh = h5py.File(path, "r")
            except OSError as exc:
                raise DataError(f"{what}: {path} is not a readable HDF5 file ({exc})") from None
            with fh:
                missing = [k for k in keys if not isinstance(fh.get(k), h5py.Dataset)]
                if missing:
                    have = ", ".join(k for k in fh if isinstance(fh[k], h5py.Dataset)) or "no datasets"
                    raise DataError(
                        f"{what}: {path} has no dataset {missing[0]!r} (it has: {have}); name the "
                        f"features and labels datasets with --data-keys FEATURES,LABELS"
                    )
                x, y = fh[keys[0]], fh[keys[1]]
                if x.ndim == 0 or y.ndim == 0 or len(x) != len(y):
                    raise DataError(
                        f"{what}: {path} has {x.shape[0] if x.ndim else 0} rows of "
                        f"{keys[0]!r} but {y.shape[0] if y.ndim else 0} of {keys[1]!r}"
                    )
                kind = (x.shape[1:], x.dtype, y.shape[1:], y.dtype)
                if first is None:
                    first = (path, kind)
                elif kind != first[1]:
                    raise DataError(
                        f"{what}: the files disagree: {path} holds {keys[0]!r} of shape "
                        f"{_shape(kind[0])} {kind[1]} and {keys[1]!r} of {_shape(kind[2])} {kind[3]} per sample, "
                        f"{first[0]} holds {_shape(first[1][0])} {first[1][1]} and {_shape(first[1][2])} "
                        f"{first[1][3]}"
                    )
                sizes.append(len(x))
        if first is None or sum(sizes) == 0:
            raise DataError(f"{what}: the files hold no samples")
        x_shape, x_dtype, y_shape, y_dtype = first[1]
        return cls(tuple(paths), (keys[0], keys[1]), tuple(sizes), x_shape, x_dtype, y_shape, y_dtype, what)

    @property
    def offsets(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.sizes)])

    @property
    def n(self) -> int:
        return int(sum(self.sizes))

    def same_kind(self, other: FileSet) -> None:
        if (self.x_shape, self.y_shape) != (other.x_shape, other.y_shape):
            raise DataError(
                f"{other.what} holds samples of shape {_shape(other.x_shape)} with labels "
                f"{_shape(other.y_shape)}, {self.what} holds {_shape(self.x_shape)} with {_shape(self.y_shape)}"
            )

    def labels(self) -> list[np.ndarray]:
        """Every file's labels dataset (the labels only: a few bytes per sample)."""
        try:
            found = []
            for path in self.paths:
                with _h5py().File(path, "r") as fh:
                    found.append(fh[self.keys[1]][...])
            return found
        except OSError as exc:
            raise DataError(f"{self.what}: cannot read the labels of {path}: {exc}") from None

    def read_piece(self, piece: Piece, cache: FileCache | None) -> tuple[np.ndarray, np.ndarray]:
        path = self.paths[piece.file]
        source = cache.local(path) if cache is not None else path
        try:
            with _h5py().File(source, "r") as fh:
                return fh[self.keys[0]][piece.start : piece.stop], fh[self.keys[1]][piece.start : piece.stop]
        except OSError as exc:
            raise DataReadError(f"{self.what}: cannot read {path}: {exc}") from None

    def gather(
        self, indices: np.ndarray, fetch: Callable[[int, int, int], tuple[Piece, Any]]
    ) -> tuple[np.ndarray, np.ndarray, list[Piece]]:
        """The samples at `indices` (into the files' concatenation), file by file:
        `fetch(file, lo, hi)` gives a piece covering rows [lo, hi) with its arrays."""
        indices = np.asarray(indices)
        offsets = self.offsets
        files = np.searchsorted(offsets, indices, side="right") - 1
        rows = indices - offsets[files]
        x = np.empty((len(indices), *self.x_shape), self.x_dtype)
        y = np.empty((len(indices), *self.y_shape), self.y_dtype)
        used = []
        for file in np.unique(files):
            mask = files == file
            wanted = rows[mask]
            piece, (px, py) = fetch(int(file), int(wanted.min()), int(wanted.max()) + 1)
            x[mask], y[mask] = px[wanted - piece.start], py[wanted - piece.start]
            used.append(piece)
        return x, y, used


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ("," if len(shape) == 1 else "") + ")"


class PieceReader:
    """Samples by index from the pieces of files a FilePlan schedules.

    The pieces of the window in use stay in memory; the next window's are read by a
    background thread (through the cache, copying first if needed) while this one
    trains. Indices outside the schedule (the set-up's probe of two samples) are still
    served, read there and then from the original file.
    """

    def __init__(self, files: FileSet, cache: FileCache | None):
        self.files, self.cache = files, cache
        self.resident: dict[Piece, tuple[np.ndarray, np.ndarray]] = {}
        self._pending: dict[Piece, Future] = {}
        self._schedule: list[list[Piece]] = []
        self._window_of: dict[Piece, int] = {}
        self._pool: ThreadPoolExecutor | None = None

    def schedule(self, windows: list[list[Piece]]) -> None:
        self._schedule = windows
        self._window_of = {}
        for i, window in enumerate(windows):
            for piece in window:
                self._window_of.setdefault(piece, i)  # the lookahead repeats pieces
        if windows:
            self._prefetch(windows[0])

    def read(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        x, y, used = self.files.gather(indices, self._piece)
        self._advance(used)
        return x, y

    def _piece(self, file: int, lo: int, hi: int) -> tuple[Piece, tuple[np.ndarray, np.ndarray]]:
        for piece, arrays in self.resident.items():
            if piece.covers(file, lo, hi):
                return piece, arrays
        for piece, future in self._pending.items():
            if piece.covers(file, lo, hi):
                del self._pending[piece]
                self.resident[piece] = future.result()  # waits for the prefetch
                return piece, self.resident[piece]
        planned = [p for window in self._schedule for p in window if p.covers(file, lo, hi)]
        if planned:
            piece = planned[0]
            self.resident[piece] = self.files.read_piece(piece, self.cache)
        else:  # a probe of a few samples: not worth a copy of the whole file in the cache
            piece = Piece(file, lo, hi)
            self.resident[piece] = self.files.read_piece(piece, None)
        return piece, self.resident[piece]

    def _advance(self, used: list[Piece]) -> None:
        """Keep the window in use and the next; start reading the next."""
        current = max((self._window_of.get(p, -1) for p in used), default=-1)
        if current < 0:
            return  # reads outside the schedule change nothing in it
        keep = set(self._schedule[current])
        if current + 1 < len(self._schedule):
            keep |= set(self._schedule[current + 1])
            self._prefetch(self._schedule[current + 1])
        for piece in [p for p in self.resident if p not in keep]:
            del self.resident[piece]
        for piece in [p for p, f in self._pending.items() if p not in keep and f.done()]:
            del self._pending[piece]

    def _prefetch(self, window: list[Piece]) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="nbdist-prefetch")
        for piece in window:
            if piece not in self.resident and piece not in self._pending:
                self._pending[piece] = self._pool.submit(self.files.read_piece, piece, self.cache)

    def held(self) -> set[Piece]:
        """The pieces in memory or being read."""
        return set(self.resident) | set(self._pending)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._pending.clear()
        self.resident.clear()


class HDF5Data(Data):
    """Train and validation samples in HDF5 files (paths, globs, or comma-separated lists).

    `keys` names the features and labels datasets; `cache_dir` makes every rank copy the
    files it reads into a private directory there first (removed by close()); `mix`
    pieces of files are shuffled together in each window (see FilePlan).
    """

    def __init__(
        self,
        train: Any,
        val: Any,
        *,
        keys: Sequence[str] = DEFAULT_KEYS,
        cache_dir: str | Path | None = None,
        mix: int = 2,
        name: str = "hdf5",
    ):
        if len(keys) != 2 or not all(keys):
            raise DataError(f"--data-keys takes two names, features and labels, got {','.join(keys)!r}")
        self.name = name
        self.mix = int(mix)
        self.train_files = FileSet.open(train, keys, "--train")
        self.val_files = FileSet.open(val, keys, "--val")
        self.train_files.same_kind(self.val_files)
        self.cache = FileCache(cache_dir) if cache_dir else None
        self.reader = PieceReader(self.train_files, self.cache)
        self._val: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # x, y, their indices

    @property
    def n_train(self) -> int:
        return self.train_files.n

    @property
    def n_val(self) -> int:
        return self.val_files.n

    def plan(self, shards: int, batch_size: int, seed: int) -> FilePlan:
        return FilePlan(self.train_files.sizes, shards, batch_size, seed, mix=self.mix, on_epoch=self.reader.schedule)

    def train_batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.reader.read(indices)

    def val_batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # Validation reads the same slice every time (each rank's share, or all of it).
        indices = np.asarray(indices)
        if self._val is None or len(self._val[2]) != len(indices) or not np.array_equal(self._val[2], indices):
            x, y, _ = self.val_files.gather(indices, self._read_val)
            self._val = (x, y, indices.copy())
        return self._val[0], self._val[1]

    def _read_val(self, file: int, lo: int, hi: int) -> tuple[Piece, tuple[np.ndarray, np.ndarray]]:
        piece = Piece(file, lo, hi)
        return piece, self.val_files.read_piece(piece, self.cache)

    def label_range(self) -> tuple[int, int] | None:
        if self.train_files.y_shape or not np.issubdtype(self.train_files.y_dtype, np.integer):
            return None  # not class indices: nothing to read
        return class_label_range(*self.train_files.labels(), *self.val_files.labels())

    def close(self) -> None:
        self.reader.close()
        self._val = None
        if self.cache is not None:
            self.cache.close()

    def __repr__(self) -> str:
        return (
            f"<HDF5Data {self.n_train} train samples in {len(self.train_files.paths)} files, "
            f"{self.n_val} val in {len(self.val_files.paths)}, samples {_shape(self.train_files.x_shape)}>"
        )
