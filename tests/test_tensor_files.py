"""A checkpoint share's safetensors file written from the arrays' memory holds the bytes
safetensors' own `save` makes, and its digest is the file's."""

from __future__ import annotations

import hashlib

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file, save

from nbdist.train.tensor_files import write_safetensors

ARRAYS = {
    "model/params": np.random.default_rng(0).standard_normal(100_003).astype(np.float32),
    "model/state": np.zeros(0, np.float32),  # a model without BatchNorm
    "opt/step": np.array(7.0, np.float32),  # 0-d: Adam's step count
    "opt/exp_avg": np.arange(12, dtype=np.float64).reshape(3, 4),
    "rng/torch_cpu": np.arange(5056, dtype=np.uint8),
    "rule/counters": np.array([1, -2, 3], np.int64),
    "own/mask": np.array([True, False, True]),
}


def test_the_file_is_what_safetensors_saves_and_its_digest_is_the_files(tmp_path):
    path = tmp_path / "rank-00000.safetensors"
    written = write_safetensors(path, ARRAYS)
    data = path.read_bytes()
    assert data == save(ARRAYS)
    assert written == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    loaded = load_file(str(path))
    assert loaded.keys() == ARRAYS.keys()
    for name, array in ARRAYS.items():
        assert loaded[name].dtype == array.dtype and loaded[name].shape == array.shape, name
        np.testing.assert_array_equal(loaded[name], array)
    with safe_open(str(path), framework="numpy") as fh:  # the reader a twin's share goes through
        np.testing.assert_array_equal(fh.get_tensor("model/params"), ARRAYS["model/params"])


def test_a_dtype_safetensors_maps_no_other_way_goes_through_its_save(tmp_path):
    swapped = {"x": np.arange(4, dtype=">f4")}  # big-endian: not written from memory as it is
    write_safetensors(tmp_path / "a.safetensors", swapped)
    np.testing.assert_array_equal(load_file(str(tmp_path / "a.safetensors"))["x"], np.arange(4, dtype=np.float32))
