"""The study dashboard for real, with a study of a thousand synthetic trials in the run
store (tests/synthetic_study.py, written through nbdist's store API): served by
`python -m nbdist dashboard` and exported to one HTML file, loaded in headless Chromium
that reaches this machine only, and asserted on what a person sees in each view: titles,
the points each plot draws, the parameter that matters ranked first, and the page
answering a tab switch or a widget change while it is open."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("panel")
from conftest import ROOT  # noqa: E402
from synthetic_study import STUDY, write_synthetic_study  # noqa: E402
from test_dashboard import Server, _wait  # noqa: E402  (the same server and waits; Chromium: conftest)
from test_offline_browser import OfflinePage  # noqa: E402

from nbdist.dashboard import export_html  # noqa: E402
from nbdist.hpo.outcome import pareto_front  # noqa: E402
from nbdist.store import RunStore  # noqa: E402

pytestmark = pytest.mark.timeout(300)  # `browser` (conftest) marks each test

ARTIFACTS = ROOT / "test-artifacts"
# A named figure as drawn: its title and the rows of each named renderer's data source
# (a table: its rows), over every Bokeh document of the page; null until it is drawn.
FIGURE = """(name) => {
  if (typeof Bokeh === "undefined") return null;
  for (const doc of Bokeh.documents) {
    for (const m of doc._all_models.values()) {
      if (m.name !== name) continue;
      if (m.source) return {title: null, rows: {table: m.source.get_length()}};
      const rows = {};
      for (const r of m.renderers || []) if (r.name) rows[r.name] = r.data_source.get_length();
      return {title: m.title ? m.title.text : null, rows: rows};
    }
  }
  return null;
}"""
# The importance bars as drawn: (parameter, importance), most important first.
BARS = """() => {
  for (const doc of Bokeh.documents) for (const m of doc._all_models.values()) {
    if (m.name !== "nbdist-importance") continue;
    const data = m.renderers.find(r => r.name === "importance-bars").data_source.data;
    return Array.from(data.param).map((p, i) => [p, Number(data.importance[i])]);
  }
  return null;
}"""


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    path = tmp_path_factory.mktemp("study") / "nbdist.db"
    return path, write_synthetic_study(path)


def _expected(made) -> dict:
    """What each view must show, from what was written (the front by nbdist.hpo's own rule)."""
    drawn = made.states["complete"] + made.states["pruned"] + made.states["stopped"]
    rows = [{"number": n, "state": "complete", "values": v} for n, v in made.values.items()]
    front = pareto_front(rows, [False, False])
    return {"drawn": drawn, "complete": made.states["complete"], "front": len(front)}


def _figure(page, name: str, want, timeout: float = 60):
    """The figure once `want(figure)` holds (the title, the rows), else a failure saying what it showed."""
    seen = {}

    def check():
        seen["figure"] = page.evaluate(FIGURE, name)
        return seen["figure"] is not None and want(seen["figure"]) and seen["figure"]

    try:
        return _wait(check, timeout, f"{name} as expected")
    except AssertionError:
        raise AssertionError(
            f"{name} did not show what was expected within {timeout} s: {seen.get('figure')}"
        ) from None


def _open_tab(page, title: str) -> None:
    page.get_by_text(title, exact=True).first.click()


def _check_importance(page, first: str = "lr") -> list:
    bars = _wait(lambda: page.evaluate(BARS), 60, "the importance bars were not drawn")
    assert bars[0][0] == first and bars[0][1] > 0.5, bars  # the parameter the data depends on
    assert {name for name, _ in bars} == {"lr", "hidden", "optimizer", "dropout"}
    return bars


def test_the_study_dashboard_of_a_thousand_trials_served_offline(synthetic, browser):
    store, made = synthetic
    want = _expected(made)
    server = Server(["dashboard", "--store", str(store), "--study", STUDY, "--port", "0"])
    offline = OfflinePage(browser, viewport=(1300, 1600))
    page = offline.page
    try:
        page.goto(server.url, timeout=120_000)
        # The header's line (its study name is bold: the line is the element around it).
        header = page.get_by_text(re.compile(r"\d+ trials \("))
        _wait(lambda: header.count() and "1000 trials" in header.first.inner_text(), 60, "no study header")
        text = header.first.inner_text()
        assert f"study {STUDY}" in text and "searcher random" in text, text
        assert f"{made.states['complete']} complete" in text and f"{made.states['pruned']} pruned" in text
        assert f"Pareto front: {want['front']} trials" in text

        history = _figure(page, "nbdist-history", lambda f: f["rows"]["history-points"] == want["drawn"])
        assert history["title"] == f"Optimisation history: val_loss ({want['drawn']} trials)"
        assert history["rows"]["history-best"] == want["complete"]
        # Each tab, opened, draws its view (the server sends it only then).
        _open_tab(page, "Parallel coordinates")
        _figure(page, "nbdist-parallel-coordinates", lambda f: f["rows"]["parallel-lines"] == want["complete"])
        _open_tab(page, "Slice")
        for name in ("lr", "hidden", "optimizer", "dropout"):
            _figure(page, f"nbdist-slice-{name}", lambda f: f["rows"]["slice-points"] == want["complete"])
        _open_tab(page, "Contour")  # over the two parameters that matter most
        contour = _figure(page, "nbdist-contour", lambda f: "over lr and hidden" in f["title"])
        assert contour["rows"]["contour-points"] == want["complete"] and contour["rows"]["contour-image"] == 1
        _open_tab(page, "Importance")
        importance = _figure(page, "nbdist-importance", lambda f: "random forest" in f["title"])
        assert f"{want['complete']} complete trials" in importance["title"]
        _check_importance(page)
        # A widget change: another evaluator, fitted and drawn while the page is open.
        page.locator("select", has=page.locator("option", has_text="fanova")).select_option("fanova")
        _figure(page, "nbdist-importance", lambda f: "(fanova," in f["title"])
        _check_importance(page)
        _open_tab(page, "Intermediate values")
        curves = _figure(page, "nbdist-intermediate", lambda f: f["rows"].get("curve-marks"))
        marks = made.pruned + made.promotions + made.states["stopped"]
        assert curves["rows"]["curve-marks"] == marks
        assert f"({made.pruned} pruned, {made.promotions} promotions)" in curves["title"]
        _open_tab(page, "Pareto front")
        pareto = _figure(page, "nbdist-pareto", lambda f: f["rows"]["pareto-front"] == want["front"])
        assert pareto["rows"]["pareto-others"] == want["complete"] - want["front"]
        _open_tab(page, "PBT lineage")
        lineage = _figure(page, "nbdist-lineage", lambda f: f["rows"]["lineage-exploits"] == len(made.exploits))
        assert lineage["title"] == f"PBT lineage: 6 members, {len(made.exploits)} exploits"
        _figure(page, "nbdist-schedule", lambda f: f["rows"]["schedule-lines"] == 6)
        _open_tab(page, "Trials")
        _figure(page, "nbdist-trial-table", lambda f: f["rows"]["table"] == made.trials)
        assert page.get_by_text("group 1: ranks 3-4").count()  # each trial's ranks, in its row
        # A note on the study, written on the page, is kept in the store with the study.
        _open_tab(page, "Notes")
        page.locator("textarea").first.fill("lr matters most")
        page.get_by_role("button", name="save the study's note").click()
        with RunStore(store) as opened:
            _wait(lambda: opened.notes(STUDY) == {None: "lr matters most"}, 30, "the note was not saved")
        # The page shows it once the server's reply to the click reaches the browser.
        _wait(lambda: page.get_by_text("Study: lr matters most").count(), 30, "the saved note was not shown")
        # The objective changed: the views follow it.
        page.locator("select", has=page.locator("option", has_text="params")).first.select_option("params")
        _open_tab(page, "History")
        _figure(
            page, "nbdist-history", lambda f: f["title"] == f"Optimisation history: params ({want['complete']} trials)"
        )
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "study-dashboard-served.png"), full_page=True)
        assert not offline.outside, f"the page asked for resources outside this machine: {offline.outside}"
        assert not offline.errors, offline.errors
    except BaseException:
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "study-dashboard-served-failed.png"), full_page=True)
        raise
    finally:
        page.close()
        server.stop()


