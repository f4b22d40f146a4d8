"""Atomic, durable, verified checkpoints (write per rank, commit, LATEST, fallback to the
newest intact one, pruning, shared copies), the run's history file, and the stopping
decisions."""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from nbdist.algorithms import EASGD, GEM
from nbdist.options import TrainOptions, parse_target
from nbdist.train.checkpoint import CheckpointError, Checkpoints, flatten_arrays, unflatten_arrays
from nbdist.train.history import HistoryFile
from nbdist.train.run_dir import find_resume
from nbdist.train.state import IDENTICAL_ON_TWINS
from nbdist.train.stopping import EarlyStopping, StopFlag


def rank_arrays(rank: int) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(rank)
    return {
        "model": {"params": rng.normal(size=17).astype(np.float32), "state": np.zeros(0, np.float32)},
        "opt": {"exp_avg": rng.normal(size=17).astype(np.float32), "step": np.asarray(np.float32(3))},
        "rule": {"count": np.asarray(5), "velocity": rng.normal(size=17).astype(np.float32)},
        "rng": {"torch_cpu": rng.integers(0, 255, size=40).astype(np.uint8)},
    }


def assert_same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for group in a:
        assert set(a[group]) == set(b[group])
        for name, value in a[group].items():
            assert b[group][name].dtype == value.dtype and b[group][name].shape == value.shape
            np.testing.assert_array_equal(b[group][name], value)


def write_all(ckpt: Checkpoints, label: str, ranks=(0, 1)) -> None:
    for rank in ranks:
        ckpt.write_rank(label, rank, rank_arrays(rank + len(label)), {"rank": rank, "epoch": len(label)})


def test_write_commit_latest_read(tmp_path):
    ckpt = Checkpoints(tmp_path)
    assert ckpt.latest() is None
    write_all(ckpt, "epoch-0001")
    assert ckpt.ranks_written("epoch-0001") == 2
    assert ckpt.latest() is None  # written but not committed
    final = ckpt.commit("epoch-0001", {"label": "epoch-0001", "version": 12})
    assert final == tmp_path / "checkpoints" / "epoch-0001"
    assert ckpt.latest() == final
    assert not (tmp_path / "checkpoints" / ".tmp-epoch-0001").exists()
    meta = Checkpoints.read_meta(final)
    assert (meta["label"], meta["version"], meta["sequence"]) == ("epoch-0001", 12, 1)
    for rank in (0, 1):
        arrays, meta = Checkpoints.read_rank(final, rank)
        expected = rank_arrays(rank + len("epoch-0001"))
        expected["model"].pop("state")  # empty arrays: see below
        arrays["model"].pop("state", None)
        assert_same(expected, arrays)
        assert meta == {"rank": rank, "epoch": len("epoch-0001")}
    with pytest.raises(CheckpointError, match="no state for rank 2"):
        Checkpoints.read_rank(final, 2)


@pytest.mark.parametrize("then", ["committed", "rotated away"])
def test_a_share_whose_checkpoint_went_on_without_it_is_no_error(tmp_path, monkeypatch, then):
    """A frozen asynchronous worker wakes up in the middle of writing its share: the master
    committed the checkpoint without it (and, frozen long enough, later ones removed it)."""
    module = sys.modules[Checkpoints.__module__]

    ckpt = Checkpoints(tmp_path, keep=1)
    write_all(ckpt, "epoch-0001", ranks=(0,))
    real_write_json = module.write_json

    def committed_meanwhile(path, data):
        if Path(path).name == "rank-00001.json":  # rank 1's share, and not the master's writes
            monkeypatch.setattr(module, "write_json", real_write_json)
            ckpt.commit("epoch-0001", {"label": "epoch-0001"})
            if then == "rotated away":
                write_all(ckpt, "epoch-0002", ranks=(0,))
                ckpt.commit("epoch-0002", {"label": "epoch-0002"})
        real_write_json(path, data)  # its directory is gone: FileNotFoundError

    monkeypatch.setattr(module, "write_json", committed_meanwhile)
    ckpt.write_rank("epoch-0001", 1, rank_arrays(1), {"rank": 1})
    assert ckpt.latest().name == ("epoch-0001" if then == "committed" else "epoch-0002")
    assert Checkpoints.damage(ckpt.latest()) is None


def test_a_share_that_cannot_be_written_while_its_checkpoint_is_pending_is_an_error(tmp_path, monkeypatch):
    module = sys.modules[Checkpoints.__module__]

    ckpt = Checkpoints(tmp_path)

    def missing(path, data):
        raise FileNotFoundError(2, "No such file or directory", str(path))

    monkeypatch.setattr(module, "write_json", missing)
    with pytest.raises(FileNotFoundError):
        ckpt.write_rank("epoch-0001", 0, rank_arrays(0), {"rank": 0})


