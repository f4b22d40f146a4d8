"""scikit-learn's handwritten digits: 1797 8x8 images, shipped inside scikit-learn.

Every rank of a job loads them, so they are read straight from the file scikit-learn
ships (`sklearn/datasets/data/digits.csv.gz`, what `load_digits` reads) without
importing scikit-learn: its import (scipy.stats and all) costs each rank about two
seconds of CPU, more than the training of a small model on a laptop's cores.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

from nbdist.data.arrays import ArrayData

__all__ = ["digits", "load_digits_arrays", "stratified_split"]


def digits(
    *, images: bool = False, val_fraction: float = 0.2, seed: int = 0, pixel_range: tuple[float, float] = (0.0, 1.0)
) -> ArrayData:
    """Digits split into train and validation sets, pixels scaled to `pixel_range`
    ((-1, 1) suits a generator ending in tanh).

    `images=True` gives (N, 1, 8, 8) arrays for convolutional models, otherwise (N, 64).
    The split is stratified and fixed by `seed`, so every rank that calls this gets the
    same arrays without any communication.
    """
    pixels, labels = load_digits_arrays()
    low, high = pixel_range
    x = (low + (high - low) * pixels / 16.0).astype(np.float32)
    y = labels.astype(np.int64)
    if images:
        x = x.reshape(-1, 1, 8, 8)
    train, val = stratified_split(y, val_fraction, seed)
    return ArrayData(x[train], y[train], x[val], y[val], name="digits", num_classes=10)


def load_digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(pixels (1797, 64) in 0..16, labels (1797,)), as `sklearn.datasets.load_digits`."""
    spec = importlib.util.find_spec("sklearn")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "nbdist.datasets.digits needs scikit-learn (pip install scikit-learn): the digits ship inside it"
        )
    path = Path(spec.submodule_search_locations[0]) / "datasets" / "data" / "digits.csv.gz"
    if not path.exists():  # a scikit-learn that keeps them elsewhere: ask it
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return bunch.data, bunch.target
    table = np.loadtxt(path, delimiter=",")
    return table[:, :-1], table[:, -1].astype(np.int64)


def stratified_split(labels: np.ndarray, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train indices, validation indices), shuffled, with every class in the same
    proportion in both (up to rounding). The validation set has ceil(n * val_fraction)
    samples, as scikit-learn's train_test_split gives."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be between 0 and 1, got {val_fraction}")
    rng = np.random.default_rng(seed)
    classes, counts = np.unique(labels, return_counts=True)
    n_val = int(np.ceil(len(labels) * val_fraction))
    # Each class's share, rounded down; the samples left go to the classes that lost the
    # most to the rounding.
    exact = counts * (n_val / len(labels))
    per_class = np.floor(exact).astype(int)
    for c in np.argsort(per_class - exact, kind="stable")[: n_val - per_class.sum()]:
        per_class[c] += 1
    train, val = [], []
    for c, take in zip(classes, per_class, strict=True):
        members = rng.permutation(np.flatnonzero(labels == c))
        val.append(members[:take])
        train.append(members[take:])
    return rng.permutation(np.concatenate(train)), rng.permutation(np.concatenate(val))
