"""nbdist.datasets.digits: scikit-learn's digits, read without importing scikit-learn."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from nbdist.datasets import digits
from nbdist.datasets.digits import load_digits_arrays, stratified_split


def test_the_arrays_are_scikit_learns():
    from sklearn.datasets import load_digits

    bunch = load_digits()
    pixels, labels = load_digits_arrays()
    assert np.array_equal(pixels, bunch.data) and np.array_equal(labels, bunch.target)


def test_the_split_is_stratified_fixed_by_the_seed_and_covers_every_sample_once():
    data = digits()
    assert (len(data.y_train), len(data.y_val)) == (1437, 360)  # as train_test_split(test_size=0.2)
    share = np.bincount(data.y_val, minlength=10) / np.bincount(np.concatenate([data.y_train, data.y_val]))
    assert np.all(np.abs(share - 0.2) < 0.01), share
    again, other = digits(), digits(seed=1)
    assert np.array_equal(again.x_val, data.x_val) and not np.array_equal(other.x_val, data.x_val)
    rows = {row.tobytes() for row in np.concatenate([data.x_train, data.x_val])}
    pixels, _ = load_digits_arrays()
    assert rows == {(row / 16.0).astype(np.float32).tobytes() for row in pixels}


def test_images_and_pixel_range():
    data = digits(images=True, pixel_range=(-1.0, 1.0))
    assert data.x_train.shape == (1437, 1, 8, 8) and data.x_train.dtype == np.float32
    assert data.x_train.min() == -1.0 and data.x_train.max() == 1.0


def test_a_rank_that_loads_digits_does_not_import_scikit_learn():
    code = "import sys, nbdist; nbdist.datasets.digits(); print('sklearn' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("fraction", [0.0, 1.0, -0.5])
def test_a_split_fraction_outside_zero_one_is_refused(fraction):
    with pytest.raises(ValueError, match="val_fraction must be between 0 and 1"):
        stratified_split(np.arange(10) % 2, fraction, seed=0)