def test_empty_and_scalar_arrays_survive(tmp_path):
    ckpt = Checkpoints(tmp_path)
    arrays = {
        "model": {"params": np.arange(3, dtype=np.float32), "state": np.zeros(0, np.float32)},
        "opt": {},
        "rule": EASGD().new_worker_state(3, 4).to_arrays(),
    }
    ckpt.write_rank("a", 0, arrays, {})
    path = ckpt.commit("a", {})
    back, _ = Checkpoints.read_rank(path, 0)
    assert back["model"]["state"].shape == (0,)
    assert int(back["rule"]["sync_every"]) == 4
    restored = EASGD().new_worker_state(3, 1)
    restored.load_arrays(back["rule"])
    assert restored.sync_every == 4 and restored.count == 0


@pytest.mark.parametrize("saved_as", ["previous_centre", "previous_center"], ids=["now", "before-the-rename"])
def test_rule_state_through_a_checkpoint(tmp_path, saved_as):
    """GEM's worker state through a checkpoint. Its `previous_centre` was saved as
    `previous_center` before the project took one spelling: a checkpoint written then
    restores it too (a state that skipped it would resume GEM's correction from zeros,
    silently)."""
    gem = GEM()
    state = gem.new_worker_state(6, 2)
    rng = np.random.default_rng(0)
    state.velocity[:] = rng.normal(size=6)
    state.previous_centre[:] = rng.normal(size=6)
    state.count, state.pulls = 1, 7
    arrays = state.to_arrays()
    arrays[saved_as] = arrays.pop("previous_centre")
    ckpt = Checkpoints(tmp_path)
    ckpt.write_rank("x", 3, {"rule": arrays}, {})
    back, _ = Checkpoints.read_rank(ckpt.commit("x", {}), 3)
    assert saved_as in back["rule"]
    restored = gem.new_worker_state(6, 2)
    restored.load_arrays(back["rule"])
    np.testing.assert_array_equal(restored.velocity, state.velocity)
    np.testing.assert_array_equal(restored.previous_centre, state.previous_centre)
    assert (restored.count, restored.pulls, restored.sync_every) == (1, 7, 2)


def test_uncommitted_directory_is_never_latest(tmp_path):
    ckpt = Checkpoints(tmp_path)
    write_all(ckpt, "epoch-0001")
    first = ckpt.commit("epoch-0001", {"label": "epoch-0001"})
    # A later checkpoint that crashed half-way: one rank wrote, no commit.
    write_all(ckpt, "epoch-0002", ranks=(0,))
    assert (tmp_path / "checkpoints" / ".tmp-epoch-0002").is_dir()
    assert ckpt.latest() == first
    # Even a LATEST pointing at a directory without meta.json is not trusted.
    (tmp_path / "checkpoints" / "LATEST.json").write_text(json.dumps({"label": ".tmp-epoch-0002"}))
    assert ckpt.latest() is None
    (tmp_path / "checkpoints" / "LATEST.json").write_text(json.dumps({"label": "epoch-0001"}))
    ckpt.discard_incomplete()
    assert not (tmp_path / "checkpoints" / ".tmp-epoch-0002").exists()
    assert ckpt.latest() == first


def test_second_commit_moves_latest(tmp_path):
    ckpt = Checkpoints(tmp_path)
    write_all(ckpt, "epoch-0001")
    first = ckpt.commit("epoch-0001", {"n": 1})
    write_all(ckpt, "epoch-0002")
    second = ckpt.commit("epoch-0002", {"n": 2})
    assert ckpt.latest() == second != first
    assert first.is_dir()  # the earlier one stays
    assert Checkpoints.read_meta(ckpt.latest())["n"] == 2
    # Re-committing a label replaces it.
    ckpt.write_rank("epoch-0001", 0, {"model": {"params": np.ones(2, np.float32)}}, {"again": True})
    again = ckpt.commit("epoch-0001", {"n": 3})
    assert ckpt.latest() == again == first
    arrays, meta = Checkpoints.read_rank(again, 0)
    assert meta == {"again": True}
    np.testing.assert_array_equal(arrays["model"]["params"], np.ones(2, np.float32))
    assert not (again / "rank-00001.safetensors").exists()
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))


def test_flatten_round_trip():
    groups = {"opt": {"exp_avg": np.ones(2, np.float32)}, "model": {"params": np.zeros(3, np.float32)}}
    flat = flatten_arrays(groups)
    assert set(flat) == {"opt/exp_avg", "model/params"}
    assert_same(groups, unflatten_arrays(flat))


