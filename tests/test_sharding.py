"""ShardPlan: every sample once per epoch, equal batch counts, near-equal batch sizes."""

from __future__ import annotations

import numpy as np
import pytest

from nbdist.data.sharding import ShardPlan, split_evenly

CASES = [(100, 1, 32), (100, 4, 8), (101, 3, 10), (7, 7, 1), (10, 4, 32), (1000, 5, 33), (64, 2, 32)]


@pytest.mark.parametrize("n, shards, batch", CASES)
def test_every_sample_once_per_epoch_in_equal_batch_counts(n, shards, batch):
    plan = ShardPlan(n, shards, batch, seed=3)
    for epoch in (0, 1):
        per_shard = [plan.epoch(epoch, s) for s in range(shards)]
        counts = {len(b) for b in per_shard}
        assert counts == {plan.batches_per_epoch}
        everything = np.concatenate([b for batches in per_shard for b in batches])
        np.testing.assert_array_equal(np.sort(everything), np.arange(n))
        sizes = plan.step_sizes(epoch)
        assert sizes.shape == (plan.batches_per_epoch, shards)
        for step in range(plan.batches_per_epoch):
            at_step = [len(per_shard[s][step]) for s in range(shards)]
            assert max(at_step) - min(at_step) <= 1
            assert min(at_step) >= 1
            assert max(at_step) <= batch
            np.testing.assert_array_equal(sizes[step], at_step)
        assert sizes.sum() == n


def test_batches_per_epoch_is_the_fewest_that_respect_the_batch_size():
    assert ShardPlan(100, 4, 8).batches_per_epoch == 4  # 100 / 32 -> 4 steps of ~25
    assert ShardPlan(96, 4, 8).batches_per_epoch == 3
    assert ShardPlan(10, 4, 32).batches_per_epoch == 1


def test_epochs_differ_and_seeds_reproduce():
    plan = ShardPlan(200, 3, 16, seed=7)
    e0 = np.concatenate(plan.epoch(0, 0))
    e1 = np.concatenate(plan.epoch(1, 0))
    assert not np.array_equal(e0, e1)
    again = ShardPlan(200, 3, 16, seed=7)
    for epoch in (0, 1, 5):
        for shard in range(3):
            for a, b in zip(plan.epoch(epoch, shard), again.epoch(epoch, shard), strict=True):
                np.testing.assert_array_equal(a, b)
    other_seed = ShardPlan(200, 3, 16, seed=8)
    assert not np.array_equal(np.concatenate(other_seed.epoch(0, 0)), e0)
    # Shuffled, not the identity order.
    assert not np.array_equal(np.sort(e0), e0)


def test_shards_are_disjoint():
    plan = ShardPlan(50, 4, 4, seed=1)
    sets = [set(np.concatenate(plan.epoch(0, s)).tolist()) for s in range(4)]
    for i in range(4):
        for j in range(i + 1, 4):
            assert not sets[i] & sets[j]


@pytest.mark.parametrize("n, shards, batch", [(3, 4, 32), (0, 1, 8), (5, 6, 1)])
def test_too_few_samples_is_a_clear_error(n, shards, batch):
    with pytest.raises(ValueError, match=f"{n} training samples are too few for {shards} workers"):
        ShardPlan(n, shards, batch)


@pytest.mark.parametrize("shards, batch", [(0, 8), (-1, 8), (2, 0)])
def test_bad_shards_or_batch_size(shards, batch):
    with pytest.raises(ValueError, match="at least 1"):
        ShardPlan(10, shards, batch)


def test_split_evenly():
    idx = np.arange(10)
    parts = [split_evenly(idx, 3, p) for p in range(3)]
    assert [len(p) for p in parts] == [4, 3, 3]
    np.testing.assert_array_equal(np.concatenate(parts), idx)
