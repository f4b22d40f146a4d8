"""The master's momentum, or its lr per update, corrected for the momentum asynchrony adds
(train/asynchrony.py)."""

import pytest

from nbdist.algorithms import make_algorithm
from nbdist.errors import OptionsError
from nbdist.options import TrainOptions
from nbdist.specs import parse_spec
from nbdist.train.asynchrony import (
    corrected_momentum,
    implicit_momentum,
    optimisers_for_asynchrony,
    published_gem_warning,
    staleness_lr_factor,
    worker_momentum_warning,
)
from nbdist.train.context import DEFAULT_MASTER_OPTIMIZER, DEFAULT_WORKER_OPTIMIZER


def test_implicit_momentum_is_one_minus_one_over_workers():
    assert implicit_momentum(1) == 0.0
    assert implicit_momentum(4) == pytest.approx(0.75)
    assert implicit_momentum(16) == pytest.approx(0.9375)


def test_auto_lowers_the_master_momentum_by_the_implicit_one():
    spec = parse_spec("sgd(lr=0.05, momentum=0.9)")
    fixed = corrected_momentum(spec, 4, synchronous=False, correction="auto")
    assert fixed.spec.kwargs == {"lr": 0.05, "momentum": pytest.approx(0.15)}
    assert not fixed.warning
    assert "the master's momentum 0.9 is lowered to 0.15" in fixed.note
    assert "1 - 1/4 = 0.75" in fixed.note
    assert not fixed.stale_lr
    # The total never reaches 1: at 16 workers 0.9 - 0.9375 is clipped at 0, and the
    # excess goes to each update's lr, as for a master that never had a momentum.
    at16 = corrected_momentum(parse_spec("sgd(lr=0.05, momentum=0.9, nesterov=True)"), 16, False, "auto")
    assert at16.spec.kwargs["momentum"] == 0.0 and at16.spec.kwargs["nesterov"] is False
    assert at16.stale_lr and not at16.warning
    assert "more than the master's momentum 0.9: it is lowered to 0" in at16.note
    assert "the lr of each update is divided by 1 + its staleness" in at16.note
    # Below STALE_LR_FROM (8) workers a momentum lowered to 0 is all the correction there is,
    # as for a master that has none: 0.5 - 0.75 at 4 workers.
    at4 = corrected_momentum(parse_spec("sgd(lr=0.05, momentum=0.5)"), 4, False, "auto")
    assert at4.spec.kwargs["momentum"] == 0.0 and not at4.stale_lr
    assert "is lowered to 0 so that the total stays 0.75" in at4.note
    # At 8 workers 0.9 stays above the implicit 0.875: lowered to 0.025, the lr kept.
    at8 = corrected_momentum(parse_spec("sgd(lr=0.05, momentum=0.9)"), 8, False, "auto")
    assert at8.spec.kwargs["momentum"] == pytest.approx(0.025) and not at8.stale_lr


@pytest.mark.parametrize(
    "workers, synchronous, text",
    [
        (1, False, "sgd(lr=0.05, momentum=0.9)"),  # one worker: no asynchrony
        (8, True, "sgd(lr=0.05, momentum=0.9)"),  # synchronous rounds: every update from the current centre
        (1, False, "sgd(lr=0.1)"),
        (8, True, "sgd(lr=0.1)"),
        (7, False, "sgd(lr=0.1)"),  # a master without momentum: corrected from STALE_LR_FROM = 8 workers
    ],
)
def test_nothing_to_correct(workers, synchronous, text):
    spec = parse_spec(text)
    kept = corrected_momentum(spec, workers, synchronous, "auto")
    assert kept.spec == spec and kept.note == "" and not kept.stale_lr


@pytest.mark.parametrize("text", ["sgd(lr=0.1)", "sgd(lr=0.1, momentum=0)", "adam(lr=0.001)"])
def test_a_master_without_momentum_divides_each_updates_lr_by_one_plus_its_staleness(text):
    spec = parse_spec(text)
    fixed = corrected_momentum(spec, 8, synchronous=False, correction="auto")
    assert fixed.spec == spec and fixed.stale_lr and not fixed.warning
    assert "has no momentum to lower: the lr of each update is divided by 1 + its staleness" in fixed.note
    assert "1 - 1/8 = 0.88" in fixed.note and "Zhang et al. 2016" in fixed.note
    # The early swings Downpour was seen to make with it, the rules that did not, and where
    # the runs that showed it are.
    assert "may fall back to chance once or twice early on, then learn on" in fixed.note
    assert "gem, adag and easgd did not" in fixed.note
    assert "bench/results/2026-11-26-convergence.md" in fixed.note
    # As given, the lr is kept, and the run is warned: that set-up collapsed on jets.
    off = corrected_momentum(spec, 8, synchronous=False, correction="off")
    assert off.spec == spec and not off.stale_lr and off.warning
    assert "is not divided by the updates' staleness" in off.note
    assert "collapsed or never learned on jet images at 8 and 16 workers" in off.note
    assert "(bench/results/2026-11-25-convergence.md)" in off.note
    assert "drop --momentum-correction off" in off.note and "--algorithm gem" in off.note
    # Below STALE_LR_FROM workers there is nothing to say either way.
    assert corrected_momentum(spec, 7, synchronous=False, correction="off").note == ""