# ------------------------------------------------------------------ durable writes
def test_every_file_is_durable_before_the_checkpoint_is_renamed_and_latest_moves(tmp_path, monkeypatch):
    """fsync of each file, then of its directory, before the rename; the parent directory
    after the rename and after LATEST moved; pruning only after that."""
    ckpt = Checkpoints(tmp_path, keep=2)
    for label in ("epoch-0001", "epoch-0002"):
        write_all(ckpt, label)
        ckpt.commit(label, {"label": label})
    events: list[tuple] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        real_replace(src, dst)
        events.append(("rename", str(src), str(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    write_all(ckpt, "epoch-0003")
    final = ckpt.commit("epoch-0003", {"label": "epoch-0003"})
    monkeypatch.undo()

    root = str((tmp_path / "checkpoints").resolve())
    tmp = f"{root}/.tmp-epoch-0003"

    def index(*event) -> int:
        assert event in events, (event, events)
        return events.index(event)

    moved = index("rename", tmp, f"{root}/epoch-0003")
    for name in sorted(p.name for p in final.iterdir()):
        if name.endswith(".json"):  # written as NAME.tmp, fsynced, renamed
            synced, renamed = index("fsync", f"{tmp}/{name}.tmp"), index("rename", f"{tmp}/{name}.tmp", f"{tmp}/{name}")
            assert synced < renamed < moved, name
        else:
            assert index("fsync", f"{tmp}/{name}") < moved, name
    last_file = max(i for i, e in enumerate(events[:moved]) if e[0] == "rename")
    assert any(e == ("fsync", tmp) for e in events[last_file:moved]), "the directory was not fsynced after its files"
    latest = index("rename", f"{root}/LATEST.json.tmp", f"{root}/LATEST.json")
    assert ("fsync", root) in events[moved:latest], "the checkpoints directory was not fsynced after the rename"
    assert index("fsync", f"{root}/LATEST.json.tmp") < latest
    pruned = index("rename", f"{root}/epoch-0001", f"{root}/.old-epoch-0001")
    assert ("fsync", root) in events[latest:pruned], "LATEST's rename was not fsynced before pruning"
    assert not (tmp_path / "checkpoints" / "epoch-0001").exists()
    assert not list((tmp_path / "checkpoints").glob(".*"))


def test_meta_lists_every_file_with_its_size_and_sha256(tmp_path):
    ckpt = Checkpoints(tmp_path)
    write_all(ckpt, "epoch-0001", ranks=(0, 1, 2))
    final = ckpt.commit("epoch-0001", {"label": "epoch-0001"})
    files = Checkpoints.read_meta(final)["files"]
    assert set(files) == {p.name for p in final.iterdir()} - {"meta.json"}
    assert len(files) == 6
    for name, recorded in files.items():
        data = (final / name).read_bytes()
        assert recorded == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    for rank in range(3):  # complete files: they load
        assert set(load_file(str(final / f"rank-{rank:05d}.safetensors"))) >= {"model/params", "rng/torch_cpu"}


# ------------------------------------------------------- damaged checkpoints, fallback
def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) - 5] ^= 0xFF  # inside the last array: the file still parses
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncated": (lambda d: _truncate(d / "rank-00001.safetensors"), "rank-00001.safetensors is truncated ("),
    "deleted": (lambda d: (d / "rank-00000.safetensors").unlink(), "rank-00000.safetensors is missing"),
    "corrupt": (lambda d: _flip_a_byte(d / "rank-00000.safetensors"), "rank-00000.safetensors is corrupt"),
    "rank json": (lambda d: (d / "rank-00001.json").write_text("{"), "rank-00001.json is truncated (1 of "),
    "meta json": (lambda d: (d / "meta.json").write_text('{"label": '), "meta.json is not valid JSON"),
    "no meta": (lambda d: (d / "meta.json").unlink(), "meta.json is missing"),
}


def _three_checkpoints(run: Path, **kw) -> Checkpoints:
    ckpt = Checkpoints(run, **kw)
    for label in ("epoch-0001", "epoch-0002", "epoch-0003"):
        write_all(ckpt, label)
        ckpt.commit(label, {"label": label})
    return ckpt


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(tmp_path, damage):
    ckpt = _three_checkpoints(tmp_path)
    damaged = tmp_path / "checkpoints" / "epoch-0003"
    assert ckpt.latest_intact() == (damaged, [])
    spoil, what = DAMAGE[damage]
    spoil(damaged)
    path, problems = ckpt.latest_intact()
    assert path == tmp_path / "checkpoints" / "epoch-0002"
    assert len(problems) == 1 and "\n" not in problems[0]
    assert problems[0].startswith(f"checkpoint {damaged} is damaged: {what}"), problems
    if damage == "truncated":
        # Read anyway: one clear error, not safetensors' own.
        with pytest.raises(CheckpointError, match=r"the state of rank 1 cannot be read"):
            Checkpoints.read_rank(damaged, 1)


def test_resume_names_the_damaged_checkpoint_and_uses_the_previous(tmp_path):
    (tmp_path / "options.json").write_text("{}")
    _three_checkpoints(tmp_path)
    _truncate(tmp_path / "checkpoints" / "epoch-0003" / "rank-00000.safetensors")
    (tmp_path / "checkpoints" / "epoch-0003" / "rank-00001.json").unlink()
    path, problems = find_resume(TrainOptions(resume=str(tmp_path)))
    assert path == tmp_path / "checkpoints" / "epoch-0002"
    assert problems == [
        f"checkpoint {tmp_path / 'checkpoints' / 'epoch-0003'} is damaged: rank-00000.safetensors "
        f"is truncated (364 of 728 bytes) (and 1 more damaged file)"
    ]


def test_no_intact_checkpoint_left_is_one_clear_error(tmp_path):
    (tmp_path / "options.json").write_text("{}")
    _three_checkpoints(tmp_path)
    for label in ("epoch-0001", "epoch-0002", "epoch-0003"):
        _flip_a_byte(tmp_path / "checkpoints" / label / "rank-00001.safetensors")
    with pytest.raises(CheckpointError) as info:
        find_resume(TrainOptions(resume=str(tmp_path)))
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"--resume {tmp_path}: no intact checkpoint is left (checkpoint ")
    for label in ("epoch-0001", "epoch-0002", "epoch-0003"):
        assert f"{tmp_path / 'checkpoints' / label} is damaged: rank-00001.safetensors is corrupt" in message
    assert message.endswith("start the run afresh without --resume")


