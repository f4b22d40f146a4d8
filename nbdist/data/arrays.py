"""In-memory training and validation arrays."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from nbdist.data.base import Data, class_label_range


@dataclass(slots=True)
class ArrayData(Data):
    """Train and validation arrays, indexed along their first axis.

    Every rank builds its own copy (from a file, a package, a generator) so nothing is
    pickled between processes; the sharding decides which indices a rank uses.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    name: str = "arrays"
    num_classes: int | None = None

    def __post_init__(self) -> None:
        for split, x, y in (("train", self.x_train, self.y_train), ("val", self.x_val, self.y_val)):
            if len(x) != len(y):
                raise ValueError(f"{self.name}: {split} features have {len(x)} samples but labels have {len(y)}")
        if len(self.x_train) == 0:
            raise ValueError(f"{self.name}: the training set is empty")

    @property
    def n_train(self) -> int:
        return len(self.x_train)

    @property
    def n_val(self) -> int:
        return len(self.x_val)

    def train_batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.x_train[indices], self.y_train[indices]

    def val_batch(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.x_val[indices], self.y_val[indices]

    def val_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return self.x_val, self.y_val

    def label_range(self) -> tuple[int, int] | None:
        return class_label_range(np.asarray(self.y_train), np.asarray(self.y_val))
