"""The live plots without a browser: records through RunFrames into RunPlots, asserted on
the Bokeh document a browser would receive (the page's JSON)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("bokeh")

from bokeh.embed import json_item

from nbdist.dashboard.frames import RunFrames
from nbdist.dashboard.plots import RunPlots, queue_model_staleness
from nbdist.layout import Layout


def _rec(kind, rank, t, role="master", **values):
    return {
        "run": "r",
        "trial": None,
        "rank": rank,
        "role": role,
        "kind": kind,
        "step": 0,
        "epoch": 0,
        "time": t,
        "values": values,
        "seq": 0,
    }


def test_staleness_is_drawn_against_the_queue_models_n_minus_1():
    layout = Layout.for_world(5, topology="master-worker").to_dict()  # 1 master + 4 workers
    assert queue_model_staleness(layout, {"synchronous": False}) == 3
    # No reference where no update is stale by design.
    assert queue_model_staleness(layout, {"synchronous": True}) is None
    assert queue_model_staleness(Layout.for_world(4, topology="allreduce").to_dict(), {}) is None

    plots = RunPlots(list(range(5)), [1, 2, 3, 4], staleness_reference=queue_model_staleness(layout, {}))
    frames = RunFrames("master-worker", t0=0.0).ingest(
        [_rec("update", 0, 1.0 + i / 10, source_rank=1 + i % 4, staleness=s) for i, s in enumerate([0, 1, 2, 3, 3, 5])]
    )
    plots.send(frames)
    # The mean over every worker's updates of the interval, as its own line.
    assert plots.staleness_mean.data == {"t": [1.5], "staleness": [14 / 6]}

    figure = plots.staleness.figure
    (reference,) = figure.select(name="nbdist-staleness-reference")
    assert type(reference.glyph).__name__ == "HSpan"  # across the whole plot, at y = n - 1
    assert list(reference.data_source.data[reference.glyph.y]) == [3]
    labels = [item.label["value"] for item in plots.staleness.legend.items]
    assert labels[:2] == ["all workers", "queue model: n-1 = 3"]
    # What the browser receives holds the line and its label.
    page = json.dumps(json_item(figure))
    assert "nbdist-staleness-reference" in page and "queue model: n-1 = 3" in page
    # A synchronous run's plot has no reference line.
    assert not RunPlots([0, 1, 2], [1, 2]).staleness.figure.select(name="nbdist-staleness-reference")


def test_validations_every_n_samples_are_drawn_between_the_epochs():
    plots = RunPlots([0, 1, 2], [1, 2], every_samples=400)
    frames = RunFrames("master-worker", t0=0.0).ingest(
        [
            _rec("val", 0, 1.0, samples_seen=450, val_loss=1.2, val_acc=0.3, version=15),
            _rec("val", 0, 2.0, samples_seen=810, val_loss=0.9, val_acc=0.5, version=27),
            _rec("epoch", 0, 2.5, epoch=1, samples=1437, samples_seen=1527, val_loss=0.7, val_acc=0.72),
        ]
    )
    # An epoch record's own samples_seen (the centre validated), not the epochs' sum.
    assert frames.epochs["samples_seen"].tolist() == [1527]
    plots.send(frames)
    assert plots.validations.data["samples_seen"] == [450.0, 810.0]
    assert plots.validations.data["val_acc"] == [0.3, 0.5]
    figure = plots.accuracy["samples_seen"]
    labels = [item.label["value"] for legend in figure.legend for item in legend.items]
    assert "validation every 400 samples" in labels
    sampled = [r for r in figure.renderers if r.name == "nbdist-accuracy-by-samples-sampled"]
    assert len(sampled) == 1 and sampled[0].data_source is plots.validations


def test_a_studys_page_is_drawn_before_its_first_trial_ends(tmp_path):
    # study.dashboard() is usually opened as the study starts, with no trial finished.
    from nbdist.dashboard import dashboard
    from nbdist.store import RunStore

    with RunStore(tmp_path / "nbdist.db") as store:
        store.begin_study(
            "s",
            searcher="random",
            space={"lr": "log(1e-3,1e-1)"},
            options={},
            objective="val_loss",
            direction="minimize",
        )
        store.record_trial("s", 0, params={"lr": 0.01}, state="running")
    board = dashboard(tmp_path / "nbdist.db", study="s", live=False)
    root = board.page.get_root()  # the study's figures are Bokeh models: in one document
    page = json.dumps(json_item(root))  # what a browser receives: no error making it
    assert "nbdist-parallel-coordinates" in page and "nbdist-population" in page and "nbdist-history" in page
    with RunStore(tmp_path / "nbdist.db") as store:
        store.record_trial("s", 0, params={"lr": 0.01}, state="complete", fom=0.5, ended=1.0)
    assert board.study.update() == 1
    assert board.study.parallel.source.data["trial"] == [0]
    assert dict(board.study.parallel.figure.xaxis.major_label_overrides) == {0: "lr", 1: "val_loss"}
    assert '"lr"' in json.dumps(json_item(root))  # the axes are named now
    board.close()