def test_an_unreadable_latest_pointer_falls_back_to_commit_order(tmp_path):
    ckpt = _three_checkpoints(tmp_path)
    (tmp_path / "checkpoints" / "LATEST.json").write_text("{")
    assert ckpt.latest() is None
    assert ckpt.latest_intact() == (tmp_path / "checkpoints" / "epoch-0003", [])


def test_checkpoints_written_before_digests_still_resume_and_are_checked(tmp_path):
    """meta.json without a file list (an older nbdist): a file that does not parse is damage."""
    root = tmp_path / "checkpoints"
    for label in ("epoch-0001", "epoch-0002"):
        (root / label).mkdir(parents=True)
        for rank in (0, 1):
            save_file(flatten_arrays(rank_arrays(rank)), str(root / label / f"rank-{rank:05d}.safetensors"))
            (root / label / f"rank-{rank:05d}.json").write_text(json.dumps({"rank": rank, "history": []}))
        (root / label / "meta.json").write_text(json.dumps({"label": label, "time": 1.0}))
    (root / "LATEST.json").write_text(json.dumps({"label": "epoch-0002"}))
    ckpt = Checkpoints(tmp_path)
    assert ckpt.latest_intact() == (root / "epoch-0002", [])
    _truncate(root / "epoch-0002" / "rank-00001.safetensors")
    (root / "epoch-0002" / "rank-00000.json").unlink()
    path, problems = ckpt.latest_intact()
    assert path == root / "epoch-0001"
    assert problems == [
        f"checkpoint {root / 'epoch-0002'} is damaged: rank-00000.json is missing (and 1 more damaged file)"
    ]
    arrays, meta = Checkpoints.read_rank(path, 1)
    assert_same(rank_arrays(1), arrays)
    with pytest.raises(CheckpointError, match="the state of rank 1 cannot be read"):
        Checkpoints.read_rank(root / "epoch-0002", 1)
    # The next commit numbers itself after them; pruning takes them first.
    write_all(ckpt, "epoch-0003")
    ckpt.keep = 2
    assert Checkpoints.read_meta(ckpt.commit("epoch-0003", {}))["sequence"] == 1
    assert sorted(p.name for p in root.iterdir()) == ["LATEST.json", "epoch-0002", "epoch-0003"]


