"""What a cell defines, read from an engine's namespace that earlier cells also wrote."""

from __future__ import annotations

from nbdist.train.definition import definition_from_namespace, prefer_fresh


def _built(namespace, before):
    return definition_from_namespace(prefer_fresh(namespace, before), "the cell").build_model()


def test_a_model_the_cell_defines_wins_over_an_earlier_cells_build_model():
    def build_model(params):  # left on the engine by an earlier study cell
        return ("study", params)

    before = {"build_model": build_model, "x": 1}
    after = {**before, "model": "this cell's model"}
    assert _built(after, before) == "this cell's model"


def test_names_the_cell_leaves_alone_still_come_from_earlier_cells():
    before = {"build_model": lambda: "earlier model", "load_data": lambda: "earlier data"}
    after = {**before, "data": "this cell's data"}
    definition = definition_from_namespace(prefer_fresh(after, before), "the cell")
    assert definition.build_model() == "earlier model"
    assert definition.data == "this cell's data"


def test_a_cell_that_rebinds_build_model_uses_its_own():
    before = {"build_model": lambda: "old", "model": "older ready model"}
    after = {**before, "build_model": lambda: "new"}
    assert _built(after, before) == "new"