def test_the_staleness_lr_factor_is_one_over_one_plus_staleness():
    # Zhang et al. 2016 / Jiang et al. 2017: lr / (1 + staleness); a fresh update keeps it all.
    assert [staleness_lr_factor(s) for s in (0, 1, 3, 7, 15)] == [1.0, 1 / 2, 1 / 4, 1 / 8, 1 / 16]
    # At the queue model's mean staleness W - 1 it is 1 - (1 - 1/W): the implicit momentum cancelled.
    for workers in (2, 4, 8, 16):
        assert staleness_lr_factor(workers - 1) == pytest.approx(1.0 - implicit_momentum(workers))


def test_the_run_is_told_which_correction_its_master_gets():
    downpour = make_algorithm(parse_spec("downpour"))
    plain = optimisers_for_asynchrony(downpour, parse_spec(DEFAULT_MASTER_OPTIMIZER), None, 8, False, "auto")
    assert plain.optimizer == parse_spec(DEFAULT_MASTER_OPTIMIZER) and plain.stale_lr
    assert [n.warning for n in plain.notices] == [False]
    heavy = optimisers_for_asynchrony(downpour, parse_spec("sgd(lr=0.05, momentum=0.9)"), None, 4, False, "auto")
    assert heavy.optimizer.kwargs["momentum"] == pytest.approx(0.15) and not heavy.stale_lr
    # GEM has no master optimiser to correct (its updates' discount: the test below).
    gem = optimisers_for_asynchrony(make_algorithm(parse_spec("gem")), None, None, 4, False, "auto")
    assert (gem.optimizer, gem.stale_lr, gem.notices) == (None, False, [])


def test_off_keeps_the_momentum_and_warns_when_the_total_reaches_one():
    spec = parse_spec("sgd(lr=0.05, momentum=0.9)")
    kept = corrected_momentum(spec, 8, False, "off")
    assert kept.spec == spec and kept.warning
    assert "the master's momentum 0.9 the total 1.77 is 1 or more" in kept.note
    assert "diverges" in kept.note and "--algorithm gem" in kept.note
    quiet = corrected_momentum(parse_spec("sgd(lr=0.05, momentum=0.2)"), 4, False, "off")  # 0.2 + 0.75 < 1
    assert quiet.note == "" and not quiet.warning


def test_an_unknown_correction_is_one_error_with_the_choices():
    with pytest.raises(OptionsError, match="unknown --momentum-correction 'yes'; choose one of: auto, off"):
        TrainOptions(momentum_correction="yes").validate()


def test_many_adag_workers_with_momentum_get_a_warning_that_says_what_to_use():
    takes = {
        name: make_algorithm(parse_spec(name)).centre_takes_worker_steps
        for name in ("adag", "dynsgd", "easgd", "gem", "downpour")
    }
    assert takes == {"adag": True, "dynsgd": False, "easgd": False, "gem": False, "downpour": False}
    default = parse_spec(DEFAULT_WORKER_OPTIMIZER)
    text = worker_momentum_warning("adag", default, 8, synchronous=False)
    assert "the centre can collapse" in text and "momentum below 0.12" in text
    assert "ADAG at 8 workers did on jet images: bench/results/2026-11-24-convergence.md" in text
    assert "--worker-optimizer 'sgd(lr=0.05, momentum=0.062)'" in text and "--algorithm dynsgd" in text
    assert "drop --momentum-correction off (the default discounts adag's stale updates" in text
    assert worker_momentum_warning("adag", default, 4, False) == ""  # not seen to collapse at 4
    assert worker_momentum_warning("adag", default, 8, True) == ""  # synchronous rounds
    assert worker_momentum_warning("adag", parse_spec("sgd(lr=0.1, momentum=0.1)"), 8, False) == ""


def test_adag_updates_get_the_staleness_discount_by_default_and_as_published_when_off():
    adag, default = make_algorithm(parse_spec("adag")), parse_spec(DEFAULT_WORKER_OPTIMIZER)
    auto = optimisers_for_asynchrony(adag, None, default, 8, False, "auto")
    assert auto.stale_updates and not auto.stale_lr and auto.optimizer is None
    [note] = auto.notices
    assert not note.warning and "1 - 1/8 = 0.88" in note.text
    assert "each update is scaled by 1 / (1 + its staleness) before it is added" in note.text
    assert "DynSGD's discount, Jiang et al. 2017" in note.text and "--momentum-correction off" in note.text
    # Off: ADAG as published, and the warning for its workers' momentum at 8 workers.
    off = optimisers_for_asynchrony(adag, None, default, 8, False, "off")
    assert not off.stale_updates and [n.warning for n in off.notices] == [True]
    # Nothing stale to discount: synchronous rounds, one worker; below 8 workers ADAG is as
    # published (the discount slowed it on digits at 4); DynSGD discounts anyway.
    for workers, synchronous in ((8, True), (1, False), (4, False), (7, False)):
        assert not optimisers_for_asynchrony(adag, None, default, workers, synchronous, "auto").stale_updates
    dynsgd = optimisers_for_asynchrony(make_algorithm(parse_spec("dynsgd")), None, default, 8, False, "auto")
    assert (dynsgd.stale_updates, dynsgd.notices) == (False, [])


