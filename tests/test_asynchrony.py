"""The master's momentum corrected for the momentum asynchrony adds (train/asynchrony.py)."""

import pytest

from nbdist.errors import OptionsError
from nbdist.options import TrainOptions
from nbdist.specs import parse_spec
from nbdist.train.asynchrony import corrected_momentum, implicit_momentum, worker_momentum_warning
from nbdist.train.context import DEFAULT_WORKER_OPTIMIZER


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
    # The total never reaches 1: at 16 workers 0.9 - 0.9375 is clipped at 0.
    at16 = corrected_momentum(parse_spec("sgd(lr=0.05, momentum=0.9, nesterov=True)"), 16, False, "auto")
    assert at16.spec.kwargs["momentum"] == 0.0 and at16.spec.kwargs["nesterov"] is False


@pytest.mark.parametrize("workers, synchronous, text", [
    (1, False, "sgd(lr=0.05, momentum=0.9)"),  # one worker: no asynchrony
    (8, True, "sgd(lr=0.05, momentum=0.9)"),  # synchronous rounds: every update from the current centre
    (8, False, "sgd(lr=0.1)"),  # no momentum to correct
    (8, False, "adam(lr=0.001)"),
])
def test_nothing_to_correct(workers, synchronous, text):
    spec = parse_spec(text)
    kept = corrected_momentum(spec, workers, synchronous, "auto")
    assert kept.spec == spec and kept.note == ""


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
    from nbdist.algorithms import make_algorithm

    takes = {name: make_algorithm(parse_spec(name)).centre_takes_worker_steps
             for name in ("adag", "dynsgd", "easgd", "gem", "downpour")}
    assert takes == {"adag": True, "dynsgd": False, "easgd": False, "gem": False, "downpour": False}
    default = parse_spec(DEFAULT_WORKER_OPTIMIZER)
    text = worker_momentum_warning("adag", default, 8, synchronous=False)
    assert "the centre can collapse" in text and "momentum below 0.12" in text
    assert "--worker-optimizer 'sgd(lr=0.05, momentum=0.062)'" in text and "--algorithm dynsgd" in text
    assert worker_momentum_warning("adag", default, 4, False) == ""  # not seen to collapse at 4
    assert worker_momentum_warning("adag", default, 8, True) == ""  # synchronous rounds
    assert worker_momentum_warning("adag", parse_spec("sgd(lr=0.1, momentum=0.1)"), 8, False) == ""