def test_the_exported_study_dashboard_draws_every_view_offline(synthetic, browser, tmp_path):
    store, made = synthetic
    want = _expected(made)
    export = export_html(store, tmp_path / "study.html", study=STUDY)
    text = export.read_text()
    assert "cdn.holoviz.org" not in text and "cdn.bokeh.org" not in text
    offline = OfflinePage(browser, viewport=(1300, 1600))
    page = offline.page
    try:
        page.goto(export.as_uri())
        # Every tab is in the file: each view is drawn without a server.
        _figure(page, "nbdist-history", lambda f: f["rows"]["history-points"] == want["drawn"])
        _figure(page, "nbdist-parallel-coordinates", lambda f: f["rows"]["parallel-lines"] == want["complete"])
        _figure(page, "nbdist-contour", lambda f: "over lr and hidden" in f["title"])
        _check_importance(page)
        _figure(page, "nbdist-pareto", lambda f: f["rows"]["pareto-front"] == want["front"])
        _figure(page, "nbdist-lineage", lambda f: f["rows"]["lineage-exploits"] == len(made.exploits))
        _figure(page, "nbdist-trial-table", lambda f: f["rows"]["table"] == made.trials)
        _open_tab(page, "Intermediate values")  # a tab switch needs no server
        _figure(page, "nbdist-intermediate", lambda f: f["rows"]["curve-marks"] > 0)
        page.screenshot(path=str(ARTIFACTS / "study-dashboard-export.png"), full_page=True)
        assert not offline.outside, f"the exported page asked for resources outside this machine: {offline.outside}"
        assert not offline.errors, offline.errors
    finally:
        page.close()