# --------------------------------------------------------------------------- pruning
def test_keep_n_prunes_the_oldest_in_commit_order_never_latest(tmp_path):
    ckpt = Checkpoints(tmp_path, keep=2)
    root = tmp_path / "checkpoints"
    # A stopped run resumed: its stop label sorts after the epochs committed later.
    order = ["stopped-0000000042", "epoch-0001", "epoch-0002", "epoch-0003"]
    for n, label in enumerate(order, start=1):
        write_all(ckpt, label)
        path = ckpt.commit(label, {"label": label})
        assert Checkpoints.read_meta(path)["sequence"] == n
        assert ckpt.latest() == path
        kept = sorted(p.name for p in root.iterdir() if p.is_dir())
        assert kept == sorted(order[max(0, n - 2) : n]), kept
    # Re-committing an older label makes it the newest.
    write_all(ckpt, "epoch-0002")
    ckpt.commit("epoch-0002", {"label": "again"})
    assert sorted(p.name for p in root.iterdir()) == ["LATEST.json", "epoch-0002", "epoch-0003"]
    assert Checkpoints.read_meta(root / "epoch-0002")["sequence"] == 5
    # Without `keep` (a rank that never commits, the tests above) nothing is deleted.
    assert len(_three_checkpoints(tmp_path / "all")._committed()) == 3


# --------------------------------------------------------------------- shared copies
def test_a_rank_sharing_a_copy_reads_the_owners_weights_and_its_own_rng(tmp_path):
    ckpt = Checkpoints(tmp_path)
    owner = rank_arrays(0)
    owner["model"]["state"] = np.arange(3, dtype=np.float32)
    twin = {
        "model": {"params": owner["model"]["params"].copy(), "state": np.full(3, 7, np.float32)},
        "opt": {k: v.copy() for k, v in owner["opt"].items()},
        "rule": {k: v.copy() for k, v in owner["rule"].items()},
        "rng": rank_arrays(1)["rng"],
        "own": {"pulled": np.ones(4, np.float32)},
    }
    ckpt.write_rank("e", 0, owner, {"rank": 0}, same_as=0, shared=IDENTICAL_ON_TWINS)  # itself: writes all
    ckpt.write_rank("e", 1, twin, {"rank": 1}, same_as=0, shared=IDENTICAL_ON_TWINS)
    path = ckpt.commit("e", {})
    assert set(load_file(str(path / "rank-00001.safetensors"))) == {"model/state", "rng/torch_cpu", "own/pulled"}
    assert (path / "rank-00001.safetensors").stat().st_size < (path / "rank-00000.safetensors").stat().st_size / 2
    arrays, meta = Checkpoints.read_rank(path, 1)
    assert_same(twin, arrays)
    assert meta == {"rank": 1}
    arrays, meta = Checkpoints.read_rank(path, 0)
    assert_same(owner, arrays)
    # The owner's file is part of the twin's state: its loss is the checkpoint's.
    (path / "rank-00000.safetensors").unlink()
    assert Checkpoints.damage(path) == "rank-00000.safetensors is missing"
    with pytest.raises(CheckpointError, match="the state of rank 1 cannot be read"):
        Checkpoints.read_rank(path, 1)


# --------------------------------------------------------------------------- history
def test_history_is_stored_once_and_a_resume_reads_the_checkpoints_share(tmp_path, capsys):
    records = [{"epoch": i, "val_loss": 1.0 / i} for i in range(1, 6)]
    leader, other = HistoryFile(tmp_path, writer=True), HistoryFile(tmp_path, writer=False)
    file = tmp_path / "history.jsonl"

    def on_disk() -> list[dict]:
        return [json.loads(line) for line in file.read_text().splitlines()]

    assert leader.checkpoint(records[:2]) == {"history_entries": 2}
    assert other.checkpoint(records[:2]) == {"history_entries": 2}  # the leader alone writes
    assert leader.checkpoint(records[:2]) == {"history_entries": 2}
    assert leader.checkpoint(records) == {"history_entries": 5}
    assert on_disk() == records  # each record once
    # Resumed from the checkpoint that held 3 records: epochs 4 and 5 are trained again.
    resumed, reader = HistoryFile(tmp_path, writer=True), HistoryFile(tmp_path, writer=False)
    assert resumed.resume({"history_entries": 3}) == records[:3]
    assert on_disk() == records[:3]
    assert reader.resume({"history_entries": 3}) == records[:3]
    again = records[:3] + [{"epoch": 4, "val_loss": 0.2}]
    assert resumed.checkpoint(again) == {"history_entries": 4}
    assert on_disk() == again
    # A checkpoint from before history.jsonl holds its history itself.
    legacy = HistoryFile(tmp_path / "legacy", writer=True)
    (tmp_path / "legacy").mkdir()
    assert legacy.resume({"history": records[:2], "epoch": 2}) == records[:2]
    assert [json.loads(line) for line in (tmp_path / "legacy" / "history.jsonl").read_text().splitlines()] == records[
        :2
    ]
    # A damaged file: the records before the damage, and one warning.
    file.write_text(file.read_text()[:-40])  # into the third line
    capsys.readouterr()
    assert HistoryFile(tmp_path, writer=True).resume({"history_entries": 4}) == records[:2]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{file} holds 2 intact epoch records, the checkpoint includes 4" in err


