"""The study dashboard's numbers without a browser: the synthetic study's trials
(tests/synthetic_study.py, written through the run store) in, each view's columns out,
checked against what was written and against nbdist.hpo's own rules."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("optuna")
from synthetic_study import EPOCHS, STUDY, write_synthetic_study  # noqa: E402

from nbdist.dashboard.study.curves import CurveFeed, lineage_columns, lineage_members, schedule_lines  # noqa: E402
from nbdist.dashboard.study.data import StudyData  # noqa: E402
from nbdist.dashboard.study.frames import (  # noqa: E402
    contour_grid,
    history_columns,
    parallel_lines,
    param_axes,
    pareto_mask,
    slice_columns,
)
from nbdist.dashboard.study.importance import ImportanceError, param_importances  # noqa: E402
from nbdist.dashboard.study.table import trial_table  # noqa: E402
from nbdist.hpo.outcome import pareto_front  # noqa: E402
from nbdist.store import RunStore  # noqa: E402

TRIALS = 120


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    path = tmp_path_factory.mktemp("study") / "nbdist.db"
    made = write_synthetic_study(path, trials=TRIALS)
    store = RunStore(path)
    data = StudyData(store, STUDY)
    data.poll()
    yield path, made, data
    store.close()


def test_history_draws_every_valued_trial_and_the_best_only_improves(study):
    _, made, data = study
    points, best = history_columns(data.trials, 0, maximize=False)
    drawn = made.states["complete"] + made.states["pruned"] + made.states["stopped"]
    assert len(points["trial"]) == drawn and points["trial"] == sorted(points["trial"])
    assert "failed" not in points["state"]
    assert len(best["trial"]) == made.states["complete"]
    assert all(b <= a for a, b in zip(best["best"], best["best"][1:], strict=False))
    assert best["best"][-1] == min(v[0] for v in made.values.values())  # values[0]: the first objective


def test_axes_follow_the_space_and_lines_are_scaled(study):
    _, made, data = study
    axes = param_axes(data.info.space, data.trials)
    assert [(a.name, a.kind) for a in axes.values()] == [
        ("lr", "log"),
        ("hidden", "linear"),
        ("optimizer", "category"),
        ("dropout", "linear"),
    ]
    lines, names = parallel_lines(data.trials, axes, 0)
    assert names == ["lr", "hidden", "optimizer", "dropout"]
    assert len(lines["trial"]) == made.states["complete"]
    ys = np.array(lines["ys"])
    assert ys.shape == (made.states["complete"], 5) and ys.min() == 0.0 and ys.max() == 1.0
    lr = slice_columns(data.trials, axes["lr"], 0)
    assert all(1e-4 <= x <= 0.1 for x in lr["x"])  # a log axis's slice is in the parameter's own units
    points, image = contour_grid(data.trials, axes["lr"], axes["hidden"], 0, size=16)
    assert len(points["trial"]) == made.states["complete"] and np.asarray(image["image"][0]).shape == (16, 16)


def test_the_pareto_mask_is_nbdists_pareto_front(study):
    _, made, data = study
    done = [t for t in data.trials if t.state == "complete"]
    mask = pareto_mask(np.array([t.values for t in done]), [False, False])
    rows = [{"number": t.number, "state": t.state, "values": t.values} for t in done]
    assert [t.number for t, on in zip(done, mask, strict=True) if on] == [
        r["number"] for r in pareto_front(rows, [False, False])
    ]
    ties = np.array([[1.0, 2.0], [1.0, 2.0], [0.5, 3.0], [2.0, 2.5]])
    assert pareto_mask(ties, [False, False]).tolist() == [True, True, True, False]


def test_importance_ranks_the_parameter_the_objective_depends_on_first(study):
    _, _, data = study
    axes = param_axes(data.info.space, data.trials)
    ranked = param_importances(data.trials, axes, 0, maximize=False)
    assert ranked[0][0] == "lr" and ranked[0][1] > 0.5, ranked
    assert sum(v for _, v in ranked) == pytest.approx(1.0)
    with pytest.raises(ImportanceError, match="at least"):
        param_importances(data.trials[:3], axes, 0, maximize=False)


def test_learning_curves_stream_once_and_marks_wait_for_their_value(study):
    _, made, data = study
    feed = CurveFeed()
    late_mark = [{"number": 1, "kind": "pruned", "epoch": 2, "data": {}}]
    assert feed.add(late_mark)[2]["trial"] == []  # its value has not come yet
    value = {"number": 1, "kind": "value", "epoch": 2, "data": {"value": 0.5}}
    points, segments, marks = feed.add([value])
    assert points["value"] == [0.5] and marks["trial"] == [1] and marks["value"] == [0.5]
    feed = CurveFeed()
    points, segments, marks = feed.add(data.events)
    values = sum(1 for e in data.events if e["kind"] == "value")
    assert len(points["trial"]) == values
    assert len(segments["trial"]) == values - len({e["number"] for e in data.events if e["kind"] == "value"})
    assert marks["kind"].count("promoted") == made.promotions and marks["kind"].count("pruned") == made.pruned
    assert feed.add(data.events) == ({k: [] for k in points}, {k: [] for k in segments}, {k: [] for k in marks})


def test_lineage_and_schedules_of_the_pbt_members(study):
    _, made, data = study
    feed = CurveFeed()
    feed.add(data.events)
    members = lineage_members(data.events, data.trials, pbt=False)
    assert members == sorted({n for _, s, r in made.exploits for n in (s, r)})
    _, edges = lineage_columns(data.events, members, feed.values)
    assert sorted(zip(edges["epoch"], edges["source"], edges["receiver"], strict=True)) == sorted(made.exploits)
    assert all(c.startswith("lr 0.05 -> ") for c in edges["change"])
    lines = schedule_lines(data.events, data.trials, members, "lr")
    receiver = lines["trial"].index(made.members[-1])  # took the first member's state after epoch 3
    assert lines["xs"][receiver] == [0, 3, 3, EPOCHS] and lines["ys"][receiver][2] == pytest.approx(0.0039)


def test_the_trial_table_has_each_trials_ranks_runs_and_rank_per_objective(study):
    _, made, data = study
    axes = param_axes(data.info.space, data.trials)
    info = data.info
    table = trial_table(data.trials, data.runs, info.layout, info.objectives, info.maximize, list(axes))
    assert table["trial"] == list(range(made.trials))
    assert table["ranks"][1] == "group 1: ranks 3-4" and table["runs"][0] == f"{STUDY}-trial0000-fold0"
    best = min(made.values, key=lambda n: made.values[n][0])
    assert table["rank: val_loss"][best] == 1
    assert math.isnan(table["rank: val_loss"][7])  # a failed trial has no rank
    assert table["Pareto front"].count("yes") == int(pareto_mask(np.array(list(made.values.values())), [0, 0]).sum())


def test_polling_reads_only_what_is_new(study):
    path, made, data = study
    assert data.poll() == (False, [], 0)  # nothing written: nothing read
    with RunStore(path) as store:
        store.record_trial(STUDY, TRIALS, params={"lr": 0.01}, state="running")
    changed, new, finished = data.poll()
    assert changed and new == [] and finished == 0 and data.trials[-1].state == "running"
    with RunStore(path) as store:
        store.record_trial(STUDY, TRIALS, params={"lr": 0.01}, state="complete", fom=0.3, values=[0.3, 1.0])
        store.record_trial_events(STUDY, [(TRIALS, "value", 1, {"value": 0.3})])
    changed, new, finished = data.poll()
    assert changed and finished == 1 and [(e["number"], e["kind"]) for e in new] == [(TRIALS, "value")]
    with RunStore(path) as store:  # a state changed alone (paused to pruned: same length, same value)
        store.record_trial(STUDY, TRIALS + 1, params={"lr": 0.01}, state="paused", fom=0.4, epochs=1)
    data.poll()
    with RunStore(path) as store:
        store.record_trial(STUDY, TRIALS + 1, params={"lr": 0.01}, state="pruned", fom=0.4, epochs=1)
    changed, _, finished = data.poll()
    assert changed and finished == 1 and data.trials[-1].state == "pruned"


def test_notes_written_on_the_page_are_kept_in_the_store_and_shown_everywhere(study, tmp_path):
    pytest.importorskip("panel")
    from nbdist.dashboard import export_html
    from nbdist.dashboard.study import StudyPage

    path, _, _ = study
    with RunStore(path) as store:
        page = StudyPage(store, STUDY)
        page.notes.study_note.value = "lr matters most <b>here</b>"
        page.notes.save_study.clicks += 1  # as a click in the browser
        page.notes.trial.value = 5
        page.notes.trial_note.value = "diverged after epoch 3"
        page.notes.save_trial.clicks += 1
        assert store.notes(STUDY) == {None: "lr matters most <b>here</b>", 5: "diverged after epoch 3"}
        assert "trial 5's note saved" in page.notes.said.object
        page.tabs.active = page._tab_names.index("Trials")
        assert page.table.source.data["note"][5] == "diverged after epoch 3"
        other = StudyPage(store, STUDY)  # another page, later: the notes are there
        assert other.notes.study_note.value == "lr matters most <b>here</b>"
        store.save_note(STUDY, "", trial=5)  # an empty note removes it
        assert store.notes(STUDY) == {None: "lr matters most <b>here</b>"}
    exported = export_html(path, tmp_path / "study.html", study=STUDY).read_text()
    # In the page's embedded document, Markdown's own tags are escaped once and the note's
    # escaped text once more: the note shows as written, never runs as HTML.
    assert (
        "&amp;lt;strong&amp;gt;Study:&amp;lt;/strong&amp;gt; lr matters most &amp;amp;lt;b&amp;amp;gt;here" in exported
    )
    assert "&amp;lt;b&amp;gt;here" not in exported
