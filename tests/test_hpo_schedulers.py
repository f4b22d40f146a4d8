"""Schedulers and per-epoch objectives in process (nbdist.hpo.optimize): a stopped trial
really stops, right after the epoch it was judged on, and is recorded and told to the
searcher as stopped; ASHA resumes a promoted trial where it paused; budgets end a study;
the scheduler's own decisions (rungs, Hyperband's brackets, PBT's exploits) on their own."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from nbdist.hpo import SCHEDULERS, SchedulerError, TrialStopped, optimize
from nbdist.hpo.schedulers import ASHA, PAUSED, PBT, Hyperband, Setting, explore, rungs
from nbdist.hpo.space_input import parse_space
from nbdist.store import RunStore

QUIET = {"say": lambda _line: None}
# ASHA over rungs 1, 3 and 9 epochs on _curve's one parameter, random proposals.
ASHA_1_3_9 = {"space": "x=real(0,1)", "searcher": "random", "scheduler": "asha(min_epochs=1, reduction=3)", "epochs": 9}


def _curve(p, epoch):
    """A learning curve: the smaller x, the lower every epoch; falls with the epochs."""
    return p["x"] + 1.0 / epoch


def test_a_pruned_generator_stops_right_after_the_epoch_it_was_judged_on(tmp_path):
    computed: Counter = Counter()

    def objective(p):
        for epoch in range(1, 9):
            computed[p["x"]] += 1
            yield _curve(p, epoch)

    store = str(tmp_path / "s.db")
    result = optimize(
        objective, space="x=real(0,1)", searcher="random", trials=16, prune=True, store=store, study_name="g", **QUIET
    )
    pruned = [r for r in result.trials if r["state"] == "pruned"]
    assert pruned and any(r["state"] == "complete" for r in result.trials)
    for row in pruned:
        # Its epochs are those computed: not one more after the pruner's decision.
        assert computed[row["params"]["x"]] == row["epochs"] < 8
        assert row["fom"] == pytest.approx(_curve(row["params"], row["epochs"]))
    with RunStore(store) as s:
        rows = {t.number: t for t in s.trials("g")}
        state = s.study("g")["searcher_state"]["searcher"]
        events = s.trial_events("g", kind="pruned")
    assert {e["number"] for e in events} == {r["number"] for r in pruned}
    assert all(rows[r["number"]].epochs == r["epochs"] for r in pruned)
    # The searcher was told each pruned trial as stopped after its epochs, not as finished.
    assert sorted(state["stopped"].values()) == sorted(r["epochs"] for r in pruned)


def test_a_reporting_objective_is_stopped_by_its_report_call():
    seen: list[tuple[float, int]] = []
    stopped: list[float] = []

    def objective(p, report):
        try:
            for epoch in range(1, 7):
                seen.append((p["x"], epoch))
                report(epoch, _curve(p, epoch))
        except TrialStopped:
            stopped.append(p["x"])
            raise
        return _curve(p, 6)

    result = optimize(objective, space="x=real(0,1)", searcher="random", trials=12, prune=True, **QUIET)
    pruned = [r for r in result.trials if r["state"] == "pruned"]
    assert pruned and sorted(stopped) == sorted(r["params"]["x"] for r in pruned)
    for row in pruned:
        assert max(e for x, e in seen if x == row["params"]["x"]) == row["epochs"]
    complete = [r for r in result.trials if r["state"] == "complete"]
    assert all(r["epochs"] == 6 for r in complete)


def test_the_direction_follows_the_objective_name_as_on_the_command_line():
    result = optimize(
        lambda p: p["x"], space="x=real(0,1)", searcher="random", trials=8, objective_name="val_acc", **QUIET
    )
    assert result.best_fom == max(r["fom"] for r in result.trials)
    result = optimize(lambda p: p["x"], space="x=real(0,1)", searcher="random", trials=8, **QUIET)
    assert result.best_fom == min(r["fom"] for r in result.trials)


def test_asha_resumes_a_promoted_trial_where_it_paused(tmp_path):
    opened: Counter = Counter()
    computed: Counter = Counter()

    def objective(p):
        opened[p["x"]] += 1
        for epoch in range(1, 10):
            computed[(p["x"], epoch)] += 1
            yield _curve(p, epoch)

    store = str(tmp_path / "s.db")
    result = optimize(objective, **ASHA_1_3_9, trials=18, store=store, study_name="asha", **QUIET)
    # No trial was started twice, and no epoch of any trial computed twice.
    assert set(opened.values()) == {1} and set(computed.values()) == {1}
    by_state = Counter(r["state"] for r in result.trials)
    assert by_state["complete"] >= 1 and by_state["stopped"] >= 1 and len(result.trials) == 18
    assert {r["epochs"] for r in result.trials} <= {1, 3, 9}
    with RunStore(store) as s:
        promoted = s.trial_events("asha", kind="promoted")
        paused = s.trial_events("asha", kind="paused")
    assert promoted and {e["epoch"] for e in promoted} <= {1, 3}
    # Each promoted trial paused at the rung it was promoted from, with its value there.
    pauses = {(e["number"], e["epoch"]) for e in paused}
    assert all((e["number"], e["epoch"]) in pauses for e in promoted)
    complete = [r for r in result.trials if r["state"] == "complete"]
    assert all(r["epochs"] == 9 for r in complete)
    # The best trial trained to the end is among the best at the first rung.
    assert result.best_fom == min(r["fom"] for r in complete)


def test_a_study_whose_trials_were_all_cut_short_names_the_one_taken_furthest():
    """Too few trials for ASHA to promote any to its last rung: no trial completes, so no
    best; the result names the trial trained the most epochs, the best of those."""

    def objective(p):
        for epoch in range(1, 10):
            yield _curve(p, epoch)

    result = optimize(objective, **ASHA_1_3_9, trials=5, seed=3, **QUIET)
    assert result.best_fom is None and result.best_params is None
    assert all(r["state"] == "stopped" for r in result.trials)
    deepest = max(r["epochs"] for r in result.trials)
    assert deepest == 3  # promoted once, never to the last rung
    furthest = result.furthest
    assert furthest["epochs"] == deepest
    assert furthest["fom"] == min(r["fom"] for r in result.trials if r["epochs"] == deepest)
    assert f"none complete, furthest trial {furthest['number']}" in repr(result)
    # What the command line prints in place of a best.
    from nbdist.cli.commands import furthest_line

    said = furthest_line(furthest, "val_loss", 9)
    assert said.startswith("nbdist: no trial trained all 9 epochs (the scheduler cut each short); the furthest: ")
    assert f"trial {furthest['number']}, val_loss {furthest['fom']:.4f} after 3 epochs with {{'x': " in said


def test_asha_with_too_few_trials_for_its_last_rung_says_so_before_it_runs():
    """Of n trials, n // 3^k reach rung k: rungs 1, 3, 9 need 9 trials for one to train
    all 9 epochs. With 5, the study says so and how to fix it, and indeed none completes."""
    lines: list[str] = []
    result = optimize(lambda p: (_curve(p, e) for e in range(1, 10)), **ASHA_1_3_9, trials=5, say=lines.append)
    note = lines[0]  # before any trial trains
    assert note.startswith("nbdist: note: asha(min_epochs=1, reduction=3) over rungs 1, 3, 9 with 5 trials: none can ")
    assert "the last needs 9 trials); give --trials 9, or fewer rungs: asha(min_epochs=3)" in note
    assert not any(r["state"] == "complete" for r in result.trials)
    # The remedies it names: 9 trials, or rungs 3 and 9 (3 trials enough), each completes a trial.
    for changes in ({"trials": 9}, {"trials": 5, "scheduler": "asha(min_epochs=3, reduction=3)"}):
        lines.clear()
        study = {**ASHA_1_3_9, **changes}
        result = optimize(lambda p: (_curve(p, e) for e in range(1, 10)), **study, say=lines.append)
        assert not any("note:" in line for line in lines), changes
        assert any(r["state"] == "complete" and r["epochs"] == 9 for r in result.trials), changes


def test_hyperband_with_too_few_trials_for_any_bracket_says_how_many_it_needs():
    """Over 27 epochs Hyperband's brackets start at 1, 3, 9 and 27 epochs; its plan sends the
    first trials to the cheap brackets, so 6 trials are the fewest that complete one."""

    def run(trials):
        lines: list[str] = []
        study = {**ASHA_1_3_9, "scheduler": "hyperband(min_epochs=1, reduction=3)", "epochs": 27}
        result = optimize(lambda p: (_curve(p, e) for e in range(1, 28)), **study, trials=trials, say=lines.append)
        return [line for line in lines if "note:" in line], [r for r in result.trials if r["state"] == "complete"]

    notes, complete = run(5)
    assert notes == [
        "nbdist: note: hyperband(min_epochs=1, reduction=3) with 5 trials: no bracket gets enough of them for one "
        "to reach its last rung, so no trial will train all 27 epochs; give --trials 6"
    ]
    assert complete == []
    notes, complete = run(6)
    assert notes == [] and [r["epochs"] for r in complete] == [27]


def test_a_median_pruner_that_cannot_save_an_epoch_says_why():
    """It waits for 3 finished trials: a study of 3 trains each to the end, and says so."""

    def run(trials, **changes):
        lines: list[str] = []
        result = optimize(
            lambda p: (_curve(p, e) for e in range(1, 6)),
            space="x=real(0,1)",
            searcher="random",
            epochs=5,
            trials=trials,
            say=lines.append,
            **changes,
        )
        return [line for line in lines if "note:" in line], {r["state"] for r in result.trials}

    notes, states = run(3, prune=True)
    assert notes == [
        "nbdist: note: median(warmup_trials=3, warmup_epochs=1) will save no epoch: it stops none before 3 trials "
        "have finished and the study has 3: give --trials 4 or more, or a lower warmup_trials (--prune-warmup)"
    ]
    assert states == {"complete"}
    notes, _ = run(12, scheduler="median(warmup_epochs=5)")
    assert notes == [
        "nbdist: note: median(warmup_trials=3, warmup_epochs=5) will save no epoch: it judges a trial after its "
        "epoch 5 and trials train 5: give warmup_epochs below 5"
    ]
    notes, states = run(12, prune=True)
    assert notes == [] and "pruned" in states


def test_a_budget_of_epochs_ends_the_study():
    computed = []

    def objective(p):
        for epoch in range(1, 6):
            computed.append(epoch)
            yield _curve(p, epoch)

    result = optimize(objective, space="x=real(0,1)", searcher="random", trials=50, epochs=5, budget_epochs=23, **QUIET)
    assert len(computed) <= 23 and len(result.trials) == 4
    assert result.reason == "the budget of 23 epochs is spent (20 trained)"


def test_a_budget_of_time_stops_the_running_trial_and_ends_the_study():
    import time

    def objective(p):
        for epoch in range(1, 1000):
            time.sleep(0.01)
            yield _curve(p, epoch)

    result = optimize(objective, space="x=real(0,1)", searcher="random", trials=50, budget_time=0.5, **QUIET)
    assert result.reason == "the time budget of 0.5 s is spent"
    last = result.trials[-1]
    assert last["state"] == "stopped" and 0 < last["epochs"] < 999


def test_an_evolution_too_large_for_its_trials_says_so():
    lines: list[str] = []
    optimize(lambda p: p["x"], space="x=real(0,1)", searcher="evolution", trials=15, say=lines.append)
    note = next(line for line in lines if "note:" in line)
    assert "evolution(population=10) with 15 trials is one random generation and 5 bred points" in note
    lines.clear()
    optimize(lambda p: p["x"], space="x=real(0,1)", searcher="evolution(population=5)", trials=15, say=lines.append)
    assert not any("note:" in line for line in lines)


# ----------------------------------------------------------------------------- on their own
def _setting(**changes) -> Setting:
    values = {"epochs": 27, "groups": 4, "trials": 20, "space": parse_space("lr=log(1e-3,1)"), "maximize": False}
    return Setting(**{**values, **changes})


def test_asha_rungs_and_promotions():
    assert rungs(1, 27, 3) == [1, 3, 9, 27] and rungs(2, 10, 3) == [2, 6, 10]
    asha = ASHA(min_epochs=1, reduction=3)
    asha.bind(_setting())
    assert asha.next(True, math.inf).pause_at == 1
    for number, value in enumerate([0.5, 0.2, 0.9]):
        asha.reached(number, 1, value, PAUSED)
    work = asha.next(True, math.inf)
    assert (work.trial, work.pause_at) == (1, 3)  # the best third of rung 0 goes on to rung 1
    assert asha.next(True, math.inf).trial is None  # nothing more to promote: a new trial
    assert asha.next(True, 1).trial is None and asha.next(False, math.inf) is None
    restored = ASHA(min_epochs=1, reduction=3)
    restored.bind(_setting())
    restored.load_state(asha.state())
    assert restored.state() == asha.state()


def test_hyperband_spreads_new_trials_over_its_brackets():
    hyperband = Hyperband(min_epochs=1, reduction=3)
    hyperband.bind(_setting())
    firsts = Counter()
    for number in range(40):
        work = hyperband.next(True, math.inf)
        hyperband.started(number, work)
        firsts[work.pause_at] += 1
    # Most trials start at the cheapest rung, a few are trained to the end from the start.
    assert firsts[1] > firsts[3] > firsts[9] > 0 and firsts[None] > 0


def test_pbt_replaces_the_bottom_with_the_top_and_moves_their_parameters():
    pbt = PBT(interval=2, quantile=0.25)
    pbt.bind(_setting(epochs=6, changeable=lambda name: True))
    for number in range(4):
        work = pbt.next(True, math.inf)
        assert work.trial is None and work.pause_at == 2
        pbt.started(number, work)
    assert pbt.next(True, math.inf) is None  # the population is out training
    for number, value in enumerate([0.4, 0.1, 0.3, 0.9]):
        pbt.reached(number, 2, value, PAUSED)
    works = [pbt.next(False, math.inf) for _ in range(4)]
    assert [w.trial for w in works] == [0, 1, 2, 3] and all(w.pause_at == 4 for w in works)
    receiver = works[3]  # the worst takes the best's state
    assert receiver.exchange.source == 1 and receiver.exchange.epoch == 2 and works[1].send_to == [3]
    moved = pbt.params_for(receiver, {"lr": 0.01})
    assert moved != {"lr": 0.01} and 1e-3 <= moved["lr"] <= 1
    assert pbt.params_for(receiver, {"lr": 0.01}) == moved  # the same again after a resume
    rng_moves = [explore({"lr": 0.01}, parse_space("lr=log(1e-3,1)"), 0.2, 0.0, _rng(i))["lr"] for i in range(20)]
    assert set(round(v, 6) for v in rng_moves) == {0.012, 0.008}


def _rng(i):
    import numpy as np

    return np.random.default_rng(i)


@pytest.mark.parametrize(
    ("spec", "setting", "message"),
    [
        ("asha(min_epochs=9, max_epochs=9)", {}, r"asha\(min_epochs=9\) leaves no rung below max_epochs=9"),
        ("asha(max_epochs=30)", {}, r"the trials train at most --epochs 27; give max_epochs <= 27"),
        ("pbt(quantile=0.25)", {"groups": 2}, r"it needs at least 4 groups, this study has 2"),
        (
            "pbt",
            {"changeable": lambda name: name == "lr", "space": parse_space("lr=log(1e-3,1) hidden=int(8,64)")},
            r"'hidden' cannot change once a run has started",
        ),
        ("pbt", {"in_process": True, "changeable": lambda n: True}, r"run the study on ranks"),
        ("asha", {"objectives": 2}, r"--scheduler asha ranks trials by one value"),
    ],
)
def test_schedulers_refuse_what_cannot_fit_with_one_clear_error(spec, setting, message):
    scheduler = SCHEDULERS.build(spec)
    with pytest.raises(SchedulerError, match=message):
        scheduler.bind(_setting(**setting))


def test_an_unknown_scheduler_names_the_valid_ones():
    from nbdist.specs import SpecError

    with pytest.raises(SpecError, match=r"unknown scheduler 'ashaa'.*asha"):
        SCHEDULERS.build("ashaa")
    with pytest.raises(Exception, match=r"unknown scheduler 'sha'"):
        optimize(lambda p: p["x"], space="x=real(0,1)", scheduler="sha", **QUIET)


def test_a_multi_objective_study_reports_its_pareto_front(tmp_path):
    # Accuracy grows with the size, which costs: every size is a different trade-off,
    # except where a size buys no accuracy (x above 0.6 here).
    def objective(p):
        size = p["x"]
        return {"acc": min(size, 0.6), "size": size}

    store = str(tmp_path / "s.db")
    result = optimize(
        objective,
        space="x=real(0,1)",
        searcher="random",
        trials=20,
        objective_name="acc,size",
        store=store,
        study_name="mo",
        **QUIET,
    )
    assert result.pareto and all(r["values"] == [min(r["params"]["x"], 0.6), r["params"]["x"]] for r in result.trials)
    front = {r["number"] for r in result.pareto}
    best_acc = max(r["values"][0] for r in result.trials)
    for r in result.trials:
        acc, size = r["values"]
        dominated = any(
            o["values"][0] >= acc and o["values"][1] <= size and o["values"] != r["values"] for o in result.trials
        )
        assert (r["number"] in front) == (not dominated)
    assert sum(1 for r in result.pareto if r["values"][0] == best_acc) == 1  # only the smallest of those at 0.6
    with RunStore(store) as s:
        assert {t.number: t.values for t in s.trials("mo")} == {r["number"]: r["values"] for r in result.trials}
        assert s.study("mo")["direction"] == "maximize,minimize"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"direction": "maximize"},
            r"--direction 'maximize' gives 1 direction for 2 objectives \(acc, size\): give "
            r"one per objective, e\.g\. --direction maximize,minimize",
        ),
        (
            {"searcher": "bayes"},
            r"searcher bayes optimises one objective; a study of 2 \(acc, size\) needs one that "
            r"takes several: random, grid or optuna",
        ),
        ({"scheduler": "median"}, r"--scheduler median ranks trials by one value"),
    ],
)
def test_a_multi_objective_study_refuses_what_does_not_fit(kwargs, message):
    from nbdist.errors import UserError

    settings = {"searcher": "random", "objective_name": "acc,size", **kwargs}
    with pytest.raises(UserError, match=message):
        optimize(lambda p: (p["x"], p["x"]), space="x=real(0,1)", trials=2, **settings, **QUIET)


def test_an_optuna_tpe_study_resumes_from_the_store(tmp_path):
    from nbdist.hpo.functions import BRANIN_SPACE, branin

    store, calls = str(tmp_path / "s.db"), []

    def interrupt_after_six(p):
        calls.append(p)
        if len(calls) == 7:
            raise KeyboardInterrupt  # the kernel's interrupt, in the middle of trial 6
        return branin(p)

    searcher = "optuna(sampler='tpe', n_startup_trials=4)"
    with pytest.raises(KeyboardInterrupt):
        optimize(
            interrupt_after_six,
            space=BRANIN_SPACE,
            searcher=searcher,
            trials=14,
            store=store,
            study_name="tpe",
            **QUIET,
        )
    with RunStore(store) as s:
        saved = s.study("tpe")["searcher_state"]["searcher"]
    assert saved["searcher"] == "optuna" and len(saved["told"]) == 6 and len(saved["pending"]) == 1

    from nbdist.hpo import restore_searcher

    # The Optuna study is built again from the store: the same next points every time.
    again = [restore_searcher(saved).ask(2) for _ in range(2)]
    assert again[0] == again[1] and len(restore_searcher(saved)._study.trials) == 7
    interrupted = calls[-1]
    calls.clear()
    result = optimize(
        lambda p: calls.append(p) or branin(p),
        space=BRANIN_SPACE,
        searcher=searcher,
        trials=14,
        store=store,
        resume_study="tpe",
        **QUIET,
    )
    assert calls[0] == interrupted and len(calls) == 8  # the unfinished trial first, then new ones
    assert len(result.trials) == 14 and {r["state"] for r in result.trials} == {"complete"}
    with RunStore(store) as s:
        assert [t.number for t in s.trials("tpe")] == list(range(14))
        assert len(s.study("tpe")["searcher_state"]["searcher"]["told"]) == 14


def test_a_qmc_study_with_a_store_takes_new_points_of_its_sequence(tmp_path):
    """A study with a store reloads its searcher between asks: QMC's place in its sequence
    comes back with it (it proposed its first point again and failed on telling it)."""
    from nbdist.hpo.functions import BRANIN_SPACE, branin

    result = optimize(
        branin, space=BRANIN_SPACE, searcher="optuna(sampler='qmc')", trials=6, store=tmp_path / "s.db", **QUIET
    )
    points = [(r["params"]["x1"], r["params"]["x2"]) for r in result.trials]
    assert len(set(points)) == 6 and {r["state"] for r in result.trials} == {"complete"}


def test_optuna_samplers_by_name_and_one_error_for_an_unknown_one():
    from nbdist.hpo import make_searcher
    from nbdist.specs import SpecError

    for sampler in ("tpe", "cmaes", "gp", "nsga2", "qmc", "random"):
        searcher = make_searcher(f"optuna(sampler='{sampler}')", "x=real(0,1) k=cat(a,b)", seed=3)
        points = searcher.ask(2)
        assert len(points) == 2 and all(0 <= p["x"] <= 1 and p["k"] in "ab" for p in points)
        searcher.tell(points[0], 0.5)
        searcher.tell(points[1], 0.2, stopped_at=1)
    with pytest.raises(SpecError, match=r"unknown sampler 'tpee' \(did you mean 'tpe'\?\); choose one of: cmaes, gp"):
        make_searcher("optuna(sampler='tpee')", "x=real(0,1)")