# ----------------------------------------------------------------------------- stopping


def test_history_given_the_checkpoint_writer_is_on_disk_before_its_next_job(tmp_path):
    """The training loop hands the append and its fsync to the checkpoint's writer thread;
    the share and the commit it submits after it find the records on disk."""
    from nbdist.train.writer import CheckpointWriter

    records = [{"epoch": i, "val_loss": 1.0 / i} for i in range(1, 4)]
    history, writer = HistoryFile(tmp_path, writer=True), CheckpointWriter()
    seen: list[list[dict]] = []

    def read_then() -> None:  # what a commit submitted next would find
        seen.append([json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()])

    caller = threading.get_ident()
    appended_on: list[int] = []
    original = history._append
    history._append = lambda *args, **kwargs: (appended_on.append(threading.get_ident()), original(*args, **kwargs))
    for upto in (1, 3):
        assert history.checkpoint(records[:upto], writer) == {"history_entries": upto}
        writer.submit(read_then, name=f"epoch-{upto}")
    assert writer.finish() == ["epoch-1", "epoch-3"]
    assert seen == [records[:1], records]
    assert len(appended_on) == 2 and caller not in appended_on  # never on the training loop's thread


def test_patience_on_a_loss():
    early = EarlyStopping("val_loss", patience=2, min_delta=0.0, target=None)
    assert not early.maximize
    decisions = [early.update({"val_loss": v}).stop for v in (1.0, 0.9, 0.95, 0.85, 0.86, 0.9)]
    assert decisions == [False, False, False, False, False, True]
    assert early.best == 0.85
    last = early.update({"val_loss": 0.9})
    assert last.stop and "val_loss did not improve for 2" in last.reason


def test_min_delta_and_maximize():
    early = EarlyStopping("val_acc", patience=2, min_delta=0.01, target=None)
    assert early.maximize and early.best == -math.inf
    assert not early.update({"val_acc": 0.5}).stop
    assert not early.update({"val_acc": 0.505}).stop  # below min_delta: a bad round
    assert early.best == 0.5 and early.bad_rounds == 1
    assert not early.update({"val_acc": 0.52}).stop  # a real improvement resets
    assert early.bad_rounds == 0
    assert not early.update({"val_acc": 0.4}).stop
    assert early.update({"val_acc": 0.525}).stop
    assert EarlyStopping("val_auc", 1, 0.0, None).maximize
    assert not EarlyStopping("val_mse", 1, 0.0, None).maximize


def test_target_and_missing_monitor():
    early = EarlyStopping("val_loss", patience=None, min_delta=0.0, target=parse_target("val_acc >= 0.9"))
    for _ in range(5):
        assert not early.update({"val_loss": 1.0, "val_acc": 0.5}).stop  # no patience: never early-stops
    decision = early.update({"val_loss": 1.0, "val_acc": 0.9})
    assert decision.stop and decision.reason == "target val_acc >= 0.9 reached"
    silent = EarlyStopping("val_loss", patience=1, min_delta=0.0, target=None)
    for _ in range(3):
        assert not silent.update({"loss": 1.0}).stop  # monitor absent: no decision


def test_early_stopping_state_round_trip():
    early = EarlyStopping("val_loss", patience=3, min_delta=0.0, target=None)
    assert early.to_json() == {"best": None, "bad_rounds": 0}
    for v in (1.0, 0.5, 0.7):
        early.update({"val_loss": v})
    state = json.loads(json.dumps(early.to_json()))
    resumed = EarlyStopping("val_loss", patience=3, min_delta=0.0, target=None)
    resumed.load_json(state)
    assert (resumed.best, resumed.bad_rounds) == (0.5, 1)
    for v in (0.6, 0.6):
        assert early.update({"val_loss": v}).stop == resumed.update({"val_loss": v}).stop
    assert resumed.bad_rounds == 3
    fresh = EarlyStopping("val_acc", patience=1, min_delta=0.0, target=None)
    fresh.load_json({})
    assert fresh.best == -math.inf and fresh.bad_rounds == 0


def test_stop_flag_keeps_the_first_reason():
    flag = StopFlag()
    assert not flag.requested
    flag.request("stopped by SIGTERM")
    flag.request("later")
    assert flag.requested and flag.reason == "stopped by SIGTERM"


