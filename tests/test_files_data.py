"""HDF5 file lists: every sample once per epoch over workers, shuffling, the node-local
cache and prefetching, and the errors a user sees for bad files."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

h5py = pytest.importorskip("h5py")

from nbdist.data import DataError, FilePlan, HDF5Data  # noqa: E402
from nbdist.errors import OptionsError  # noqa: E402
from nbdist.options import TrainOptions  # noqa: E402

SIZES = [5, 37, 12, 60, 3, 25, 18]  # 7 files of uneven size: 160 samples
WORKERS = 3


def write(path: Path, ids: np.ndarray, *, keys=("features", "labels"), shape=(2, 3)) -> Path:
    """A file whose sample k is filled with its id, so a read says which sample it got."""
    with h5py.File(path, "w") as fh:
        fh[keys[0]] = np.broadcast_to(ids[:, None, None], (len(ids), *shape)).astype(np.float32)
        fh[keys[1]] = (ids % 2).astype(np.int64)
    return path


@pytest.fixture
def files(tmp_path) -> dict:
    train_dir = tmp_path / "shared"
    train_dir.mkdir()
    start, paths = 0, []
    for i, n in enumerate(SIZES):
        paths.append(write(train_dir / f"train_{i}.h5", np.arange(start, start + n)))
        start += n
    write(train_dir / "val_0.h5", np.arange(1000, 1010))
    return {
        "dir": train_dir,
        "train": str(train_dir / "train_*.h5"),
        "val": str(train_dir / "val_0.h5"),
        "paths": paths,
        "n": start,
    }


def ids_of(x: np.ndarray) -> np.ndarray:
    return x[:, 0, 0].astype(np.int64)


def file_of(ids: np.ndarray) -> np.ndarray:
    return np.searchsorted(np.cumsum(SIZES), ids, side="right")


def run_epoch(ranks: list[HDF5Data], plans: list[FilePlan], epoch: int) -> list[list[np.ndarray]]:
    """What each worker reads in one epoch, batch by batch, as a training loop reads it."""
    seen = []
    for shard, (data, plan) in enumerate(zip(ranks, plans, strict=True)):
        batches = []
        for indices in plan.epoch(epoch, shard):
            x, y = data.train_batch(indices)
            assert np.array_equal(y, ids_of(x) % 2)  # labels travel with their features
            batches.append(ids_of(x))
        seen.append(batches)
    return seen


def test_every_sample_once_per_epoch_over_three_workers_with_even_work(files):
    ranks = [HDF5Data(files["train"], files["val"]) for _ in range(WORKERS)]  # one per rank, as in a run
    plans = [data.plan(WORKERS, 8, seed=3) for data in ranks]
    orders = []
    for epoch in range(3):
        seen = run_epoch(ranks, plans, epoch)
        everything = np.concatenate([b for batches in seen for b in batches])
        np.testing.assert_array_equal(np.sort(everything), np.arange(files["n"]))  # once each
        assert {len(batches) for batches in seen} == {plans[0].batches_per_epoch}
        per_worker = [sum(len(b) for b in batches) for batches in seen]
        assert max(per_worker) - min(per_worker) <= 1, per_worker  # even work
        for step in range(plans[0].batches_per_epoch):
            sizes = [len(seen[w][step]) for w in range(WORKERS)]
            assert max(sizes) - min(sizes) <= 1 and max(sizes) <= 8
            np.testing.assert_array_equal(plans[0].step_sizes(epoch)[step], sizes)
        orders.append([np.concatenate(batches) for batches in seen])
        # Shuffled within files (not in stored order) and across them (batches mix files).
        assert any(np.any(np.diff(b) < 0) for batches in seen for b in batches)
        assert any(len(np.unique(file_of(b))) > 1 for batches in seen for b in batches)
    # A new order every epoch, and each worker keeps its files (a cache copy is read again).
    for w in range(WORKERS):
        assert not np.array_equal(orders[0][w], orders[1][w])
        assert set(file_of(orders[0][w])) == set(file_of(orders[1][w]))
    # The same plan again (same seed) reads the same batches: resumable, reproducible.
    again = [HDF5Data(files["train"], files["val"]) for _ in range(WORKERS)]
    replay = run_epoch(again, [d.plan(WORKERS, 8, seed=3) for d in again], 1)
    for w in range(WORKERS):
        np.testing.assert_array_equal(np.concatenate(replay[w]), orders[1][w])
    for data in ranks + again:
        data.close()


def test_a_window_in_memory_and_the_next_read_in_the_background(files, tmp_path):
    cache_root = tmp_path / "node-local" / "cache"
    data = HDF5Data(files["train"], files["val"], cache_dir=cache_root, mix=1)
    plan = data.plan(1, 4, seed=0)  # one worker: seven windows of one file each
    windows = plan.windows(0, 0)
    batches = plan.epoch(0, 0)
    data.train_batch(batches[0])
    # While the first window trains, the next file is copied into the cache and read.
    second = windows[1][0]
    second_path = files["paths"][second.file]
    deadline = time.monotonic() + 30
    while second_path not in data.cache.copies or second not in data.reader.held():
        assert time.monotonic() < deadline, "the next file was not prefetched"
        time.sleep(0.05)
    # Memory holds the window in use and the next, not the whole file list.
    assert len(data.reader.held()) <= 2
    for indices in batches[1:]:
        data.train_batch(indices)
    assert len(data.reader.held()) <= 2
    data.close()


def test_the_cache_directory_is_used_and_cleaned(files, tmp_path):
    cache_root = tmp_path / "node-local" / "cache"
    ranks = [HDF5Data(files["train"], files["val"], cache_dir=cache_root) for _ in range(WORKERS)]
    plans = [data.plan(WORKERS, 8, seed=1) for data in ranks]
    first = run_epoch(ranks, plans, 0)
    x_val, y_val = ranks[0].val_arrays()
    np.testing.assert_array_equal(ids_of(x_val), np.arange(1000, 1010))
    # Each rank copied the files it reads into its own directory under the cache root.
    private = sorted(p for p in cache_root.iterdir() if p.is_dir())
    assert len(private) == WORKERS
    for data, batches in zip(ranks, first, strict=True):
        wanted = {files["paths"][f] for f in set(file_of(np.concatenate(batches)))}
        assert wanted <= set(data.cache.copies)
        for original, copy in data.cache.copies.items():
            assert copy.parent in private and copy.read_bytes() == original.read_bytes()
    # The shared file system goes away: the next epoch reads the node-local copies only.
    gone = files["dir"].rename(tmp_path / "unmounted")
    second = run_epoch(ranks, plans, 1)
    everything = np.concatenate([b for batches in second for b in batches])
    np.testing.assert_array_equal(np.sort(everything), np.arange(files["n"]))
    gone.rename(files["dir"])
    for data in ranks:
        data.close()
    assert not cache_root.exists()  # made by the caches, removed by the last to close
    assert cache_root.parent.exists()


def test_a_cache_directory_that_existed_is_kept_and_emptied(files, tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / "mine.txt").write_text("the user's")
    data = HDF5Data(files["train"], files["val"], cache_dir=scratch)
    data.train_batch(np.arange(4))
    assert len(list(scratch.iterdir())) == 2
    data.close()
    assert [p.name for p in scratch.iterdir()] == ["mine.txt"]


# -- errors ----------------------------------------------------------------------------
def test_a_cache_directory_that_cannot_be_made_is_one_error(files, tmp_path):
    from nbdist.data.cache import CacheError

    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    for root in (blocker, blocker / "cache"):
        with pytest.raises(CacheError, match=rf"^--cache-dir '{root}' cannot be used: Not a directory$"):
            HDF5Data(files["train"], files["val"], cache_dir=root)


def test_a_missing_file_or_a_glob_that_matches_nothing(files):
    with pytest.raises(DataError, match=r"^--train: file '.*/shared/train_9\.h5' not found$"):
        HDF5Data(str(files["dir"] / "train_9.h5"), files["val"])
    with pytest.raises(DataError, match=r"^--val: no file matches '.*/shared/valid_\*\.h5'$"):
        HDF5Data(files["train"], str(files["dir"] / "valid_*.h5"))
    with pytest.raises(DataError, match=r"^--train names no file$"):
        HDF5Data(" , ", files["val"])


def test_a_missing_dataset_name_says_which_names_the_file_has(files, tmp_path):
    write(tmp_path / "other.h5", np.arange(4), keys=("images", "y"))
    with pytest.raises(DataError) as err:
        HDF5Data(f"{files['train']},{tmp_path / 'other.h5'}", files["val"])
    assert str(err.value) == (
        f"--train: {tmp_path / 'other.h5'} has no dataset 'features' (it has: images, y); "
        f"name the features and labels datasets with --data-keys FEATURES,LABELS"
    )
    data = HDF5Data(str(tmp_path / "other.h5"), str(tmp_path / "other.h5"), keys=("images", "y"))
    assert data.n_train == 4
    data.close()


def test_shapes_that_disagree_between_files(files, tmp_path):
    odd = write(tmp_path / "odd.h5", np.arange(4), shape=(3, 3))
    with pytest.raises(DataError) as err:
        HDF5Data(f"{files['train']},{odd}", files["val"])
    assert str(err.value) == (
        f"--train: the files disagree: {odd} holds 'features' of shape (3, 3) float32 and 'labels' of () "
        f"int64 per sample, {files['paths'][0]} holds (2, 3) float32 and () int64"
    )
    with pytest.raises(
        DataError,
        match=r"^--val holds samples of shape \(3, 3\) with labels \(\), "
        r"--train holds \(2, 3\) with \(\)$",
    ):
        HDF5Data(files["train"], str(odd))


def test_features_and_labels_of_different_lengths_and_files_that_are_not_hdf5(files, tmp_path):
    with h5py.File(tmp_path / "short.h5", "w") as fh:
        fh["features"] = np.zeros((5, 2, 3), np.float32)
        fh["labels"] = np.zeros(4, np.int64)
    with pytest.raises(DataError, match=r"short\.h5 has 5 rows of 'features' but 4 of 'labels'$"):
        HDF5Data(str(tmp_path / "short.h5"), files["val"])
    (tmp_path / "notes.h5").write_text("not HDF5")
    with pytest.raises(DataError, match=r"^--train: .*notes\.h5 is not a readable HDF5 file"):
        HDF5Data(str(tmp_path / "notes.h5"), files["val"])


def test_file_options_are_checked_together():
    with pytest.raises(OptionsError, match=r"^--train needs --val"):
        TrainOptions(train="a_*.h5").validate()
    with pytest.raises(OptionsError, match=r"^--cache-dir applies to data in files: give --train as well$"):
        TrainOptions(cache_dir="/tmp/x").validate()
    with pytest.raises(OptionsError, match=r"^--data-keys takes the features and the labels dataset names"):
        TrainOptions(train="a.h5", val="b.h5", data_keys="features").validate()
    TrainOptions(train="a.h5", val="b.h5", data_keys="x,y", cache_dir="/tmp/x").validate()


def test_a_missing_file_on_the_command_line_is_one_line(files, tmp_path, capsys):
    """The command line's own entry point (nbdist.cli.main, what `python -m nbdist` runs),
    called here: the check is made before any rank would start."""
    from nbdist.cli import main

    model = tmp_path / "model.py"
    model.write_text("from torch import nn\nmodel = nn.Sequential(nn.Flatten(), nn.Linear(6, 2))\n")
    code = main(
        [
            "train",
            "--model",
            str(model),
            "--topology",
            "allreduce",
            "--train",
            str(files["dir"] / "train_*.h5") + ",missing.h5",
            "--val",
            files["val"],
            "--runs-dir",
            str(tmp_path / "runs"),
        ]
    )
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert err.strip() == "nbdist: error: --train: file 'missing.h5' not found"
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_file_that_cannot_be_read_while_training_stops_the_run(files, mpirun, tmp_path):
    """Only the rank reading the file knows: the run is aborted, not left waiting."""
    bad = files["dir"] / "train_3.h5"  # its metadata is fine; its compressed data is not
    ids = np.arange(1000, 1000 + SIZES[3])
    with h5py.File(bad, "w") as fh:
        fh.create_dataset(
            "features",
            data=np.broadcast_to(ids[:, None, None], (len(ids), 2, 3)).astype(np.float32),
            chunks=(4, 2, 3),
            compression="gzip",
        )
        fh["labels"] = (ids % 2).astype(np.int64)
        chunks = [fh["features"].id.get_chunk_info(i) for i in range(fh["features"].id.get_num_chunks())]
    with open(bad, "r+b") as raw:
        for chunk in chunks:
            raw.seek(chunk.byte_offset)
            raw.write(b"\xff" * chunk.size)
    model = tmp_path / "model.py"
    model.write_text("from torch import nn\nmodel = nn.Sequential(nn.Flatten(), nn.Linear(6, 2))\n")
    done = mpirun(
        2,
        [
            "-m",
            "nbdist",
            "train",
            "--model",
            str(model),
            "--topology",
            "allreduce",
            "--train",
            files["train"],
            "--val",
            files["val"],
            "--epochs",
            "2",
            "--runs-dir",
            str(tmp_path / "runs"),
        ],
        timeout=120,
    )
    assert done.returncode != 0, done.output
    assert f"DataReadError: --train: cannot read {bad}" in done.stderr, done.output
