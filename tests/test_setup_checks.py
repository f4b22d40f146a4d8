"""What set-up checks before any rank trains, without MPI: metric names against what the
run reports, data sizes against the workers' batches, a run directory to resume, the
kinds of option values. (tests/test_bad_input.py runs the same mistakes under mpiexec.)"""

from __future__ import annotations

import argparse
import itertools
import json

import numpy as np
import pytest

from nbdist.cli import build_parser
from nbdist.data.arrays import ArrayData
from nbdist.data.base import DataError
from nbdist.data.sharding import ShardPlan
from nbdist.errors import OptionsError, TrainingError
from nbdist.hpo.trial import watched_metrics
from nbdist.layout import Layout
from nbdist.options import StudyOptions, TrainOptions, options_from_args, saved_run_options
from nbdist.train.context import MetricNameError, TrialTag, check_data_size, check_metric_names
from nbdist.train.progress import BatchStats, EpochTally, epoch_metrics, reported_metrics


# ----------------------------------------------------------------------- metric names
def test_reported_metrics_are_the_names_epoch_metrics_writes():
    tally = EpochTally(BatchStats(2.0, 1.0, 2))
    tally.add_staleness(1)
    written = epoch_metrics(0, tally, BatchStats(1.0, 1.0, 1), 1.0, "acc")
    assert sorted(reported_metrics("acc", staleness=True)) == sorted(written)
    assert reported_metrics("acc", staleness=True)[:4] == ["val_loss", "val_acc", "train_loss", "train_acc"]
    assert "staleness_mean" not in reported_metrics("acc", staleness=False)  # allreduce: no master
    assert "val_mmd" in reported_metrics("mmd", staleness=True)  # a GAN's metric


MASTER_WORKER = reported_metrics("acc", staleness=True)


@pytest.mark.parametrize(
    "options, study, given, close",
    [
        (TrainOptions(monitor="val_lsos"), None, "--monitor val_lsos", "val_loss"),
        (TrainOptions(target="val_acu > 0.5"), None, "--target 'val_acu > 0.5'", "val_acc"),
        (TrainOptions(), StudyOptions(objective="val_acu"), "--objective val_acu", "val_acc"),
        (TrainOptions(), StudyOptions(goal="val_accuracy > 0.9"), "--goal 'val_accuracy > 0.9'", "val_acc"),
    ],
)
def test_a_metric_the_run_does_not_report_is_one_error_listing_those_it_does(options, study, given, close):
    trial = TrialTag("s", 0, watched_metrics(study)) if study else None
    with pytest.raises(MetricNameError) as err:
        check_metric_names(options, trial, MASTER_WORKER)
    assert str(err.value) == f"{given}: this run reports {', '.join(MASTER_WORKER)} (did you mean {close!r}?)"


def test_metrics_the_run_reports_pass():
    options = TrainOptions(monitor="val_acc", target="staleness_mean < 3")
    study = StudyOptions(objective="val_loss", goal="val_acc > 0.9")
    check_metric_names(options, TrialTag("s", 0, watched_metrics(study)), MASTER_WORKER)
    with pytest.raises(MetricNameError, match="--target 'staleness_mean < 3': this run reports val_loss, "):
        check_metric_names(options, None, reported_metrics("acc", staleness=False))


def test_an_empty_validation_set_is_not_a_divergence():
    with pytest.raises(TrainingError) as err:
        epoch_metrics(2, EpochTally(BatchStats(1.0, 1.0, 1)), BatchStats(), 1.0, "acc")
    assert "the validation set is empty (epoch 3 validated on 0 samples)" in str(err.value)
    assert "diverged" not in str(err.value)


# ------------------------------------------------------------------------- data sizes
def arrays(n_train: int, n_val: int = 5) -> ArrayData:
    return ArrayData(
        np.zeros((n_train, 3), np.float32),
        np.zeros(n_train, np.int64),
        np.zeros((n_val, 3), np.float32),
        np.zeros(n_val, np.int64),
    )


@pytest.mark.parametrize(
    "n, layout, batch_size, message",
    [
        (
            1,
            Layout(workers=2, topology="allreduce"),
            32,
            "too few training samples for 2 workers: 1 with --batch-size 32 leave a worker without a batch "
            "at some step; use at most 1 worker, or give more training samples",
        ),
        (
            3,
            Layout(workers=2, topology="allreduce"),
            1,
            "too few training samples for 2 workers: 3 with --batch-size 1 leave a worker without a batch "
            "at some step; use --batch-size 2 or more, or fewer workers",
        ),
        (
            2,
            Layout(workers=1, masters=3),
            32,  # sub-masters' workers share the one training set
            "too few training samples for 3 workers: 2 with --batch-size 32 leave a worker without a batch "
            "at some step; use at most 2 workers, or give more training samples",
        ),
        (
            5,
            Layout(workers=2, procs_per_worker=3),
            32,
            "too few training samples for 2 workers: 5 with --batch-size 32 leave a worker without at least 3 samples "
            "(one per process) at some step; use at most 1 worker, or give more training samples",
        ),
    ],
)
def test_too_few_samples_name_the_counts_and_the_fix(n, layout, batch_size, message):
    with pytest.raises(DataError) as err:
        check_data_size(arrays(n), layout, TrainOptions(batch_size=batch_size))
    assert str(err.value) == message


