"""Samples-to-accuracy from a run's log: the validation curve (epoch and per-sample
validations merged), samples_to_reach, and the marks --validate-every-samples passes."""

from __future__ import annotations

import json

import pytest

from nbdist.errors import OptionsError
from nbdist.metrics import RunLog, samples_to_reach, validation_curve
from nbdist.options import TrainOptions
from nbdist.train.validation import SampleMarks


def _log(run_dir, records, rank=0):
    """Write (kind, values) records with the run's own RunLog, as a rank would."""
    log = RunLog(run_dir, run_dir.name, rank, "master")
    for kind, values in records:
        log.emit(kind, values)
    log.close()


def test_the_curve_merges_per_sample_and_epoch_validations_by_samples(tmp_path):
    _log(
        tmp_path,
        [
            ("train", {"samples": 64, "loss": 2.0}),
            ("val", {"samples_seen": 400, "val_loss": 1.5, "val_acc": 0.40}),
            ("val", {"samples_seen": 810, "val_loss": 1.0, "val_acc": 0.62}),
            ("epoch", {"epoch": 1, "samples": 1000, "samples_seen": 1000, "val_loss": 0.8, "val_acc": 0.70}),
            ("val", {"samples_seen": 1220, "val_loss": 0.6, "val_acc": 0.81}),
            # written before the validation above had finished: a master's two validators
            ("epoch", {"epoch": 2, "samples": 1000, "samples_seen": 2000, "train_loss": 0.5}),  # not validated
            ("val", {"samples_seen": 1600, "val_loss": 0.5, "val_acc": 0.85}),
            ("epoch", {"epoch": 3, "samples": 1000, "samples_seen": 3000, "val_loss": 0.4, "val_acc": 0.90}),
        ],
    )
    curve = validation_curve(tmp_path)
    assert curve == [(400, 0.40), (810, 0.62), (1000, 0.70), (1220, 0.81), (1600, 0.85), (3000, 0.90)]
    assert validation_curve(tmp_path, "val_loss")[:2] == [(400, 1.5), (810, 1.0)]
    assert samples_to_reach(curve, 0.80) == 1220
    assert samples_to_reach(curve, 0.70) == 1000  # reached exactly
    assert samples_to_reach(curve, 0.95) is None
    assert samples_to_reach(validation_curve(tmp_path, "val_loss"), 0.55, higher_is_better=False) == 1600
    assert samples_to_reach([], 0.5) is None


def test_a_resumed_run_keeps_the_training_that_went_on(tmp_path):
    # Stopped after 1300 samples, resumed from the checkpoint at 1000: the stretch after
    # it was trained, and recorded, again.
    first = [
        ("val", {"samples_seen": 500, "val_acc": 0.5}),
        ("epoch", {"epoch": 1, "samples": 1000, "samples_seen": 1000, "val_acc": 0.6}),
        ("val", {"samples_seen": 1100, "val_acc": 0.99}),
        ("epoch", {"epoch": 2, "samples": 1000, "samples_seen": 2000, "val_acc": 0.99}),
    ]
    again = [
        ("val", {"samples_seen": 1100, "val_acc": 0.65}),
        ("epoch", {"epoch": 2, "samples": 1000, "samples_seen": 2000, "val_acc": 0.7}),
    ]
    _log(tmp_path, first)
    _log(tmp_path, again)  # the same rank's log, appended by the resumed run
    assert validation_curve(tmp_path) == [(500, 0.5), (1000, 0.6), (1100, 0.65), (2000, 0.7)]


def test_a_log_without_samples_seen_counts_the_epochs_samples(tmp_path):
    _log(
        tmp_path,
        [
            ("epoch", {"epoch": 1, "samples": 1437, "val_acc": 0.7}),
            ("epoch", {"epoch": 2, "samples": 1437, "val_acc": 0.8}),
            ("epoch", {"epoch": 2, "samples": 1437, "val_acc": 0.75}),  # again, after a resume
            ("epoch", {"epoch": 3, "samples": 1400, "val_acc": 0.9}),
        ],
    )
    assert validation_curve(tmp_path) == [(1437, 0.7), (2874, 0.75), (4274, 0.9)]
    lines = (tmp_path / "metrics" / "rank-00000.jsonl").read_text().splitlines()
    assert all("samples_seen" not in json.loads(line)["values"] for line in lines)


def test_sample_marks_are_due_once_per_multiple_passed():
    marks = SampleMarks(100)
    due = []
    for seen in range(32, 500, 32):  # one step of 32 samples at a time
        if marks.due(seen):
            marks.passed(seen)
            due.append(seen)
    assert due == [128, 224, 320, 416]  # the first step at or past 100, 200, 300, 400
    # Several marks passed at once make one validation; a resume starts after its count.
    marks.passed(750)
    assert not marks.due(799) and marks.due(800)
    assert SampleMarks(100, seen=250).next == 300


@pytest.mark.parametrize("value", [0, -5, 31])
def test_validate_every_samples_below_one_batch_is_one_error(value):
    with pytest.raises(OptionsError) as err:
        TrainOptions(validate_every_samples=value, batch_size=32).validate()
    assert str(err.value) == f"--validate-every-samples must be at least one batch (--batch-size 32), got {value}"
    TrainOptions(validate_every_samples=32, batch_size=32).validate()


def test_epochs_that_ended_at_the_same_update_keep_their_validation(tmp_path):
    # A master can end two epochs in one turn: equal samples_seen, only the second unvalidated.
    _log(
        tmp_path,
        [
            ("epoch", {"epoch": 1, "samples": 900, "samples_seen": 1000, "val_acc": 0.7}),
            ("epoch", {"epoch": 2, "samples": 100, "samples_seen": 1000, "train_loss": 0.3}),
        ],
    )
    assert validation_curve(tmp_path) == [(1000, 0.7)]
