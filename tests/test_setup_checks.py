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


@pytest.mark.parametrize("given", [["--micro-batches", "4"], ["--pipeline-schedule", "gpipe"]])
def test_pipeline_options_at_their_defaults_without_a_pipeline_are_refused_too(given):
    """The values alone (4, gpipe: the defaults) cannot tell them from nothing; that the
    user gave them can: the command line, the notebook's call and a study's options."""
    from nbdist.api import _options
    from nbdist.hpo.study_setup import resolve_options

    args = build_parser().parse_args(["train", "--model", "m.py", *given])
    name = given[0][2:].replace("-", "_")
    value = int(given[1]) if name == "micro_batches" else given[1]
    message = f"{given[0]} applies to pipeline workers: add --worker-parallel pipeline"
    for make in (
        lambda: options_from_args(args),
        lambda: _options({name: value}),
        lambda: resolve_options({}, {name: value}),
    ):
        with pytest.raises(OptionsError, match=message):
            make()
    piped = ["--worker-parallel", "pipeline", "--procs-per-worker", "2"]
    assert options_from_args(build_parser().parse_args(["train", "--model", "m.py", *given, *piped]))


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"precision": "bf16"},
            "--precision bf16 does not apply to --worker-parallel pipeline: its stages train in fp32",
        ),
        ({"gan": True}, "--gan does not apply to --worker-parallel pipeline"),
    ],
)
def test_a_pipeline_refuses_what_its_stages_cannot_train_by_name(changes, message):
    with pytest.raises(OptionsError) as err:
        TrainOptions(worker_parallel="pipeline", procs_per_worker=2, **changes).validate()
    assert str(err.value).startswith(message)


def test_a_load_data_that_raises_is_named_with_its_file_and_line(tmp_path):
    """The GAN page's snippet saved as it stood (no imports) said only "setup failed:
    NameError: name 'nbdist' is not defined"."""
    from nbdist.backends.base import ModelError
    from nbdist.train.definition import load_model_file

    model = tmp_path / "snippet.py"
    model.write_text("def build_model():\n    return None\n\ndef load_data():\n    return nbdist.datasets.digits()\n")
    with pytest.raises(ModelError) as err:
        load_model_file(model).make_data()
    assert str(err.value) == (
        f"model file {model}: load_data() failed: NameError: name 'nbdist' is not defined (snippet.py, line 5)"
    )


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


# ------------------------------------------- issue 25: labels, batches, loss, parameters
# The pure parts of the checks tests/test_bad_input.py runs under mpiexec: each with the
# values on both sides of its line.
def _digits_like(y_train, y_val, num_classes=None):
    x = np.zeros((len(y_train), 4), np.float32)
    return ArrayData(x, np.asarray(y_train), x[: len(y_val)], np.asarray(y_val), num_classes=num_classes)


def _torch_backend(outputs: int, loss=None):
    from torch import nn

    from nbdist.backends.torch import TorchBackend

    return TorchBackend(nn.Sequential(nn.Linear(4, outputs)), loss)


def test_labels_are_checked_against_the_outputs_and_the_declared_classes():
    from torch import nn

    from nbdist.backends.base import ModelError
    from nbdist.train.data_checks import check_labels

    x = np.zeros((2, 4), np.float32)
    check_labels(_digits_like([0, 4, 2], [1]), _torch_backend(5), x, "m.py")  # labels 0-4 of 5 outputs
    with pytest.raises(ModelError, match=r"^m.py: the labels run from 0 to 5, but the model scores 5 classes"):
        check_labels(_digits_like([0, 4, 2], [5]), _torch_backend(5), x, "m.py")  # a validation label too
    with pytest.raises(ModelError, match=r"the labels run from -1 to 3"):
        check_labels(_digits_like([-1, 3], [1]), _torch_backend(5), x, "m.py")
    check_labels(_digits_like([-100, 3], [1]), _torch_backend(5), x, "m.py")  # cross-entropy's ignore_index
    with pytest.raises(DataError, match=r"outside the data's 10 classes \(num_classes=10: labels 0 to 9\)"):
        check_labels(_digits_like([0, 42], [1], num_classes=10), _torch_backend(50), x, "m.py")
    # A loss that does not index classes by the label (a regression), or float labels: not checked.
    check_labels(_digits_like([0, 9], [1]), _torch_backend(1, nn.MSELoss()), x, "m.py")
    check_labels(_digits_like([0.0, 9.0], [1.0]), _torch_backend(5), x, "m.py")


def test_a_batch_larger_than_a_workers_share_is_one_warning():
    from nbdist.train.data_checks import batch_notices

    data = _digits_like(np.zeros(100, int), [0])
    assert batch_notices(data, Layout(workers=2), TrainOptions(batch_size=50)) == []  # 50 per worker: fits
    [notice] = batch_notices(data, Layout(workers=2), TrainOptions(batch_size=51))
    assert notice.warning and "--batch-size 51 is larger than a worker's share" in notice.text
    assert "(50 of 100 samples over 2 workers)" in notice.text and "give --batch-size 50 or less" in notice.text
    allreduce = Layout(workers=4, topology="allreduce")
    assert batch_notices(data, allreduce, TrainOptions(batch_size=25, topology="allreduce")) == []