def test_the_sample_check_agrees_with_the_plan_the_workers_train_on():
    """Passes exactly when every worker's process gets a sample at every step of the
    topologies' own ShardPlan; and a suggested --batch-size works."""
    for n, workers, batch, procs, topology in itertools.product(
        range(1, 12), (1, 2, 3), (1, 2, 5), (1, 2), ("master-worker", "allreduce")
    ):
        layout = Layout(workers=workers, procs_per_worker=procs, topology=topology)
        shards = workers if topology == "master-worker" else layout.n_ranks
        each = procs if topology == "master-worker" else 1

        def fits(batch_size: int, n: int = n, shards: int = shards, each: int = each) -> bool:
            try:
                plan = ShardPlan(n, shards, batch_size)
            except ValueError:
                return False
            return all(len(b) >= each for s in range(shards) for b in plan.epoch(0, s))

        try:
            check_data_size(arrays(n), layout, TrainOptions(batch_size=batch))
        except DataError as exc:
            assert not fits(batch), (n, workers, batch, procs, topology)
            if "use --batch-size" in str(exc):
                assert fits(int(str(exc).split("use --batch-size ")[1].split()[0])), str(exc)
        else:
            assert fits(batch), (n, workers, batch, procs, topology)


def test_an_empty_validation_set_is_found_at_set_up():
    with pytest.raises(DataError, match=r"^the validation set is empty \(7 training and 0 validation samples\)"):
        check_data_size(arrays(7, n_val=0), Layout(workers=1), TrainOptions())


# ------------------------------------------------------------------------ --resume DIR
def _resume_args(path) -> argparse.Namespace:
    return build_parser().parse_args(["train", "--resume", str(path)])


def test_resume_of_what_is_not_a_run_directory_says_so(tmp_path):
    for path, problem in [
        (tmp_path / "no_such_run", "no such directory"),
        (tmp_path, "not a run directory (no options.json in it)"),
    ]:
        with pytest.raises(OptionsError) as err:
            options_from_args(_resume_args(path))
        assert str(err.value).startswith(f"--resume {path}: {problem}")
        assert "--model" not in str(err.value)


def test_resume_takes_the_saved_options(tmp_path):
    (tmp_path / "options.json").write_text(json.dumps(TrainOptions(model="m.py", epochs=7).to_dict()))
    assert saved_run_options(tmp_path).epochs == 7
    assert options_from_args(_resume_args(tmp_path)).model == "m.py"


def test_resume_from_a_notebook_is_checked_in_the_kernel(tmp_path):
    from nbdist.api import _for_the_engines

    with pytest.raises(OptionsError, match="no such directory"):
        _for_the_engines(TrainOptions(resume=str(tmp_path / "typo")), cell="model = None", model=None, data=None)


# ------------------------------------------------------------------ kinds of values
@pytest.mark.parametrize(
    "changes, message",
    [
        ({"epochs": "5"}, "--epochs must be a whole number, got '5'"),
        ({"workers": 2.5}, "--workers must be a whole number or None, got 2.5"),
        ({"synchronous": "yes"}, "--synchronous must be True or False, got 'yes'"),
        ({"min_delta": float("nan")}, "--min-delta must be a number, got nan"),
        ({"algorithm": 3}, "--algorithm must be a string or None, got 3"),
        ({"bucket_mb": 0}, "--bucket-mb must be above 0, got 0"),
        ({"min_delta": -0.1}, "--min-delta must be 0 or more"),
        ({"run_name": "exp/1"}, "--run-name 'exp/1': a directory name inside --runs-dir, without '/'"),
    ],
)
def test_option_values_of_the_wrong_kind_from_python(changes, message):
    with pytest.raises(OptionsError) as err:
        TrainOptions(**changes).validate()
    assert str(err.value).startswith(message)
    TrainOptions(workers=np.int64(2), min_delta=0, bucket_mb=1).validate()  # numpy's counts, ints for floats
    with pytest.raises(OptionsError, match="--trials must be a whole number, got '20'"):
        StudyOptions(space="lr=log(1e-3,1)", trials="20").validate()
    with pytest.raises(OptionsError, match="--study-name 'a/b': its trials' run directories are named after it"):
        StudyOptions(space="lr=log(1e-3,1)", study_name="a/b").validate()