def test_gem_updates_get_the_staleness_discount_from_8_workers_and_a_warning_as_published_at_16():
    gem = make_algorithm(parse_spec("gem"))
    auto = optimisers_for_asynchrony(gem, None, None, 8, False, "auto")
    assert auto.stale_updates and not auto.stale_lr and auto.optimizer is None
    [note] = auto.notices
    assert not note.warning and "gem's master adds the workers' updates" in note.text
    assert "each update is scaled by 1 / (1 + its staleness)" in note.text
    for workers, synchronous in ((8, True), (1, False), (7, False)):
        assert not optimisers_for_asynchrony(gem, None, None, workers, synchronous, "auto").stale_updates
    # As published: nothing below 16 workers, a warning that says what to do from 16.
    assert optimisers_for_asynchrony(gem, None, None, 8, False, "off").notices == []
    off = optimisers_for_asynchrony(gem, None, None, 16, False, "off")
    assert not off.stale_updates
    [warning] = off.notices
    assert warning.warning and "at 16 workers on jet images it collapsed" in warning.text
    assert "(bench/results/2026-11-25-convergence.md)" in warning.text
    assert "drop --momentum-correction off" in warning.text and "--synchronous" in warning.text
    assert published_gem_warning(gem, 16, True, "off") == ""
    assert published_gem_warning(make_algorithm(parse_spec("easgd")), 16, False, "off") == ""


def bound(text: str, workers: int):
    rule = make_algorithm(parse_spec(text))
    rule.bind(workers)  # as the run does, before the correction (train/settle.py)
    return rule


@pytest.mark.parametrize(
    ("text", "workers", "lowered"),
    [
        ("diloco", 8, 0.9 - 0.875),  # updated every arrival: 1 - 1/8
        ("diloco", 2, 0.9 - 0.5),
        ("diloco", 16, 0.0),  # 0.9375 exceeds it
        ("async_local_sgd", 8, 0.9 - (7 / 8) ** 8),  # updated once every 8 arrivals
        ("async_local_sgd", 16, 0.9 - (15 / 16) ** 16),
        ("async_local_sgd(activation=2)", 8, 0.9 - (7 / 8) ** 2),
    ],
)
def test_an_asynchronous_outer_momentum_is_lowered_by_the_implicit_one_over_its_own_steps(text, workers, lowered):
    rule = bound(text, workers)
    fixed = optimisers_for_asynchrony(rule, None, None, workers, False, "auto")
    assert fixed.optimizer is None and not fixed.stale_lr and not fixed.stale_updates
    [note] = fixed.notices
    assert rule.outer_momentum()[0] == pytest.approx(lowered, abs=1e-6)
    assert float(rule.mu) == pytest.approx(lowered, abs=1e-6)  # what the outer step multiplies by
    assert f"outer momentum 0.9 is lowered to {lowered:.3g};" in note.text and not note.warning
    assert f"{rule.name}(" in repr(rule) and f"outer_momentum={round(lowered, 6)!r}" in repr(rule)
    assert "--momentum-correction off keeps it as given" in note.text


@pytest.mark.parametrize(("workers", "synchronous"), [(8, True), (1, False)])
def test_a_synchronous_or_single_worker_outer_momentum_is_kept(workers, synchronous):
    for text in ("diloco", "async_local_sgd"):
        rule = bound(text, workers)
        assert optimisers_for_asynchrony(rule, None, None, workers, synchronous, "auto").notices == []
        assert rule.outer_momentum()[0] == pytest.approx(0.9)


def test_rules_without_an_outer_momentum_have_none_to_lower():
    assert bound("easgd", 8).outer_momentum() is None and bound("eamsgd", 8).outer_momentum() is None
    with pytest.raises(TypeError, match="easgd keeps no outer momentum"):
        bound("easgd", 8).set_outer_momentum(0.5)


def test_off_keeps_the_outer_momentum_and_warns_when_the_total_reaches_one():
    rule = bound("diloco", 8)
    [warning] = optimisers_for_asynchrony(rule, None, None, 8, False, "off").notices
    assert rule.outer_momentum()[0] == pytest.approx(0.9)
    assert warning.warning and "diloco's outer momentum 0.9 the total 1.77 is 1 or more" in warning.text
    assert "fell back to chance on jet images at 8 and 16 workers" in warning.text
    assert "outer_momentum below 0.12" in warning.text and "--synchronous" in warning.text
    small = bound("diloco(outer_momentum=0.1)", 8)  # 0.1 + 0.875 < 1
    assert optimisers_for_asynchrony(small, None, None, 8, False, "off").notices == []