def test_a_stop_signals_handler_only_flags_and_the_forwarded_name_is_read_later(tmp_path, monkeypatch):
    """The handler can run in the middle of an import (a rank still starting): one that
    opened a file there (its codec's import) broke that import with a KeyError."""
    import builtins
    import signal
    from unittest import mock

    from nbdist.train.stopping import FORWARDED_SIGNAL_FILE

    forwarded = tmp_path / "signal"
    forwarded.write_text("SIGTERM")
    monkeypatch.setenv(FORWARDED_SIGNAL_FILE, str(forwarded))
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    flag = StopFlag()
    try:
        flag.install()
        handler = signal.getsignal(signal.SIGUSR1)
        with mock.patch.object(builtins, "open", side_effect=AssertionError("the handler opened a file")):
            handler(signal.SIGUSR1, None)
            handler(signal.SIGUSR1, None)
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
    assert flag.requested and flag.reason == "stopped by SIGTERM"  # the launcher's, not SIGUSR1


def test_training_resumes_exactly_from_a_checkpoint(tmp_path):
    """Weights, Adam state and rule state through safetensors: resuming == not stopping."""
    import copy

    import torch
    from torch import nn

    from nbdist.algorithms import ADAG
    from nbdist.backends.torch import TorchBackend
    from nbdist.specs import parse_spec

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    twin = copy.deepcopy(model)
    rng = np.random.default_rng(0)
    batches = [(rng.normal(size=(6, 4)).astype(np.float32), rng.integers(0, 2, size=6)) for _ in range(5)]
    algo = ADAG()

    def steps(backend, opt, state, some):
        for x, y in some:
            backend.compute_gradients(x, y)
            if algo.worker_step(state, backend.params, backend.grads, opt):
                out = np.empty_like(backend.params)
                algo.worker_message(state, backend.params, out)

    a = TorchBackend(model)
    opt_a = a.make_optimizer(parse_spec("adam(lr=0.01)"))
    state_a = algo.new_worker_state(a.num_params, 3)
    algo.worker_start(state_a, a.params)
    steps(a, opt_a, state_a, batches[:2])
    ckpt = Checkpoints(tmp_path)
    ckpt.write_rank(
        "epoch-0001",
        1,
        {"model": {"params": a.params, "state": a.state}, "opt": opt_a.state_arrays(), "rule": state_a.to_arrays()},
        {"step": 2},
    )
    ckpt.commit("epoch-0001", {})
    steps(a, opt_a, state_a, batches[2:])

    arrays, meta = Checkpoints.read_rank(ckpt.latest(), 1)
    assert meta == {"step": 2}
    assert arrays["opt"]["step"].shape == ()
    b = TorchBackend(twin)
    b.params[:] = arrays["model"]["params"]
    opt_b = b.make_optimizer(parse_spec("adam(lr=0.01)"))
    opt_b.load_state_arrays(arrays["opt"])
    state_b = algo.new_worker_state(b.num_params, 1)
    state_b.load_arrays(arrays["rule"])
    assert (state_b.count, state_b.sync_every) == (2, 3)
    steps(b, opt_b, state_b, batches[2:])
    np.testing.assert_array_equal(b.params, a.params)
    np.testing.assert_array_equal(state_b.pulled, state_a.pulled)
    assert state_b.count == state_a.count


def test_scalar_saved_with_shape_one_still_loads():
    state = EASGD().new_worker_state(2, 4)
    state.load_arrays({"count": np.array([3]), "sync_every": np.array(5)})
    assert (state.count, state.sync_every) == (3, 5) and type(state.count) is int


def test_the_writer_thread_writes_in_order_and_says_what_is_on_disk(tmp_path):
    """A master's shares and commits run on the writer's thread, in order: a share is
    reported written only after its files are there, and a commit after it finds them."""
    from nbdist.train.writer import CheckpointWriter

    cps, writer = Checkpoints(tmp_path), CheckpointWriter()
    params = np.arange(4, dtype=np.float32)
    for label in ("epoch-0001", "epoch-0002"):
        snapshot = {"model": {"params": params.copy()}}
        writer.submit(
            lambda label=label, snapshot=snapshot: cps.write_rank(label, 0, snapshot, {"rank": 0}), name=label
        )
        writer.submit(lambda label=label: cps.commit(label, {"label": label}))
        params += 10  # the master moves on: the writer has its copy
    assert writer.finish(timeout=60) == ["epoch-0001", "epoch-0002"]
    assert writer.written() == []
    assert cps.latest().name == "epoch-0002"
    arrays, _ = cps.read_rank(tmp_path / "checkpoints" / "epoch-0001", 0)
    assert arrays["model"]["params"].tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("errno_", "raised", "message"),
    [
        (5, "CheckpointWriteFailed", "writing checkpoint epoch-0003 failed: .*Input/output error"),
        # A full disk is the one line of train/diskspace.py, naming the directory and the job.
        (28, "DiskFull", "no space left on the device of .*committing checkpoint epoch-0003: .* is free"),
    ],
)
def test_a_failed_checkpoint_write_is_raised_in_the_master_naming_it_and_nothing_after_it_runs(
    tmp_path, errno_, raised, message
):
    import os

    from nbdist import errors
    from nbdist.train import writer as writer_module

    ran, writer = [], writer_module.CheckpointWriter()
    error = getattr(errors, raised, None) or getattr(writer_module, raised)

    def failing() -> None:
        raise OSError(errno_, os.strerror(errno_), str(tmp_path / "checkpoints" / "LATEST.json"))

    writer.submit(failing, name="epoch-0003")
    writer.submit(lambda: ran.append("commit"))
    with pytest.raises(error, match=message):
        writer.finish(timeout=60)
    assert ran == []
    with pytest.raises(error, match="epoch-0003"):
        writer.written()


