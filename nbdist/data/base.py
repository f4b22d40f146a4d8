"""What the training loops ask of their data, whatever holds it (arrays, files)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import numpy as np

from nbdist.data.sharding import ShardPlan
from nbdist.errors import UserError

__all__ = ["Data", "DataError", "DataReadError", "class_label_range"]


class DataError(UserError):
    """Bad data found while setting up (a missing file, a wrong dataset name): the
    same message on every rank before training starts."""


class DataReadError(RuntimeError):
    """A file that could not be read during training. Not a UserError: only the ranks
    reading it know, so the run is aborted rather than left waiting for them."""


class Data(ABC):
    """Training and validation samples, indexed along their first axis.

    A topology asks for a plan of which batches each worker trains on (`plan`), reads a
    batch by its indices (`train_batch`), validates on `val_batch`/`val_arrays`, and
    calls `close()` when the run ends. Every rank builds its own instance, so nothing
    is pickled between processes.
    """

    __slots__ = ()

    @property
    @abstractmethod
    def n_train(self) -> int: ...

    @property
    @abstractmethod
    def n_val(self) -> int: ...

    def plan(self, shards: int, batch_size: int, seed: int) -> ShardPlan:
        """Every sample once per epoch, `shards` workers, equal batch counts."""
        return ShardPlan(self.n_train, shards, batch_size, seed)

    @abstractmethod
    def train_batch(self, indices: np.ndarray) -> tuple[Any, Any]: ...

    @abstractmethod
    def val_batch(self, indices: np.ndarray) -> tuple[Any, Any]: ...

    def val_arrays(self) -> tuple[Any, Any]:
        """The whole validation set (a master validates on all of it)."""
        return self.val_batch(np.arange(self.n_val))

    def label_range(self) -> tuple[int, int] | None:
        """The smallest and largest label of the training and validation sets when the
        labels are class indices (integers, one per sample), else None. Set-up checks
        them against the model's outputs (nbdist.train.data_checks.check_labels)."""
        return None

    def close(self) -> None:  # noqa: B027 - most data hold nothing to release
        """Release what reading needed (threads, cache copies); the run has ended."""


def class_label_range(*labels: np.ndarray) -> tuple[int, int] | None:
    """(smallest, largest) of label arrays that hold one integer class index per sample;
    None for any other kind of label (floats, one-hot rows, none at all)."""
    kept = [y for y in labels if len(y)]
    if not kept or not all(np.issubdtype(y.dtype, np.integer) and y.ndim == 1 for y in kept):
        return None
    return int(min(y.min() for y in kept)), int(max(y.max() for y in kept))
