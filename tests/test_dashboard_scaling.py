"""A scaling study's page from the run store, without a browser: the figures a browser
would receive hold the measured points and the predicted curves, and points stored later
stream in."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("bokeh")

from bokeh.embed import json_item  # noqa: E402
from test_scaling_model import calibration  # noqa: E402

from nbdist.dashboard import dashboard  # noqa: E402
from nbdist.dashboard.scaling_view import ScalingView  # noqa: E402
from nbdist.scaling import Machine, PerformanceModel, SetUp, network  # noqa: E402
from nbdist.scaling.analysis import analyse  # noqa: E402
from nbdist.scaling.store import ScaleRecorder  # noqa: E402


def test_the_scaling_view_draws_the_measured_points_and_the_predicted_curves(tmp_path):
    store = str(tmp_path / "nbdist.db")
    cal = calibration()
    here = PerformanceModel(cal, Machine(2, network("ib-hdr"), nodes=1))
    recorder = ScaleRecorder(store, "study", str(tmp_path), {"model": "toy"})
    recorder.add("calibration", cal.to_dict())
    points = [here.predict(SetUp("allreduce"), r) for r in (1, 2)]
    for point in points:
        recorder.add("measured", {"measured": point.to_dict(), "predicted": point.to_dict()})

    board = dashboard(store, run="study", live=False)
    board.drain()
    view = board.view
    assert isinstance(view, ScalingView)
    (allreduce,) = view.measured.values()
    assert list(allreduce.data["ranks"]) == [1, 2]
    assert list(allreduce.data["efficiency"])[0] == pytest.approx(1.0)

    # The study goes on: its next point and its curves reach the open page.
    later = here.predict(SetUp("master-worker", "downpour"), 3)
    recorder.add("measured", {"measured": later.to_dict(), "predicted": later.to_dict()})
    analysis = analyse(
        cal, [], [SetUp("allreduce"), SetUp("master-worker", "downpour")], cores=2, cores_per_node=16,
        network_name="ib-hdr", max_ranks=64, target_samples=1e4, simulate=False,
    )  # fmt: skip
    recorder.add("predicted", [p.to_dict() for p in analysis.curves])
    recorder.add("summary", {"recommendation": analysis.recommendation, "median_error": 0.05, "worst_error": 0.1})
    recorder.finish("completed", "test")
    assert view.tick() > 0
    assert list(view.measured["downpour"].data["ranks"]) == [3]
    assert list(view.predicted["allreduce"].data["ranks"]) == [1, 2, 4, 8, 16, 32, 64]
    assert len(view.predicted["sub-masters"].data["ranks"]) == 5  # from 4 ranks on
    assert "Recommended:" in view.summary.object
    page = json.dumps(json_item(view.throughput))
    assert "nbdist-predicted-allreduce" in page and "nbdist-measured-downpour" in page
    board.close()