def test_queued_writes_that_never_finish_end_the_wait_with_one_error(tmp_path):
    import threading

    from nbdist.train.writer import CheckpointWriteFailed, CheckpointWriter

    hung, writer = threading.Event(), CheckpointWriter()
    writer.submit(lambda: hung.wait(30), name="epoch-0001")
    try:
        with pytest.raises(CheckpointWriteFailed, match="did not finish within 0 s .*hung"):
            writer.finish(timeout=0.2)
    finally:
        hung.set()
    assert writer.finish(timeout=60) == ["epoch-0001"]


def test_a_commit_on_a_full_disk_names_the_checkpoint_directory_not_the_current_one(tmp_path, monkeypatch):
    """A write that finds the disk full raises from write() or fsync(), with no file name:
    the DiskFull must still say where: the checkpoints' directory, not the current one.
    /dev/full answers every write with ENOSPC; the commit's meta.json goes there through a
    link."""
    from nbdist.errors import DiskFull
    from nbdist.train.writer import CheckpointWriter

    cps, writer = Checkpoints(tmp_path / "run"), CheckpointWriter()
    cps.write_rank("epoch-0003", 0, {"model": {"params": np.arange(4, dtype=np.float32)}}, {"rank": 0})
    staged = next((tmp_path / "run" / "checkpoints").glob(".tmp-epoch-0003"))
    os.symlink("/dev/full", staged / "meta.json.tmp")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    writer.submit(lambda: cps.commit("epoch-0003", {"label": "epoch-0003"}))
    with pytest.raises(DiskFull) as raised:
        writer.finish(timeout=60)
    message = str(raised.value)
    # As a share's full disk is told (the end-to-end test in tests/test_bad_input.py reads it).
    assert message.startswith(f"no space left on the device of {staged.parent} for checkpoint epoch-0003 ("), message
    assert str(elsewhere) not in message


def test_a_durable_write_that_finds_the_disk_full_names_its_file(tmp_path):
    """write() and fsync() raise ENOSPC with no file name; nbdist.durable adds it, so that
    any write's DiskFull (train/diskspace.disk_full) says where, not the current directory."""
    import errno

    from nbdist.durable import write_bytes

    path = tmp_path / "meta.json.tmp"
    os.symlink("/dev/full", path)
    with pytest.raises(OSError) as raised:
        write_bytes(path, b"{}")
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(path)


def test_the_metric_log_and_the_history_that_find_the_disk_full_name_their_files(tmp_path):
    """The run's other writes go through an open file, whose write() and flush() name no
    file either: their ENOSPC names the log (or the history), so that the DiskFull of a run
    whose checkpoint filled the disk, and whose log then found it full, says where."""
    import errno

    from nbdist.metrics.log import RunLog, metrics_dir
    from nbdist.train.diskspace import disk_full
    from nbdist.train.history import HistoryFile

    log = RunLog(tmp_path, "full", 0, "worker")
    log_path = metrics_dir(tmp_path) / "rank-00000.jsonl"
    # The disk fills up after the log was opened (it reads its file first, which
    # /dev/full would answer with zeros for ever): its file now writes into /dev/full.
    log._file.close()
    log._file = open("/dev/full", "a")  # noqa: SIM115 - the log closes it
    log.emit("train", {"loss": 1.0})
    with pytest.raises(OSError) as raised:
        log.flush()
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(log_path)
    assert f"no space left on the device of {metrics_dir(tmp_path)} (writing rank-00000.jsonl" in str(
        disk_full(raised.value)
    )

    os.symlink("/dev/full", tmp_path / "history.jsonl")
    with pytest.raises(OSError) as raised:
        HistoryFile(tmp_path, writer=True).checkpoint([{"epoch": 1}])
    assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(tmp_path / "history.jsonl")