def test_a_loss_that_grows_by_orders_of_magnitude_warns_once():
    from nbdist.train.loop import LossGrowth

    watch = LossGrowth(2.3)  # the untrained model's
    assert watch.check(1, 2.0) is None and watch.check(2, 229.0) is None  # under 100x the start
    warning = watch.check(3, 231.0)
    assert warning.startswith("the training loss grew to 231 at epoch 3 (from 2.3 before training, lowest 2)")
    assert "lower the learning rate" in warning
    assert watch.check(4, 1e9) is None  # once per run
    # From a low point: 1000x the lowest, once above where it started.
    watch = LossGrowth(2.3)
    assert watch.check(1, 0.001) is None and watch.check(2, 2.0) is None
    assert watch.check(3, 2.4) is not None
    # Without the probe's loss the first epoch's is the reference; NaN is check_loss's business.
    watch = LossGrowth(None)
    assert watch.check(1, 5.0) is None and watch.check(2, float("nan")) is None
    assert "(from 5 at epoch 1)" in watch.check(3, 501.0)


def test_an_lr_of_zero_is_refused_when_the_optimizer_is_checked():
    from nbdist.specs import SpecError, parse_spec

    backend = _torch_backend(2)
    assert backend.check_optimizer(parse_spec("sgd(lr=0.01)")) == 0.01
    for spec in ("sgd(lr=0)", "adam(lr=0.0)"):
        with pytest.raises(SpecError, match=r"a learning rate of 0 never changes the weights"):
            backend.check_optimizer(parse_spec(spec))


MODEL_FILE = """
from torch import nn

def build_model(params):
    hidden = int(params.get("hidden", 8))
    widths = [params[f"layer{i}"] for i in range(2) if f"layer{i}" in params]
    return nn.Sequential(nn.Linear(64, hidden), nn.Linear(hidden, 10))
"""


@pytest.mark.parametrize(
    "space, unread",
    [
        ("hidden=int(4,8) lr=log(1e-3,0.1) batch_size=int(8,64) optimizer=cat(sgd,adam)", []),
        ("hidden=int(4,8) layer0=int(2,4) layer1=int(2,4)", []),  # names made at run time: found by a call
        ("hidden=int(4,8) momentom=real(0,1)", ["momentom"]),
        ("hiden=int(4,8) layer2=int(2,4)", ["hiden", "layer2"]),
    ],
)
def test_a_study_parameter_nothing_reads_is_found(tmp_path, space, unread):
    from nbdist.hpo.reads import unread_params
    from nbdist.hpo.space_input import parse_space
    from nbdist.train.definition import load_model_file

    (tmp_path / "m.py").write_text(MODEL_FILE)
    parsed = parse_space(space)
    found, read_by = unread_params(
        list(parsed), load_model_file(tmp_path / "m.py"), parsed.sample(np.random.default_rng(0))
    )
    assert found == unread
    assert read_by["build_model"][0]  # it takes the parameters


def test_a_builder_without_parameters_reads_none_and_one_that_takes_them_all_reads_all(tmp_path):
    from nbdist.hpo.reads import check_params_read
    from nbdist.hpo.space_input import parse_space
    from nbdist.hpo.trial import TrialError
    from nbdist.train.definition import load_model_file

    space = parse_space("hidden=int(4,8) lr=log(1e-3,0.1)")
    (tmp_path / "plain.py").write_text("from torch import nn\ndef build_model():\n    return nn.Linear(64, 10)\n")
    with pytest.raises(
        TrialError,
        match=r"'hidden' is read by no part of the run; those read are: lr\. .*"
        r"goes to build_model\(\), which takes no parameters",
    ):
        check_params_read(space, load_model_file(tmp_path / "plain.py"), {"hidden": 4, "lr": 0.01})
    (tmp_path / "all.py").write_text(
        "from torch import nn\ndef make(hidden, lr):\n    return nn.Linear(64, hidden)\n"
        "def build_model(params):\n    return make(**params)\n"
    )
    check_params_read(space, load_model_file(tmp_path / "all.py"), {"hidden": 4, "lr": 0.01})


def test_interfaces_and_ports_are_checked_against_what_exists():
    import psutil

    from nbdist.dashboard.serve import DashboardError, check_port
    from nbdist.errors import UserError
    from nbdist.launch import check_interface

    names = sorted(psutil.net_if_addrs())
    check_interface(names[0])
    check_interface(",".join(names))
    check_interface("127.0.0.0/8")  # a subnet of this node's loopback address
    with pytest.raises(
        UserError,
        match=rf"--interface 'nosuch0': this node has no such network interface; "
        rf"choose one of: {', '.join(names)} \(or a subnet",
    ):
        check_interface(f"{names[0]},nosuch0")
    import ipaddress

    mine = [ipaddress.ip_address(a.address) for found in psutil.net_if_addrs().values() for a in found if a.family == 2]
    # A documentation subnet (RFC 5737) that holds none of this node's addresses.
    elsewhere = next(
        net
        for net in ("198.51.100.0/24", "203.0.113.0/24", "192.0.2.0/24")
        if not any(address in ipaddress.ip_network(net) for address in mine)
    )
    with pytest.raises(UserError, match=rf"--interface {elsewhere}: no network interface of this node"):
        check_interface(elsewhere)
    for port in (0, 1, 65535):
        check_port(port)
    for port in (-1, 65536, 99999):
        with pytest.raises(DashboardError, match=rf"--port {port}: a port is a number from 1 to 65535, or 0"):
            check_port(port)
