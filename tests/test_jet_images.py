"""Jet images from Pythia 8: reproducible for a seed, physically distinct classes, and a
CNN trained on them with the file-list loader separates top from QCD jets."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

h5py = pytest.importorskip("h5py")
pytest.importorskip("pythia8mc")

from conftest import JET_SAMPLE, ROOT  # noqa: E402

from nbdist.datasets import jet_images  # noqa: E402
from nbdist.datasets.jet_images import DatasetError, _spec  # noqa: E402

TOP_MASS = 172.5


def datasets(path) -> dict:
    with h5py.File(path, "r") as fh:
        return {name: fh[name][:] for name in fh}


def test_the_sample_written_by_two_mpi_ranks(jet_sample):
    assert [p.name for p in jet_sample.train_files] == [f"train_{i:03d}.h5" for i in range(6)]
    assert [p.name for p in jet_sample.val_files] == ["val_000.h5", "val_001.h5"]
    x, y = jet_sample.read("features", "labels")
    x_val, y_val = jet_sample.read("features", "labels", split="val")
    assert x.shape == (1600, 1, 32, 32) and x.dtype == np.float32 and y.dtype == np.int64
    assert len(x_val) == 400
    for path in jet_sample.train_files + jet_sample.val_files:  # half signal in each file
        with h5py.File(path, "r") as fh:
            assert fh["labels"][:].sum() == fh.attrs["n_signal"] == (len(fh["labels"]) + 1) // 2
    # Pixels are pT fractions: the whole jet, but what centring moved out of the 2R square.
    total = x.sum(axis=(1, 2, 3))
    assert total.max() <= 1 + 1e-5 and total.min() > 0.8 and np.median(total) > 0.999
    with h5py.File(jet_sample.train_files[0], "r") as fh:
        attrs = dict(fh.attrs)
    assert attrs["signal"] == "top" and attrs["seed"] == JET_SAMPLE["seed"] and attrs["pixels"] == 32
    assert "Top:gg2ttbar = on" in attrs["pythia_signal"] and "HardQCD:all = on" in attrs["pythia_background"]
    assert "PartonLevel:MPI = off" in attrs["pythia_signal"] and "pythia8mc 8.317.2" in attrs["generator"]
    # Every file has its own seeds, so no two files repeat each other's events.
    seeds = {dict(h5py.File(p, "r").attrs)["pythia_signal"] for p in jet_sample.train_files}
    assert len(seeds) == 6


def test_generation_is_deterministic_for_a_seed(jet_sample, tmp_path):
    # Remake one file in this process: identical to the one an MPI rank made.
    copy = tmp_path / "again"
    shutil.copytree(jet_sample.directory, copy)
    (copy / "val_001.h5").unlink()  # a validation file: 200 events, the smallest
    again = jet_images(copy, **JET_SAMPLE, progress=False)
    assert (again.made, again.reused) == (1, 7)
    remade, original = datasets(copy / "val_001.h5"), datasets(jet_sample.directory / "val_001.h5")
    assert remade.keys() == original.keys()
    for name in original:
        np.testing.assert_array_equal(remade[name], original[name], err_msg=name)
    # Another seed gives other Pythia seeds for every file and process.
    spec, other = (
        _spec("top", 2000, 6, 0.2, 32, 0.8, (550, 650), 2.0, False, 7),
        _spec("top", 2000, 6, 0.2, 32, 0.8, (550, 650), 2.0, False, 8),
    )
    for job in spec.jobs:
        assert spec.seed_of(job, "top") != other.seed_of(job, "top")
        assert spec.fingerprint(job) != other.fingerprint(job)


def test_top_jets_are_heavier_and_three_pronged(jet_sample):
    mass, tau32, tau21, labels, x = jet_sample.read("jet_mass", "tau32", "tau21", "labels", "features")
    top, qcd = labels == 1, labels == 0
    # Top jets carry the top mass; QCD jets get their mass from radiation only.
    assert abs(np.median(mass[top]) - TOP_MASS) < 20, np.median(mass[top])
    assert np.median(mass[qcd]) < 110, np.median(mass[qcd])
    assert np.mean(np.abs(mass[top] - TOP_MASS) < 30) > 0.5
    assert np.mean(np.abs(mass[qcd] - TOP_MASS) < 30) < 0.15
    # Three prongs: tau3/tau2 is small for top jets, near 1 for one-pronged QCD jets.
    assert np.median(tau32[top]) < np.median(tau32[qcd]) - 0.15
    # The images say it too: a top jet's pT is spread away from the centre.
    centre = x[:, 0, 13:19, 13:19].sum(axis=(1, 2))
    assert centre[top].mean() < centre[qcd].mean() - 0.1


def test_w_jets_carry_the_w_mass_and_two_prongs(tmp_path):
    sample = jet_images(tmp_path / "w", signal="w", events=20, files=1, underlying_event=False, seed=3, progress=False)
    assert (sample.made, sample.reused) == (2, 0)
    data = sample.load()  # everything in memory: an ArrayData for load_data()
    assert (data.n_train, data.n_val, data.num_classes) == (16, 4, 2)
    mass, tau21, labels = sample.read("jet_mass", "tau21", "labels")
    assert 70 < np.median(mass[labels == 1]) < 90, mass[labels == 1]
    assert np.median(tau21[labels == 1]) < np.median(tau21[labels == 0])


def test_a_cnn_trained_on_the_files_separates_top_from_qcd(jet_sample, mpirun, tmp_path):
    """The user's command line: two ranks of allreduce, reading the HDF5 files through
    a node-local cache; then the ROC AUC of the final weights on the held-out jets."""
    import runpy

    import torch
    from safetensors.torch import load_file
    from sklearn.metrics import roc_auc_score

    cache = tmp_path / "node-cache"
    done = mpirun(
        2,
        [
            "-m",
            "nbdist",
            "train",
            "--model",
            str(ROOT / "examples" / "jet_cnn.py"),
            "--topology",
            "allreduce",
            "--epochs",
            "4",
            "--train",
            jet_sample.train,
            "--val",
            jet_sample.val,
            "--cache-dir",
            str(cache),
            "--runs-dir",
            str(tmp_path / "runs"),
            "--run-name",
            "cnn",
        ],
        timeout=240,
    )
    assert done.returncode == 0, done.output
    summary = json.loads((tmp_path / "runs" / "cnn" / "summary.json").read_text())
    assert [h["samples"] for h in summary["history"]] == [1600] * 4  # every jet once per epoch
    assert not cache.exists()  # each rank's copies removed at the end

    model = runpy.run_path(str(ROOT / "examples" / "jet_cnn.py"))["build_model"]()
    model.load_state_dict(load_file(str(tmp_path / "runs" / "cnn" / "final" / "model.safetensors")))
    model.eval()
    x_val, y_val = jet_sample.read("features", "labels", split="val")
    with torch.no_grad():
        score = torch.softmax(model(torch.from_numpy(x_val)), dim=1)[:, 1].numpy()
    auc = roc_auc_score(y_val, score)
    assert auc >= 0.85, auc


def test_bad_requests_are_one_clear_error(tmp_path, jet_sample):
    with pytest.raises(DatasetError, match=r"^unknown signal 'higgs'; choose one of: top, w$"):
        jet_images(tmp_path, signal="higgs")
    with pytest.raises(DatasetError, match=r"^6 events are too few for 4 training and 1 validation files"):
        jet_images(tmp_path, events=6)
    # Another sample's files in the directory would mix in under the same glob.
    foreign = tmp_path / "mixed"
    shutil.copytree(jet_sample.directory, foreign)
    with pytest.raises(
        DatasetError,
        match=r"already holds 8 file\(s\) of another sample \(train_000\.h5, "
        r"train_001\.h5, train_002\.h5, train_003\.h5 \.\.\.\)",
    ):
        jet_images(foreign, **{**JET_SAMPLE, "seed": 8})
    assert len(list(foreign.glob("*.h5"))) == 8  # nothing removed without overwrite=True
