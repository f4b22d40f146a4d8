"""scikit-learn's handwritten digits: 1797 8x8 images, shipped inside scikit-learn."""

from __future__ import annotations

import numpy as np

from nbdist.data.arrays import ArrayData


def digits(*, images: bool = False, val_fraction: float = 0.2, seed: int = 0,
           pixel_range: tuple[float, float] = (0.0, 1.0)) -> ArrayData:
    """Digits split into train and validation sets, pixels scaled to `pixel_range`
    ((-1, 1) suits a generator ending in tanh).

    `images=True` gives (N, 1, 8, 8) arrays for convolutional models, otherwise (N, 64).
    The split is stratified and fixed by `seed`, so every rank that calls this gets the
    same arrays without any communication.
    """
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    low, high = pixel_range
    x = (low + (high - low) * bunch.data / 16.0).astype(np.float32)
    y = bunch.target.astype(np.int64)
    if images:
        x = x.reshape(-1, 1, 8, 8)
    x_train, x_val, y_train, y_val = train_test_split(
        x, y, test_size=val_fraction, random_state=seed, stratify=y
    )
    return ArrayData(x_train, y_train, x_val, y_val, name="digits", num_classes=10)
