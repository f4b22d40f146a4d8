"""Specs (`name(key=value)`), TrainOptions validation, targets and the argparse round trip."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from nbdist.errors import OptionsError, UserError
from nbdist.options import Target, TrainOptions, add_arguments, options_from_args, parse_target
from nbdist.specs import Spec, SpecError, check_kwargs, parse_spec, unknown_name


# ----------------------------------------------------------------------------- specs
@pytest.mark.parametrize(
    "text, name, kwargs",
    [
        ("adam", "adam", {}),
        ("  Adam  ", "adam", {}),
        ("adam()", "adam", {}),
        ("adam(lr=1e-3, betas=(0.9, 0.99))", "adam", {"lr": 1e-3, "betas": (0.9, 0.99)}),
        ("sgd(lr=0.1, momentum=0.9, nesterov=True)", "sgd", {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
        ("easgd(elastic_force=None, elastic_lr=-0.5)", "easgd", {"elastic_force": None, "elastic_lr": -0.5}),
        ("x(mode='fast', sizes=[1, 2])", "x", {"mode": "fast", "sizes": [1, 2]}),
    ],
)
def test_parse_spec_forms(text, name, kwargs):
    spec = parse_spec(text)
    assert spec == Spec(name, kwargs)
    assert type(spec.kwargs.get("betas", ())) is tuple


def test_parse_spec_passes_specs_and_mappings():
    spec = Spec("adam", {"lr": 0.1})
    assert parse_spec(spec) is spec
    assert parse_spec({"name": "SGD", "lr": 0.5}) == Spec("sgd", {"lr": 0.5})
    with pytest.raises(SpecError, match="needs a 'name'"):
        parse_spec({"lr": 0.5})


@pytest.mark.parametrize(
    "text, message",
    [
        ("adam(0.001)", "keyword arguments only"),
        ("adam(0.001, betas=(0.9, 0.99))", "keyword arguments only"),
        ("adam(lr=x)", "must be a literal"),
        ("adam(lr=1e-3 * 2)", "must be a literal"),
        ("adam(lr=__import__('os').getcwd())", "must be a literal"),
        ("adam(lr={[1]})", "must be a literal"),
        ("adam(**opts)", r"\*\*kwargs is not allowed"),
        ("adam(lr=0.1, lr=0.2)", "lr is given twice"),
        ("adam(lr=", "cannot read"),
        ("", "cannot read"),
        ("adam lr=1", "cannot read"),
        ("torch.optim.adam(lr=1)", "cannot read"),
        ("42", "cannot read"),
        ("'adam'", "cannot read"),
    ],
)
def test_parse_spec_errors(text, message):
    with pytest.raises(SpecError, match=message) as err:
        parse_spec(text, what="--worker-optimizer")
    assert "--worker-optimizer" in str(err.value)
    assert isinstance(err.value, UserError) and isinstance(err.value, ValueError)


def test_spec_str_and_defaults():
    spec = parse_spec("adam(lr=0.001, betas=(0.9, 0.99))")
    assert str(spec) == "adam(lr=0.001, betas=(0.9, 0.99))"
    assert parse_spec(str(spec)) == spec
    assert str(Spec("sgd")) == "sgd"
    assert spec.with_defaults(lr=1.0, eps=1e-6) == Spec("adam", {"lr": 0.001, "betas": (0.9, 0.99), "eps": 1e-6})


def test_check_kwargs_and_unknown_name():
    def f(self, a, b=1, *, c=2):
        pass

    check_kwargs("thing", f, {"a": 1, "c": 3}, skip=1)
    with pytest.raises(SpecError, match=r"thing takes no parameter 'd'; it takes: a, b, c"):
        check_kwargs("thing", f, {"d": 1}, skip=1)
    check_kwargs("thing", lambda **kw: None, {"anything": 1})
    assert "did you mean 'gem'" in str(unknown_name("algorithm", "gen", ["gem", "adag"]))
    text = str(unknown_name("algorithm", "zzz", ["gem", "adag"]))
    assert "did you mean" not in text and "choose one of: adag, gem" in text


# ----------------------------------------------------------------------------- options
def test_defaults_validate():
    opts = TrainOptions().validate()
    assert opts.topology == "master-worker" and opts.epochs == 5 and opts.batch_size == 32


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"topology": "ring"}, "unknown topology 'ring'"),
        ({"device": "gpu"}, "unknown --device 'gpu'; choose one of: auto, cpu, cuda"),
        ({"busy_poll": "yes"}, "unknown --busy-poll 'yes'; choose one of: auto, on, off"),
        ({"epochs": 0}, "--epochs must be at least 1"),
        ({"batch_size": -3}, "--batch-size must be at least 1"),
        ({"masters": 0}, "--masters must be at least 1"),
        ({"procs_per_worker": 0}, "--procs-per-worker must be at least 1"),
        ({"validate_every": 0}, "--validate-every must be at least 1"),
        ({"threads": 0}, "--threads must be at least 1"),
        ({"workers": 0}, "--workers must be at least 1"),
        ({"sync_every": 0}, "--sync-every must be at least 1"),
        ({"early_stopping": 0}, "--early-stopping must be at least 1"),
        ({"checkpoint_every": -1}, "--checkpoint-every"),
        ({"target": "val_acc ~ 0.9"}, "cannot read --target"),
        ({"topology": "allreduce", "masters": 2}, "allreduce has no master"),
        ({"precision": "fp8"}, r"--precision 'fp8': choose one of fp32, bf16, fp16$"),
        ({"precision": "bf16", "gan": True}, "--gan trains in fp32"),
    ],
)
def test_validate_errors(changes, message):
    with pytest.raises(OptionsError, match=message):
        TrainOptions(**changes).validate()


def test_from_dict_round_trip_and_unknown_keys():
    opts = TrainOptions(epochs=3, algorithm="easgd(elastic_force=0.5)", synchronous=True, target="val_acc > 0.9")
    assert TrainOptions.from_dict(opts.to_dict()) == opts
    with pytest.raises(OptionsError, match="unknown option.*epoch, lr"):
        TrainOptions.from_dict({"epoch": 3, "lr": 0.1})
    assert opts.replace(epochs=7).epochs == 7 and opts.epochs == 3


# ----------------------------------------------------------------------------- targets
@pytest.mark.parametrize(
    "text, metric, op, value",
    [
        ("val_acc > 0.97", "val_acc", ">", 0.97),
        ("val_acc>=0.97", "val_acc", ">=", 0.97),
        ("  val_loss < 1e-3 ", "val_loss", "<", 1e-3),
        ("train.loss <= -2", "train.loss", "<=", -2.0),
    ],
)
def test_parse_target(text, metric, op, value):
    assert parse_target(text) == Target(metric, op, value)


@pytest.mark.parametrize(
    "text",
    [
        "val_acc",
        "val_acc = 0.9",
        "> 0.9",
        "val_acc > abc",
        "val_acc > e",
        "val_acc > 0.9.1",
        "1acc > 0.5",
        "val_acc > 0.9 and x",
    ],
)
def test_parse_target_errors(text):
    with pytest.raises(OptionsError, match="--target"):
        parse_target(text)


def test_target_reached():
    gt, ge = parse_target("val_acc > 0.9"), parse_target("val_acc >= 0.9")
    lt, le = parse_target("val_loss < 0.5"), parse_target("val_loss <= 0.5")
    assert not gt.reached({"val_acc": 0.9}) and ge.reached({"val_acc": 0.9})
    assert gt.reached({"val_acc": 0.91}) and not ge.reached({"val_acc": 0.89})
    assert not lt.reached({"val_loss": 0.5}) and le.reached({"val_loss": 0.5})
    assert lt.reached({"val_loss": 0.1}) and not le.reached({"val_loss": 0.6})
    assert not gt.reached({"val_loss": 0.99})  # another metric
    assert not gt.reached({"val_acc": float("nan")})
    assert gt.reached({"val_acc": 1})  # ints count
    assert str(gt) == "val_acc > 0.9"


# ----------------------------------------------------------------------------- argparse
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(p)
    return p


def test_every_option_has_a_flag():
    p = parser()
    dests = {a.dest for a in p._actions}
    for f in dataclasses.fields(TrainOptions):
        assert f.name in dests


def test_argparse_round_trip():
    argv = [
        "--epochs",
        "3",
        "--algorithm",
        "easgd(elastic_force=0.5)",
        "--synchronous",
        "--bucket-mb",
        "0.5",
        "--workers",
        "2",
        "--topology",
        "allreduce",
        "--min-delta",
        "1e-3",
        "--target",
        "val_acc > 0.9",
        "--worker-optimizer",
        "adam(lr=1e-3)",
        "--sync-every",
        "4",
    ]
    opts = options_from_args(parser().parse_args(argv))
    expected = TrainOptions(
        epochs=3,
        algorithm="easgd(elastic_force=0.5)",
        synchronous=True,
        bucket_mb=0.5,
        workers=2,
        topology="allreduce",
        min_delta=1e-3,
        target="val_acc > 0.9",
        worker_optimizer="adam(lr=1e-3)",
        sync_every=4,
    )
    assert opts == expected
    assert type(opts.epochs) is int and type(opts.bucket_mb) is float and type(opts.workers) is int
    # Nothing given: the defaults, or the base (a resumed run's options) where given.
    assert options_from_args(parser().parse_args([])) == TrainOptions()
    base = TrainOptions(epochs=9, seed=4, synchronous=True)
    merged = options_from_args(parser().parse_args(["--epochs", "2"]), base)
    assert merged == TrainOptions(epochs=2, seed=4, synchronous=True)


def test_argparse_round_trip_of_every_field(tmp_path):
    """Options with every field off its default survive options -> argv -> options."""
    run = tmp_path / "x"  # --resume reads the run's saved options: a real run directory
    run.mkdir()
    (run / "options.json").write_text(json.dumps(TrainOptions().to_dict()))
    changed = dict(
        model="m.py",
        topology="allreduce",
        algorithm="gem(lr=0.1)",
        synchronous=True,
        workers=3,
        masters=2,
        procs_per_worker=2,
        worker_parallel="pipeline",
        micro_batches=3,
        pipeline_schedule="gpipe",
        epochs=4,
        batch_size=16,
        sync_every=2,
        worker_optimizer="sgd(lr=0.2)",
        master_optimizer="adam",
        momentum_correction="off",
        seed=5,
        validate_every=2,
        validate_every_samples=500,
        early_stopping=3,
        monitor="val_acc",
        min_delta=0.01,
        target="val_loss < 0.2",
        checkpoint_every=3,
        keep_checkpoints=5,
        resume=str(run),
        max_restarts=2,
        peer_timeout=7.5,
        runs_dir="elsewhere",
        store="runs/other.db",
        run_name="r1",
        threads=2,
        bucket_mb=4.0,
        compression="topk(0.05)",
        allreduce_backend="gloo",
        quiet=True,
        train="t_*.h5",
        val="v.h5",
        cache_dir="/tmp/c",
        device="cpu",
        busy_poll="off",
        data_keys="x,y",
        gan=True,
        d_steps=2,
        lr_scaling="sqrt",
        warmup_epochs=1.5,
        worker_lr_schedule="steplr(step_size=2)",
        master_lr_schedule="cosineannealinglr(T_max=4)",
        trace_updates=True,
        precision="bf16",
        sync_batchnorm=True,
        warm_start_epochs=1,
    )
    assert set(changed) == {f.name for f in dataclasses.fields(TrainOptions)}
    opts = TrainOptions(**changed)
    argv = []
    for f in dataclasses.fields(TrainOptions):
        value = getattr(opts, f.name)
        flag = "--" + f.name.replace("_", "-")
        if value is True:
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    assert options_from_args(parser().parse_args(argv)) == opts


def test_argparse_rejects_bad_values():
    with pytest.raises(argparse.ArgumentError):
        parser().parse_args(["--topology", "ring"])
    with pytest.raises(argparse.ArgumentError):
        parser().parse_args(["--epochs", "three"])
    with pytest.raises(argparse.ArgumentError, match="choose from 'fp32', 'bf16', 'fp16'"):
        parser().parse_args(["--precision", "half"])


def test_skip_leaves_flags_out():
    p = argparse.ArgumentParser()
    add_arguments(p, skip=("model", "resume"))
    dests = {a.dest for a in p._actions}
    assert "model" not in dests and "resume" not in dests and "epochs" in dests
    opts = options_from_args(p.parse_args(["--epochs", "2"]))
    assert opts.model is None and opts.epochs == 2


def test_downpour_pushing_every_batch_rejects_a_worker_optimizer():
    from nbdist.errors import OptionsError
    from nbdist.train.rules import resolve_rules

    with pytest.raises(OptionsError, match="downpour with --sync-every 1 takes no worker optimizer"):
        resolve_rules(TrainOptions(algorithm="downpour", worker_optimizer="sgd(lr=1e6)"))
    algorithm, sync_every, worker, master = resolve_rules(
        TrainOptions(algorithm="downpour", sync_every=4, worker_optimizer="adam(lr=1e-3)")
    )
    assert sync_every == 4 and worker.name == "adam" and master.name == "sgd"
