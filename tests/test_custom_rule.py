"""A new update rule is one class and its registration: registered here, in this test
module only, a toy rule appears in `python -m nbdist train --help`, in what the docs
reference is made of (the registry's describe/summary/parameters) and in the contract
tests' parametrisation, without a line changed anywhere else."""

from __future__ import annotations

import argparse
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

from nbdist.algorithms import RULES, Algorithm, RuleState, weighted_mean
from nbdist.algorithms.arrays import Array, zeros_like_buffer
from nbdist.cli import build_parser
from nbdist.registry import Registry

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parent


@dataclass(slots=True)
class ToyWorker(RuleState):
    accumulated: Array
    count: int
    sync_every: int


class ToySGD(Algorithm):
    """Workers send their mean gradient over the window; the master steps against the
    round's mean with its own lr (a toy for the tests)."""

    name = "toy_sgd"
    parameter_help = {"lr": "the master's step size"}
    uses_worker_optimizer = False

    def __init__(self, lr: float = 0.1):
        super().__init__(lr=lr)
        self.lr = float(lr)

    def new_worker_state(self, n, sync_every, like=None) -> ToyWorker:
        return ToyWorker(zeros_like_buffer(n, like), 0, sync_every)

    def worker_step(self, state, params, grad, opt) -> bool:
        state.accumulated += grad
        state.count += 1
        return state.count >= state.sync_every

    def worker_message(self, state, params, out) -> None:
        out[...] = state.accumulated
        out /= float(state.count)
        state.accumulated[...] = 0.0
        state.count = 0

    def worker_reply(self, state, params, reply) -> None:
        params[...] = reply

    def master_apply(self, state, centre, updates, opt):
        centre -= self.lr * weighted_mean(updates)
        return [centre] * len(updates)


class OldSpellingToySGD(ToySGD):
    """The toy as a rule written before the project took one spelling names the centre:
    nbdist passes it positionally, so the parameter's name is the rule's own business."""

    name = "toy_sgd_old_spelling"

    def master_apply(self, state, center, updates, opt):  # the old spelling, on purpose
        center -= self.lr * weighted_mean(updates)
        return [center] * len(updates)


@pytest.fixture
def toy_registered():
    RULES.register(ToySGD)
    yield ToySGD
    RULES.unregister(ToySGD.name)


def train_help() -> str:
    """What `python -m nbdist train --help` prints, from the CLI's own parser, whitespace
    made single (argparse wraps the lines)."""
    commands = next(action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction))
    return " ".join(commands.choices["train"].format_help().split())


def test_the_toy_rule_is_in_the_train_help(toy_registered):
    help_text = train_help()
    assert "toy_sgd(lr=0.1): Workers send their mean gradient over the window; the master steps" in help_text
    assert "downpour (default)" in help_text  # beside the built-in rules
    RULES.unregister(ToySGD.name)
    assert "toy_sgd" not in train_help()


def test_the_toy_rule_is_in_what_the_docs_reference_is_made_of(toy_registered):
    rules = next(registry for registry in Registry.every() if registry.kind == "update rule")
    assert rules is RULES and "toy_sgd" in rules.names()
    assert rules.describe("toy_sgd") == "toy_sgd(lr=0.1)"
    assert rules.summary("toy_sgd") == (
        "Workers send their mean gradient over the window; the master steps against the round's mean with "
        "its own lr (a toy for the tests)."
    )
    [lr] = rules.parameters("toy_sgd")
    assert (lr.name, lr.default, lr.help) == ("lr", 0.1, "the master's step size")


def test_the_toy_rule_is_collected_and_passes_every_contract_test(pytester):
    """A session of its own (registrations are per process): this module registers the toy
    before the contract tests are imported, which parametrise over RULES as they are."""
    pytester.makepyfile(
        test_toy_contracts=textwrap.dedent(
            f"""
            import sys

            sys.path[:0] = [{str(TESTS)!r}, {str(TESTS.parent)!r}]

            from test_custom_rule import OldSpellingToySGD, ToySGD

            from nbdist.algorithms import RULES

            RULES.register(ToySGD)
            RULES.register(OldSpellingToySGD)

            from test_rule_contracts import *  # noqa: F403  (the contract tests, the toy among their rules)
            """
        )
    )
    # One session collects and runs them (-v names each test with its outcome): a second
    # session would import torch and the contract tests again for the same list.
    run = pytester.runpytest_subprocess("-v", "-p", "no:cacheprovider", "-k", "toy_sgd")
    toy_tests = [line for line in run.outlines if "::" in line and ("[toy_sgd" in line or "-toy_sgd" in line)]
    contracts = {line.split("::")[1].split("[")[0] for line in toy_tests}
    assert contracts == {
        "test_the_rule_is_built_by_name_and_describes_itself",
        "test_a_synchronous_round_of_equal_updates_moves_the_centre_as_one",
        "test_a_streamed_synchronous_round_gives_master_apply_bit_for_bit",
        "test_torch_tensors_through_staging_give_the_numpy_result",
        "test_rule_state_on_torch_tensors_checkpoints_as_numpy",
        "test_rule_state_round_trips",
    }, run.outlines
    assert all(line.split()[1] == "PASSED" for line in toy_tests), run.outlines
    assert any("toy_sgd_old_spelling" in line for line in toy_tests), run.outlines
    run.assert_outcomes(passed=len(toy_tests))


def test_nbdist_passes_the_centre_to_a_rule_positionally():
    """A rule's master side may name its centre parameter as it likes (`center`, as rules
    written before the rename do): no call in nbdist passes it by keyword."""
    import ast

    package = TESTS.parent / "nbdist"
    by_keyword = [
        f"{path.relative_to(package)}:{node.lineno}"
        for path in package.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and any(k.arg in ("centre", "center") for k in node.keywords)
    ]
    assert not by_keyword, by_keyword
