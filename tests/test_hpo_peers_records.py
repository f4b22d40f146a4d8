"""bench/hpo_peers.py's bookkeeping: a unit's record is appended once, recorded units are
skipped, the missing ones come in the aim's order, and the report aggregates what the
records hold (the benchmark's own numbers are not asserted here: bench/results has them)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import _hpo_peers_runs as runs  # noqa: E402
import hpo_peers  # noqa: E402

TARGETS = {"digits": (0.9, 0.95), "jets": (0.8,)}


def record(task="digits", method="nbdist-asha-tpe", seed=0, *, curve=((3, 0.5), (10, 0.92)), budget=400, epochs=27):
    """A record as a unit writes it: `curve` the (epochs consumed, best so far) improvements."""
    return {
        "task": task,
        "method": method,
        "seed": seed,
        "budget": budget,
        "trial_epochs": epochs,
        "improvements": [list(point) for point in curve],
        "best_accuracy": max(acc for _, acc in curve),
        "wall_s": 200.0,
        "cpu_s": 180.0,
        "load_before": [1.5, 1.0, 1.0],
        "load_after": [2.5, 1.0, 1.0],
        "priority": "idle, nice 19",
        "commit": "abc1234",
        "date": "2026-11-28 03:30",
    }


def test_a_record_is_appended_as_one_json_line_and_read_back(tmp_path):
    path = tmp_path / "results" / "runs.jsonl"
    runs.append_run(path, record(seed=0))
    runs.append_run(path, record(seed=1))
    lines = path.read_text().splitlines()
    assert [json.loads(line)["seed"] for line in lines] == [0, 1]
    assert runs.load_runs(path) == [record(seed=0), record(seed=1)]
    assert runs.load_runs(tmp_path / "none-yet.jsonl") == []


def test_recorded_units_are_skipped_only_for_the_same_budget(tmp_path):
    records = [record(seed=0), record(seed=1, budget=40, epochs=9)]
    assert runs.is_recorded(records, runs.Unit("digits", "nbdist-asha-tpe", 0), 400, 27)
    assert not runs.is_recorded(records, runs.Unit("digits", "nbdist-asha-tpe", 1), 400, 27)
    assert not runs.is_recorded(records, runs.Unit("jets", "nbdist-asha-tpe", 0), 400, 27)
    missing = runs.missing_units(records, 5, 400, 27)
    assert len(missing) == len(runs.plan(5)) - 1 == 2 * 7 * 5 - 1
    assert runs.Unit("digits", "nbdist-asha-tpe", 0) not in missing


def test_the_plan_runs_the_aims_pair_seed_by_seed_first_then_the_peers_then_jets():
    units = runs.plan(5)
    first = [(u.method, u.seed) for u in units[:10]]
    assert first == [(m, s) for s in range(5) for m in ("nbdist-asha-tpe", "optuna-tpe-hyperband")]
    assert {u.method for u in units[10:20]} == {"optuna-tpe", "random"}
    assert {u.task for u in units[:35]} == {"digits"} and {u.task for u in units[35:]} == {"jets"}
    assert len(set(units)) == len(units)


def test_epochs_to_target_are_read_from_the_improvements():
    improvements = [[1, 0.2], [4, 0.85], [9, 0.91]]
    assert runs.first_reaching(improvements, 0.85) == 4
    assert runs.first_reaching(improvements, 0.9) == 9
    assert runs.first_reaching(improvements, 0.95) is None


def test_the_report_aggregates_seeds_and_states_the_aim():
    records = [
        record(method="nbdist-asha-tpe", seed=0, curve=((10, 0.96),)),
        record(method="nbdist-asha-tpe", seed=1, curve=((30, 0.93),)),
        record(method="optuna-tpe-hyperband", seed=0, curve=((40, 0.95),)),
        record(method="optuna-tpe-hyperband", seed=1, curve=((50, 0.94),)),
        record(method="random", seed=0, curve=((5, 0.5),)),
        record(method="nbdist-bayes", seed=0, curve=((20, 0.91),), budget=40, epochs=9),  # another set-up
    ]
    rows = runs.rows_for(records, "digits", 0.9, 400, 27)
    assert [r.method for r in rows] == ["nbdist-asha-tpe", "optuna-tpe-hyperband", "random"]
    ours = rows[0]
    assert ours.reached() == "2/2" and ours.median_to_target(400) == 20 and ours.mean_to_target() == 20
    assert ours.mean_best() == pytest.approx(0.945)
    never = rows[2]
    assert never.reached() == "0/1" and never.median_to_target(400) == 800 and never.mean_to_target() is None

    aim = runs.aim_text(rows, 400, 5)
    assert "provisional: 2 of 5 seeds" in aim
    assert "nbdist-asha-tpe against Optuna's best optuna-tpe-hyperband" in aim
    assert "0.44x (aim <= 0.8x: met)" in aim  # 20 / 45
    assert "1.000x (aim >= 1: met)" in aim  # 0.945 / 0.945

    text = runs.render_report(records, TARGETS, budget=400, trial_epochs=27, seeds=5, about="About these runs.")
    assert text.startswith("# hpo_peers: 5 of 70 units recorded")
    assert "## digits, target 0.9 (the aim's target)" in text and "## digits, target 0.95 (a stricter target)" in text
    assert "| nbdist-asha-tpe | 0,1 | 2/2 | 20 | 20.0 | 0.9450 |" in text
    assert "| digits | random | 0 | 2026-11-28 03:30 | abc1234 | 200 | 180 | 1.50/2.50 | idle, nice 19 |" in text
    assert "How they ran: 5 at priority idle, nice 19; 1-minute load average 1.50 to 2.50 around them" in text
    assert "A unit cost digits: median 180 s of CPU (range 180-180), 200 s of wall time" in text
    assert "## Still missing: 65 units" in text
    assert "- digits nbdist-asha-tpe: seeds 2, 3, 4" in text
    assert "- jets nbdist-bayes: seeds 0, 1, 2, 3, 4" in text
    assert "jets, target" not in text  # no jet unit recorded yet


def test_the_best_set_up_is_chosen_among_those_with_every_seed():
    """A set-up with fewer seeds does not win 'best' by a median over fewer seeds: where a
    side has set-ups with every seed of the plan, its best is one of those."""
    records = [record(method="nbdist-asha-tpe", seed=s, curve=((30, 0.96),)) for s in range(3)]
    records += [record(method="optuna-tpe-hyperband", seed=s, curve=((40, 0.96),)) for s in range(3)]
    records += [record(method="nbdist-asha-random", seed=0, curve=((5, 0.96),))]  # one lucky seed
    rows = runs.rows_for(records, "digits", 0.9, 400, 27)
    aim = runs.aim_text(rows, 400, 3)
    assert "nbdist's best set-up nbdist-asha-tpe against Optuna's best optuna-tpe-hyperband" in aim
    assert "provisional" not in aim and "0.75x (aim <= 0.8x: met)" in aim  # 30 / 40
    # With no set-up complete, every one competes, and the line says it is provisional.
    partial = runs.aim_text(runs.rows_for(records[:2] + records[3:5] + records[6:], "digits", 0.9, 400, 27), 400, 3)
    assert "nbdist-asha-random against" in partial and "provisional: 1 of 3 seeds" in partial


def test_a_broken_line_is_named_with_its_file_and_number(tmp_path):
    path = tmp_path / "runs.jsonl"
    path.write_text(json.dumps(record()) + "\n" + '{"task": "digits", "meth\n')
    with pytest.raises(runs.RunsFileError, match=r"runs.jsonl:2 is not a JSON record"):
        runs.load_runs(path)
    path.write_text(json.dumps({"task": "digits"}) + "\n")
    with pytest.raises(runs.RunsFileError, match=r"runs.jsonl:1 lacks method, seed, budget, trial_epochs"):
        runs.load_runs(path)


def test_next_says_when_every_unit_is_recorded(tmp_path, capsys):
    path = tmp_path / "runs.jsonl"
    for unit in runs.plan(1):
        runs.append_run(path, record(unit.task, unit.method, unit.seed))
    assert hpo_peers.main(["--next", "--seeds", "1", "--runs", str(path)]) == hpo_peers.NOTHING_LEFT
    assert "every unit is recorded" in capsys.readouterr().out
    assert hpo_peers.main(["--task", "jets", "--method", "random", "--seed", "0", "--runs", str(path)]) == 0
    assert "already recorded" in capsys.readouterr().out
    assert len(runs.load_runs(path)) == len(runs.plan(1))


def test_one_real_unit_is_trained_recorded_and_then_skipped(tmp_path, capsys):
    path = tmp_path / "runs.jsonl"
    argv = ["--task", "digits", "--method", "random", "--seed", "1", "--budget", "3", "--trial-epochs", "2"]
    assert hpo_peers.main([*argv, "--runs", str(path)]) == 0
    (done,) = runs.load_runs(path)
    assert (done["task"], done["method"], done["seed"], done["budget"]) == ("digits", "random", 1, 3)
    assert done["epochs_used"] == 3 and done["trials"] == 2  # the budget cut the second 2-epoch trial
    assert done["improvements"] and done["best_accuracy"] == done["improvements"][-1][1] > 0.1
    assert all(0 < e <= 3 for e, _ in done["improvements"])
    assert done["load_before"] and done["priority"] and done["commit"] and done["date"].startswith("20")
    assert hpo_peers.main([*argv, "--runs", str(path)]) == 0
    assert "already recorded" in capsys.readouterr().out
    assert len(runs.load_runs(path)) == 1


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--task", "digits"], "one unit needs all of --task, --method and --seed"),
        (["--task", "digits", "--method", "random", "--seed", "5"], "--seed must be in 0..4"),
        (
            ["--task", "mnist", "--method", "random", "--seed", "0"],
            "--task: invalid choice: 'mnist' (choose from",
        ),
        (["--budget", "0", "--report"], "--budget, --trial-epochs and --seeds must be at least 1"),
    ],
)
def test_bad_input_is_one_clear_line(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        hpo_peers.parse(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err
