"""Atomic checkpoints (write per rank, commit, LATEST) and the stopping decisions."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from nbdist.algorithms import EASGD, GEM
from nbdist.options import parse_target
from nbdist.train.checkpoint import CheckpointError, Checkpoints, flatten_arrays, unflatten_arrays
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
    assert Checkpoints.read_meta(final) == {"label": "epoch-0001", "version": 12}
    for rank in (0, 1):
        arrays, meta = Checkpoints.read_rank(final, rank)
        expected = rank_arrays(rank + len("epoch-0001"))
        expected["model"].pop("state")  # empty arrays: see below
        arrays["model"].pop("state", None)
        assert_same(expected, arrays)
        assert meta == {"rank": rank, "epoch": len("epoch-0001")}
    with pytest.raises(CheckpointError, match="no state for rank 2"):
        Checkpoints.read_rank(final, 2)


def test_empty_and_scalar_arrays_survive(tmp_path):
    ckpt = Checkpoints(tmp_path)
    arrays = {"model": {"params": np.arange(3, dtype=np.float32), "state": np.zeros(0, np.float32)},
              "opt": {}, "rule": EASGD().new_worker_state(3, 4).to_arrays()}
    ckpt.write_rank("a", 0, arrays, {})
    path = ckpt.commit("a", {})
    back, _ = Checkpoints.read_rank(path, 0)
    assert back["model"]["state"].shape == (0,)
    assert int(back["rule"]["sync_every"]) == 4
    restored = EASGD().new_worker_state(3, 1)
    restored.load_arrays(back["rule"])
    assert restored.sync_every == 4 and restored.count == 0


def test_rule_state_through_a_checkpoint(tmp_path):
    gem = GEM()
    state = gem.new_worker_state(6, 2)
    rng = np.random.default_rng(0)
    state.velocity[:] = rng.normal(size=6)
    state.previous_center[:] = rng.normal(size=6)
    state.count, state.pulls = 1, 7
    ckpt = Checkpoints(tmp_path)
    ckpt.write_rank("x", 3, {"rule": state.to_arrays()}, {})
    back, _ = Checkpoints.read_rank(ckpt.commit("x", {}), 3)
    restored = gem.new_worker_state(6, 2)
    restored.load_arrays(back["rule"])
    np.testing.assert_array_equal(restored.velocity, state.velocity)
    np.testing.assert_array_equal(restored.previous_center, state.previous_center)
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
    assert Checkpoints.read_meta(ckpt.latest()) == {"n": 2}
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


# ----------------------------------------------------------------------------- stopping
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
    ckpt.write_rank("epoch-0001", 1, {"model": {"params": a.params, "state": a.state},
                                      "opt": opt_a.state_arrays(), "rule": state_a.to_arrays()}, {"step": 2})
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
