"""Search spaces: the compact text, skopt's dimensions, sampling, values, and the errors a
malformed space gives."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nbdist.errors import UserError
from nbdist.hpo import Categorical, Integer, Real, Space, SpaceError, as_space, parse_space

EXAMPLE = "lr=log(1e-4,1e-1) hidden=int(16,256) optimizer=cat(adam,sgd,rmsprop)"


def test_compact_form_gives_the_dimensions():
    space = parse_space(EXAMPLE)
    assert list(space) == ["lr", "hidden", "optimizer"]
    assert space["lr"] == Real(1e-4, 1e-1, prior="log-uniform")
    assert space["hidden"] == Integer(16, 256)
    assert space["optimizer"] == Categorical(["adam", "sgd", "rmsprop"])
    # blanks inside and around, commas or semicolons between parts, the other spellings
    other = parse_space(" lr = log(1e-4, 1e-1),hidden=int( 16 ,256 ); optimizer=CAT(adam, sgd, rmsprop) ")
    assert other == space
    assert parse_space("a=real(0,1) b=uniform(0,1) c=loguniform(1,10) d=logint(1,1000)") == Space(
        {"a": Real(0, 1), "b": Real(0, 1), "c": Real(1, 10, "log-uniform"), "d": Integer(1, 1000, "log-uniform")}
    )


def test_text_and_json_round_trips():
    space = parse_space(EXAMPLE + " act=cat('a b', 3, 2.5, True, None, '7') drop=real(0,0.5)")
    assert space["act"].categories == ("a b", 3, 2.5, True, None, "7")
    assert str(space) == (
        "lr=log(0.0001,0.1) hidden=int(16,256) optimizer=cat(adam,sgd,rmsprop) "
        "act=cat('a b',3,2.5,True,None,'7') drop=real(0.0,0.5)"
    )
    assert parse_space(str(space)) == space
    assert Space.from_json(json.loads(json.dumps(space.to_json()))) == space


def test_skopt_dimensions_and_dicts_are_accepted():
    from skopt.space import Categorical as SkCategorical
    from skopt.space import Integer as SkInteger
    from skopt.space import Real as SkReal

    expected = parse_space(EXAMPLE)
    skopt_list = [
        SkReal(1e-4, 1e-1, prior="log-uniform", name="lr"),
        SkInteger(16, 256, name="hidden"),
        SkCategorical(["adam", "sgd", "rmsprop"], name="optimizer"),
    ]
    assert as_space(skopt_list) == expected
    assert as_space(dict(zip(["lr", "hidden", "optimizer"], skopt_list, strict=True))) == expected
    mixed = {"lr": "log(1e-4,1e-1)", "hidden": Integer(16, 256), "optimizer": "cat(adam,sgd,rmsprop)"}
    assert as_space(mixed) == expected
    assert as_space(expected) is expected
    # and back to skopt, for the bayes searcher
    back = expected.to_skopt()
    assert [d.name for d in back] == ["lr", "hidden", "optimizer"] and back[0].prior == "log-uniform"
    with pytest.raises(SpaceError, match="has no name"):
        as_space([SkReal(0, 1)])


def test_samples_are_plain_python_values_from_the_priors():
    space = parse_space(EXAMPLE + " n=int(0,2)")
    rng = np.random.default_rng(0)
    points = [space.sample(rng) for _ in range(3000)]
    assert all(
        type(p["lr"]) is float and type(p["hidden"]) is int and type(p["n"]) is int and type(p["optimizer"]) is str
        for p in points
    )
    lr = np.array([p["lr"] for p in points])
    assert lr.min() >= 1e-4 and lr.max() <= 1e-1
    # log-uniform: each of the three decades gets about a third of the draws
    decades = np.histogram(np.log10(lr), bins=[-4, -3, -2, -1])[0] / len(lr)
    np.testing.assert_allclose(decades, [1 / 3] * 3, atol=0.04)
    # integer ends included, with their full share
    counts = np.bincount([p["n"] for p in points]) / len(points)
    np.testing.assert_allclose(counts, [1 / 3] * 3, atol=0.04)
    assert {p["optimizer"] for p in points} == {"adam", "sgd", "rmsprop"}
    logint = Integer(1, 3, "log-uniform")
    shares = np.bincount([logint.sample(rng) for _ in range(4000)], minlength=4)[1:] / 4000
    np.testing.assert_allclose(shares, np.log([2, 3 / 2, 4 / 3]) / np.log(4), atol=0.03)


def test_coerce_checks_and_converts_values():
    space = parse_space(EXAMPLE)
    assert space.coerce({"optimizer": "sgd", "lr": np.float64(0.01), "hidden": np.int64(32)}) == {
        "lr": 0.01,
        "hidden": 32,
        "optimizer": "sgd",
    }
    assert type(space.coerce({"lr": 0.01, "hidden": 32.0, "optimizer": "sgd"})["hidden"]) is int
    for params, message in [
        ({"lr": 0.5, "hidden": 32, "optimizer": "sgd"}, r"parameter 'lr': 0.5 is outside \[0.0001, 0.1\]"),
        ({"lr": 0.01, "hidden": 32.5, "optimizer": "sgd"}, "parameter 'hidden': value must be an integer, got 32.5"),
        ({"lr": 0.01, "hidden": 32, "optimizer": "adagrad"}, "parameter 'optimizer': 'adagrad' is not one of"),
        ({"lr": 0.01, "hidden": 32, "optimiser": "sgd"}, "unknown 'optimiser'; missing 'optimizer'"),
    ]:
        with pytest.raises(ValueError, match=message):
            space.coerce(params)
    flags = Categorical([True, 1, "1"])
    assert [flags.coerce(v) for v in ("1", 1, True)] == ["1", 1, True] and type(flags.coerce(1)) is int


def test_grids():
    assert Real(0, 1).grid(3) == [0.0, 0.5, 1.0]
    np.testing.assert_allclose(Real(1e-4, 1e-1, "log-uniform").grid(4), [1e-4, 1e-3, 1e-2, 1e-1])
    assert Integer(1, 3).grid(5) == [1, 2, 3]
    assert Integer(0, 100).grid(5) == [0, 25, 50, 75, 100]
    assert Integer(1, 1000, "log-uniform").grid(4) == [1, 10, 100, 1000]
    assert Categorical(["a", "b"]).grid(1) == ["a", "b"]


HELP = "e.g. 'lr=log(1e-4,1e-1) hidden=int(16,256) optimizer=cat(adam,sgd,rmsprop)'"


@pytest.mark.parametrize(
    "text, message",
    [
        ("lr=log(1e-4", "'lr=log(1e-4': missing ')'"),
        (
            "lr=lgo(1e-4,1e-1)",
            "'lr=lgo(1e-4,1e-1)': unknown kind 'lgo' (did you mean 'log'?); "
            "choose one of: cat, int, log, logint, loguniform, real, uniform",
        ),
        (
            "lr=log(1e-4)",
            "'lr=log(1e-4)': expected 2 numbers (low,high), got 1; write log(low,high) for a log-uniform real, 0 < low",
        ),
        (
            "lr=log(a,1e-1)",
            "'lr=log(a,1e-1)': 'a' is not a number; write log(low,high) for a log-uniform real, 0 < low",
        ),
        (
            "lr=log(0,1e-1)",
            "'lr=log(0,1e-1)': a log-uniform prior needs low > 0, got low=0.0; "
            "write log(low,high) for a log-uniform real, 0 < low",
        ),
        (
            "x=real(1,0)",
            "'x=real(1,0)': low must be below high, got low=1.0, high=0.0; write real(low,high) for a uniform real",
        ),
        ("x=real(0,)", "'x=real(0,)': an argument is empty; write real(low,high) for a uniform real"),
        (
            "n=int(1.5,4)",
            "'n=int(1.5,4)': low must be an integer, got 1.5; "
            "write int(low,high) for integers from low to high included",
        ),
        ("o=cat()", "'o=cat()': no category given; write cat(a,b,...) for one of the categories"),
        (
            "o=cat(adam,adam)",
            "'o=cat(adam,adam)': category 'adam' is given twice; write cat(a,b,...) for one of the categories",
        ),
        ("lr=log(1e-4,1e-1) hidden=int(16,256) lr=real(0,1)", "'lr=real(0,1)': parameter 'lr' is given twice"),
        ("1lr=real(0,1)", "'1lr=real(0,1)': parameter name '1lr' must be a Python identifier (letters, digits, _)"),
        ("lr log(1e-4,1e-1)", f"cannot read 'lr log(1e-4,1e-1)' in the space: write name=kind(args), {HELP}"),
        ("lr=log(1e-4,1e-1) hidden", f"cannot read 'hidden' in the space: write name=kind(args), {HELP}"),
        ("   ", f"the space is empty; write {HELP}"),
    ],
)
def test_malformed_spaces_name_the_bad_part(text, message):
    with pytest.raises(SpaceError) as err:
        parse_space(text)
    assert str(err.value) == message
    assert isinstance(err.value, UserError) and isinstance(err.value, ValueError)


def test_bad_dimensions_in_python():
    with pytest.raises(SpaceError, match="prior must be one of uniform, log-uniform, got 'log'"):
        Real(1e-4, 1e-1, prior="log")
    with pytest.raises(SpaceError, match="categories must be strings, numbers"):
        Categorical([(64, 64), (128,)])
    with pytest.raises(SpaceError, match=r"parameter 'lr': 3 is not a dimension"):
        as_space({"lr": 3})
    with pytest.raises(SpaceError, match="parameter 'lr': write one dimension"):
        as_space({"lr": "log(1,2) x=real(0,1)"})
