"""The study's coordinator without a cluster: trials that are calls of a function in this
process (nbdist.hpo.optimize), with the same runner, pruner, store and resume as a study
of trainings; and the pieces a trial is made of (its options, its folds)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from nbdist.errors import OptionsError
from nbdist.hpo.inprocess import optimize
from nbdist.hpo.runner import StudyError
from nbdist.hpo.schedulers import COMPLETE, STOPPED, Median, Setting
from nbdist.hpo.space_input import parse_space
from nbdist.hpo.trial import TrialError, fold_fom, fold_of_run, fold_split, run_name, trial_options, with_params
from nbdist.options import StudyOptions, TrainOptions
from nbdist.store import RunStore

QUIET = {"say": lambda line: None}


def test_parameters_set_the_options_they_name_and_the_optimiser_that_trains():
    base = TrainOptions(topology="allreduce", worker_optimizer="sgd(lr=0.1, momentum=0.9)")
    opts = trial_options(base, {"lr": 0.02, "batch_size": 64, "hidden": 16})
    assert opts.worker_optimizer == "sgd(lr=0.02, momentum=0.9)" and opts.batch_size == 64
    # Another optimiser keeps none of the old one's arguments.
    assert trial_options(base, {"optimizer": "adam"}).worker_optimizer == "adam()"
    assert trial_options(base, {"optimizer": "adam", "lr": 0.001}).worker_optimizer == "adam(lr=0.001)"
    # Downpour pushing every batch trains with the master's optimiser (default sgd(lr=0.1)).
    downpour = trial_options(TrainOptions(), {"lr": 0.3})
    assert downpour.master_optimizer == "sgd(lr=0.3)" and downpour.worker_optimizer is None
    # EASGD's workers train.
    assert trial_options(TrainOptions(algorithm="easgd"), {"optimizer": "rmsprop"}).worker_optimizer == "rmsprop()"


def test_lr_and_momentum_reach_the_part_that_trains_with_them():
    # GEM has no optimiser: its own lr and momentum, the rule's other arguments kept.
    gem = trial_options(TrainOptions(algorithm="gem(kappa=2.0)"), {"lr": 0.02, "momentum": 0.8})
    assert gem.algorithm == "gem(kappa=2.0, lr=0.02, momentum=0.8)"
    assert gem.worker_optimizer is None and gem.master_optimizer is None
    assert trial_options(TrainOptions(algorithm="gem"), {"lr": 0.01}).algorithm == "gem(lr=0.01)"
    with pytest.raises(TrialError, match="'optimizer' does not apply to gem.*lr and momentum"):
        trial_options(TrainOptions(algorithm="gem"), {"optimizer": "adam"})
    # The workers' optimiser for the rules whose workers train (the options' or the default).
    for rule in ("easgd", "adag", "dynsgd"):
        opts = trial_options(TrainOptions(algorithm=rule), {"lr": 0.03, "momentum": 0.5})
        assert opts.worker_optimizer == "sgd(lr=0.03, momentum=0.5)" and opts.algorithm == rule
    # Downpour pushing every batch: the master's (default plain sgd), its momentum too.
    downpour = trial_options(TrainOptions(), {"momentum": 0.9})
    assert downpour.master_optimizer == "sgd(lr=0.1, momentum=0.9)" and downpour.worker_optimizer is None
    local = trial_options(TrainOptions(sync_every=4), {"momentum": 0.9})
    assert local.worker_optimizer is not None and "momentum=0.9" in local.worker_optimizer
    assert local.master_optimizer is None
    # An optimiser without momentum: the trial's run fails at set-up with one error naming both.
    from torch import nn

    from nbdist.backends.torch import TorchBackend
    from nbdist.specs import SpecError, parse_spec

    adam = trial_options(TrainOptions(algorithm="easgd", worker_optimizer="adam(lr=0.001)"), {"momentum": 0.9})
    assert adam.worker_optimizer == "adam(lr=0.001, momentum=0.9)"
    with pytest.raises(SpecError, match="optimizer 'adam' takes no parameter 'momentum'"):
        TorchBackend(nn.Linear(2, 2)).make_optimizer(parse_spec(adam.worker_optimizer))


def test_builders_get_the_parameters_when_they_take_them():
    params = {"hidden": 7}
    assert with_params(lambda p: p["hidden"] * 2, params)() == 14
    assert with_params(lambda: "no params", params)() == "no params"
    assert with_params(None, params) is None


def test_folds_partition_the_training_set_stratified_and_the_same_every_time():
    from nbdist.datasets import digits

    data = digits()
    folds = [fold_split(data, f, 3, seed=5) for f in range(3)]
    val = np.concatenate([f.x_val for f in folds])
    # Every training sample validates in exactly one fold, and trains in the others.
    assert len(val) == data.n_train and len(np.unique(val, axis=0)) == len(np.unique(data.x_train, axis=0))
    for fold in folds:
        assert fold.n_train + fold.n_val == data.n_train
        assert set(np.unique(fold.y_val)) == set(range(10))  # stratified: every class in every fold
    again = fold_split(data, 1, 3, seed=5)
    np.testing.assert_array_equal(again.x_val, folds[1].x_val)
    assert fold_split(data, 0, 1, seed=5) is data  # one fold: the data as given


def test_figure_of_merit_and_run_names():
    assert fold_fom({"val_loss": 0.25, "val_acc": 0.9}, "val_loss") == 0.25
    with pytest.raises(
        TrialError,
        match=r"the objective 'val_auc' is not a metric of the runs \(they have: "
        r"val_acc, val_loss\)",
    ):
        fold_fom({"val_loss": 0.25, "val_acc": 0.9}, "val_auc")
    with pytest.raises(TrialError, match="is nan"):
        fold_fom({"val_loss": math.nan}, "val_loss")
    assert fold_of_run(run_name("20261123-bayes", 12, 3)) == (12, 3)
    assert fold_of_run(run_name("s", 2, 0) + "-2") == (2, 0)  # a trial trained again
    assert fold_of_run("20261123-allreduce-sgd") is None


def _median(maximize: bool = False, warmup_trials: int = 2) -> Median:
    median = Median(warmup_trials=warmup_trials)
    median.bind(Setting(epochs=5, groups=1, trials=10, space=parse_space("x=real(0,1)"), maximize=maximize))
    return median


def _finish(median: Median, number: int, curve: dict[int, float], outcome: str = COMPLETE) -> None:
    for epoch, value in curve.items():
        median.on_epoch(number, epoch, value)
    median.reached(number, max(curve), curve[max(curve)], outcome)


def test_the_median_pruner_compares_with_finished_trials_at_the_same_epoch():
    median = _median()
    assert not median.on_epoch(0, 1, 100.0)  # nobody to compare with yet
    _finish(median, 1, {1: 1.0, 2: 0.5})
    _finish(median, 2, {1: 3.0, 2: 2.5})
    _finish(median, 3, {1: 0.1}, STOPPED)  # a stopped trial's curve is no yardstick
    assert median.on_epoch(4, 1, 2.5).startswith("pruned: worse than the median of 2 finished trials at epoch 1")
    assert not median.on_epoch(5, 1, 1.5)
    assert not median.on_epoch(6, 3, 9.9)  # no finished trial reached epoch 3
    restored = _median()
    restored.load_state(median.state())
    assert restored.on_epoch(7, 2, 2.0) and not restored.on_epoch(8, 2, 1.0)
    assert not _median(maximize=True, warmup_trials=1).on_epoch(9, 0, 0.0)


def test_study_options_say_what_is_wrong():
    with pytest.raises(OptionsError, match="a study needs --space"):
        StudyOptions().validate()
    with pytest.raises(OptionsError, match="--groups must be at least 1"):
        StudyOptions(space="x=real(0,1)", groups=0).validate()
    with pytest.raises(OptionsError, match="cannot read --goal 'val_acc >> 1'"):  # a study's, not a run's --target
        StudyOptions(space="x=real(0,1)", goal="val_acc >> 1").validate()
    with pytest.raises(OptionsError, match="--goal 'val_acc > 1e': '1e' is not a number"):
        StudyOptions(space="x=real(0,1)", goal="val_acc > 1e").validate()
    assert StudyOptions(objective="val_acc").resolved_direction == "maximize"
    assert StudyOptions(objective="val_loss").resolved_direction == "minimize"


def test_a_study_of_a_function_finds_its_minimum_and_records_every_trial(tmp_path):
    store = str(tmp_path / "s.db")
    result = optimize(
        lambda p: (p["x"] - 2.0) ** 2 + (p["k"] != "b"),
        space="x=real(-5,5) k=cat(a,b,c)",
        searcher="random",
        trials=25,
        store=store,
        study_name="quadratic",
        **QUIET,
    )
    assert len(result.trials) == 25 and result.reason == "25 trials done"
    assert result.best_params["k"] == "b" and abs(result.best_params["x"] - 2.0) < 1.0
    with RunStore(store) as s:
        rows = s.trials("quadratic")
        assert [t.number for t in rows] == list(range(25)) and {t.state for t in rows} == {"complete"}
        assert min(t.fom for t in rows) == result.best_fom
        assert s.study("quadratic")["status"] == "completed"


def test_failed_trials_are_recorded_and_the_study_goes_on(tmp_path):
    def objective(p):
        if p["x"] > 0.5:
            raise ValueError("diverged")
        return p["x"]

    result = optimize(
        objective,
        space="x=real(0,1)",
        searcher="random",
        trials=12,
        store=str(tmp_path / "s.db"),
        study_name="f",
        **QUIET,
    )
    states = {r["state"] for r in result.trials}
    assert states == {"complete", "failed"} and len(result.trials) == 12
    failed = [r for r in result.trials if r["state"] == "failed"]
    assert all(r["error"] == "fold 0: ValueError: diverged" and r["fom"] is None for r in failed)
    assert result.best_fom <= 0.5


def test_the_pruner_stops_trials_that_fall_behind():
    # Learning curves: the better x, the lower the whole curve.
    curves = lambda p: [p["x"] + 1.0 / (e + 1) for e in range(6)]  # noqa: E731
    result = optimize(curves, space="x=real(0,1)", searcher="random", trials=20, prune=True, prune_warmup=3, **QUIET)
    pruned = [r for r in result.trials if r["state"] == "pruned"]
    complete = [r for r in result.trials if r["state"] == "complete"]
    assert pruned and complete
    # A pruned trial's figure of merit is where it was stopped: above its curve's end.
    assert all(r["fom"] > r["params"]["x"] + 1.0 / 6 for r in pruned)
    # The best trial ran to the end.
    assert result.best_fom == min(r["fom"] for r in complete)


def test_a_goal_ends_the_study_early():
    result = optimize(lambda p: p["x"], space="x=real(0,1)", searcher="random", trials=50, goal="fom < 0.2", **QUIET)
    assert result.reason == "goal fom < 0.2 reached" and len(result.trials) < 50
    assert result.trials[-1]["fom"] < 0.2


def test_an_interrupted_study_resumes_and_trains_only_what_did_not_finish(tmp_path):
    store = str(tmp_path / "s.db")
    calls: list[float] = []

    def interrupt_after_five(p):
        calls.append(p["x"])
        if len(calls) == 6:
            raise KeyboardInterrupt  # the kernel's interrupt, in the middle of trial 5
        return (p["x"] - 0.3) ** 2

    with pytest.raises(KeyboardInterrupt):
        optimize(
            interrupt_after_five,
            space="x=real(0,1)",
            searcher="bayes(initial_points=4)",
            trials=10,
            store=store,
            study_name="resumable",
            **QUIET,
        )
    with RunStore(store) as s:
        assert s.study("resumable")["status"] == "interrupted"
        assert [t.state for t in s.trials("resumable")] == ["complete"] * 5 + ["running"]
    interrupted = calls[-1]
    calls.clear()
    result = optimize(
        lambda p: calls.append(p["x"]) or (p["x"] - 0.3) ** 2,
        space="x=real(0,1)",
        searcher="bayes",
        trials=10,
        store=store,
        resume_study="resumable",
        **QUIET,
    )
    # The unfinished trial first, under its own number, then new ones up to the budget.
    assert calls[0] == interrupted and len(calls) == 5
    with RunStore(store) as s:
        rows = s.trials("resumable")
        assert [t.number for t in rows] == list(range(10)) and {t.state for t in rows} == {"complete"}
    assert len(result.trials) == 10
    with pytest.raises(StudyError, match="has a study named 'resumable' already"):
        optimize(lambda p: 0.0, space="x=real(0,1)", trials=1, store=store, study_name="resumable", **QUIET)


def test_what_pbt_may_change_during_a_run_and_a_rules_own_parameters():
    from nbdist.hpo.trial import changeable

    easgd = TrainOptions(algorithm="easgd")
    assert all(changeable(name, easgd) for name in ("lr", "momentum", "dropout", "head_dropout", "elastic_force"))
    assert not any(changeable(name, easgd) for name in ("hidden", "batch_size", "optimizer", "epochs"))
    assert not changeable("elastic_force", TrainOptions(algorithm="downpour"))
    assert trial_options(easgd, {"elastic_force": 0.3, "lr": 0.1}).algorithm == "easgd(elastic_force=0.3)"
