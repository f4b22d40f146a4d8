"""The performance model and the simulator against closed forms, and their inputs through
JSON and the run store (pure: no MPI)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from nbdist.errors import OptionsError, UserError
from nbdist.scaling import Calibration, Machine, PerformanceModel, SetUp, Simulator, Stragglers, network
from nbdist.scaling.analysis import between_nodes
from nbdist.scaling.goodput import samples_needed_ratio, staleness_penalty
from nbdist.scaling.options import MIN_POINT_SECONDS, ScaleOptions, default_ranks, parse_ranks, parse_setups
from nbdist.scaling.queueing import mva
from nbdist.scaling.store import ScaleRecorder, load_calibration
from nbdist.store import RunStore
from nbdist.train.loop import REPORT_EVERY

Z, S = 4e-3, 5e-4  # a worker's compute per exchange, the master's service per update
RULES = ("downpour", "easgd")


def calibration(**changes) -> Calibration:
    """Inputs with every cost but the compute Z and the master's service S at zero, and no
    spread: the deterministic network whose closed forms are known."""
    values = dict(
        model="toy",
        params=1000,
        state=0,
        batch_size=32,
        cores=64,
        step_s=Z,
        per_sample_s=0.0,
        busy_factor=1.0,
        spread=[1.0],
        allreduce_loop_s=0.0,
        worker_step_s=dict.fromkeys(RULES, 0.0),
        worker_exchange_s=dict.fromkeys(RULES, 0.0),
        p2p_alpha_s=0.0,
        p2p_beta_s=1e-15,
        allreduce_alpha_s=1e-5,
        allreduce_beta_s=1e-10,
        apply_s=dict.fromkeys(RULES, 0.0),
        master_fixed_s=S,
        client_test_s=0.0,
        reply_latency_s=0.0,
        poll_sleep_s=2e-4,
        train_samples=1000,
        noise_scale=100.0,
        noise_range=(80.0, 120.0),
    )
    values.update(changes)
    return Calibration(**values)


def dedicated(cal: Calibration | None = None) -> PerformanceModel:
    return PerformanceModel(cal or calibration(), Machine(64, network("ib-hdr")))


DOWNPOUR = SetUp("master-worker", "downpour")


@pytest.mark.parametrize("workers", [1, 2, 4, 8, 16, 32, 64])
def test_simulated_throughput_is_the_closed_form_for_deterministic_times(workers):
    """X = min(W / (Z + S), 1 / S) when compute and service never vary."""
    sim = Simulator(dedicated(), pass_updates=1)
    result = sim.run(DOWNPOUR, workers + 1, cycles=60)
    updates_per_s = result.samples_per_s / 32
    assert updates_per_s == pytest.approx(min(workers / (Z + S), 1 / S), rel=0.01)


def test_a_single_worker_is_the_plain_loop():
    """One worker alternates compute and service: one update per Z + S + its message's way,
    in the simulator and in the model."""
    cal = calibration(reply_latency_s=2e-4, worker_exchange_s=dict.fromkeys(RULES, 1e-4))
    cycle = Z + 1e-4 + S + 2e-4
    model = dedicated(cal)
    assert model.predict(DOWNPOUR, 2).samples_per_s == pytest.approx(32 / cycle, rel=1e-9)
    assert Simulator(model).run(DOWNPOUR, 2).samples_per_s == pytest.approx(32 / cycle, rel=1e-6)


@pytest.mark.parametrize("workers", [4, 16, 64])
def test_staleness_at_saturation_approaches_w_minus_1(workers):
    """A saturated FIFO master serves the workers round robin: each update finds the other
    W - 1 applied since its worker's reply."""
    cal = calibration(master_fixed_s=Z)  # S = Z: saturated from 2 workers on
    result = Simulator(dedicated(cal), pass_updates=1).run(DOWNPOUR, workers + 1, cycles=40)
    assert result.staleness_mean == pytest.approx(workers - 1, abs=0.05)
    assert result.master_utilisation == pytest.approx(1.0, abs=0.02)


def test_the_model_meets_both_asymptotes_and_the_knee_where_the_closed_form_puts_it():
    model = dedicated()
    assert model.saturation(DOWNPOUR) == pytest.approx((Z + S) / S, rel=1e-6)
    few, many = model.predict(DOWNPOUR, 2), model.predict(DOWNPOUR, 1 + 256)
    assert few.samples_per_s / 32 == pytest.approx(1 / (Z + S), rel=1e-9)
    assert many.samples_per_s / 32 == pytest.approx(1 / S, rel=1e-3)
    for workers in (2, 4, 8, 9, 16, 32):
        predicted = model.predict(DOWNPOUR, workers + 1).samples_per_s / 32
        assert predicted <= min(workers / (Z + S), 1 / S) * (1 + 1e-9)


@pytest.mark.parametrize("workers", [2, 5, 9, 20, 60])
def test_model_and_simulator_agree_on_a_random_compute_time(workers):
    """With a spread of step times and nbdist's passes of two updates, the model's
    throughput and mean staleness are within a few per cent of the simulator's."""
    spread = list(np.linspace(0.7, 1.3, 21))
    model = dedicated(calibration(spread=spread, client_test_s=1e-6))
    predicted = model.predict(DOWNPOUR, workers + 1)
    simulated = Simulator(model, seed=3).run(DOWNPOUR, workers + 1, cycles=60)
    assert predicted.samples_per_s == pytest.approx(simulated.samples_per_s, rel=0.06)
    assert predicted.staleness_mean == pytest.approx(simulated.staleness_mean, rel=0.06, abs=0.1)


def test_allreduce_waits_for_the_slowest_rank():
    """Deterministic: every step is Z plus the reduction; with a straggler every step
    takes the straggler's time."""
    model = dedicated()
    point = model.predict(SetUp("allreduce"), 8)
    assert point.step_s == pytest.approx(Z + model.allreduce_s(8, 4000), rel=1e-9)
    assert Simulator(model).run(SetUp("allreduce"), 8).step_s == pytest.approx(point.step_s, rel=1e-9)
    slow = Simulator(model, stragglers=Stragglers(fraction=1 / 8, slowdown=2.0)).run(SetUp("allreduce"), 8)
    assert slow.step_s == pytest.approx(2 * Z + model.allreduce_s(8, 4000), rel=1e-9)


def test_ring_and_tree_allreduce_terms():
    cal = calibration(allreduce_alpha_s=1e-5, allreduce_beta_s=1e-9)
    model = PerformanceModel(cal, Machine(1, network("ib-hdr")), bucket_bytes=10**9)
    net = network("ib-hdr")
    nbytes = 10**6
    ring = 2 * 7 * net.latency_s + 2 * 7 / 8 * nbytes * net.beta_s
    tree = 3 * net.latency_s + 3 * nbytes * net.beta_s
    assert model.allreduce_s(8, nbytes, "ring") == pytest.approx(ring)
    assert model.allreduce_s(8, nbytes, "tree") == pytest.approx(tree)
    assert model.allreduce_s(8, nbytes) == pytest.approx(min(ring, tree))


def test_shared_cores_take_turns():
    """Four allreduce ranks on two cores compute twice as long as two."""
    model = PerformanceModel(calibration(), Machine(2, network("ib-hdr"), nodes=1))
    two, four = model.predict(SetUp("allreduce"), 2), model.predict(SetUp("allreduce"), 4)
    assert four.oversubscribed and not two.oversubscribed
    assert four.compute_s == pytest.approx(2 * two.compute_s)
    assert four.samples_per_s < 1.05 * two.samples_per_s


def test_exact_mva_of_one_worker():
    closed = mva(1, Z, S)
    assert closed.x == pytest.approx(1 / (Z + S)) and closed.r == pytest.approx(S)


def test_sub_masters_spread_a_saturated_master():
    """With the master saturated, two masters serve more updates than one, less than
    twice as many (a sub-master's push waits in the top master's queue): as simulated."""
    model = dedicated(calibration(master_fixed_s=Z / 2))
    one = model.predict(DOWNPOUR, 17).samples_per_s
    two = model.predict(DOWNPOUR.with_masters(2), 18).samples_per_s
    simulated = Simulator(model).run(DOWNPOUR.with_masters(2), 18).samples_per_s
    assert one * 1.2 < two < one * 2
    assert two == pytest.approx(simulated, rel=0.05)


def test_a_thousand_ranks_simulate():
    result = Simulator(dedicated(calibration(master_fixed_s=2e-5))).run(DOWNPOUR, 1025, cycles=5)
    assert result.updates > 1024 and result.staleness.size > 1024


def test_goodput_costs_samples_with_the_total_batch_and_with_staleness():
    model = dedicated()
    one = model.predict(SetUp("allreduce"), 1)
    many = model.predict(SetUp("allreduce"), 64)
    asynchronous = model.predict(DOWNPOUR, 65)
    assert samples_needed_ratio(one, 100.0) == pytest.approx(1.0)
    assert samples_needed_ratio(many, 100.0) == pytest.approx((1 + 64 * 32 / 100) / (1 + 32 / 100))
    assert staleness_penalty(0.0) == 1.0
    assert samples_needed_ratio(asynchronous, 100.0) > samples_needed_ratio(many, 100.0)
    assert math.isclose(samples_needed_ratio(many, math.inf), 1.0)


def test_calibration_round_trips_through_json_and_the_run_store(tmp_path):
    cal = calibration()
    assert Calibration.from_dict(cal.to_dict()) == cal
    recorder = ScaleRecorder(str(tmp_path / "nbdist.db"), "study-1", str(tmp_path), {"model": "toy"})
    recorder.add("calibration", cal.to_dict())
    recorder.finish("completed", "test")
    with RunStore(tmp_path / "nbdist.db") as store:
        again = load_calibration(store, "study-1")
        assert store.run("study-1").kind == "scale"
    assert again == cal
    machine = Machine(16, network("ethernet-10g"))
    for ranks in (2, 17, 1024):
        assert PerformanceModel(again, machine).predict(DOWNPOUR, ranks) == PerformanceModel(cal, machine).predict(
            DOWNPOUR, ranks
        )


def test_the_network_measured_between_nodes_is_the_default_where_there_is_one(tmp_path):
    """A calibration on ranks of two nodes carries its measured link: it survives the store,
    is the default network of the predictions, and a slower link predicts a slower allreduce
    across nodes; on one node a preset stands in and asking for `measured` is one error."""
    one_node = calibration()
    assert between_nodes(one_node, None) == network("ib-hdr")
    assert between_nodes(one_node, "ethernet-10g") == network("ethernet-10g")
    with pytest.raises(OptionsError, match="--network measured: the calibration's ranks were all on one node"):
        between_nodes(one_node, "measured")
    two_nodes = calibration(between_nodes=(40e-6, 1e-9))  # slower than any preset but 1 Gb/s
    assert Calibration.from_dict(json.loads(json.dumps(two_nodes.to_dict()))) == two_nodes
    link = between_nodes(two_nodes, None)
    assert link.name == "measured" and link.latency_s == 40e-6 and link.bandwidth == pytest.approx(1e9)
    measured = PerformanceModel(two_nodes, Machine(16, link)).predict(SetUp("allreduce"), 64)
    preset = PerformanceModel(two_nodes, Machine(16, network("ib-hdr"))).predict(SetUp("allreduce"), 64)
    assert measured.samples_per_s < preset.samples_per_s
    assert ScaleOptions(model="m.py", network="measured").validate().network == "measured"


def test_bad_scale_options_are_one_clear_error():
    with pytest.raises(OptionsError, match="--model is required"):
        ScaleOptions().validate()
    with pytest.raises(UserError, match="unknown set-up 'downpuor'.*did you mean 'downpour'"):
        parse_setups("allreduce downpuor")
    with pytest.raises(UserError, match="unknown network preset 'infiniband'"):
        ScaleOptions(model="m.py", network="infiniband").validate()
    with pytest.raises(OptionsError, match="write rank counts like 1,2,4"):
        parse_ranks("1,two")
    # A point of 0.5 s left a loaded node's calibration run nothing to measure.
    with pytest.raises(OptionsError) as short:
        ScaleOptions(model="m.py", seconds=0.5).validate()
    assert str(short.value) == (
        "--seconds 0.5: a measured point needs at least 1.5 s (its ranks record twice a second, and its first "
        "and last records are left out); give --seconds 1.5 or more"
    )
    assert ScaleOptions(model="m.py", quick=True).validate().point_seconds == 1.5
    assert MIN_POINT_SECONDS >= 3 * REPORT_EVERY  # a first, a last and one record between
    assert parse_ranks("1-3,8") == [1, 2, 3, 8]
    assert default_ranks(3) == [1, 2, 3] and default_ranks(16, quick=True) == [1, 2, 3, 4, 8, 16]
    assert default_ranks(64) == [1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64]
    assert [s.label for s in parse_setups("allreduce easgd downpour(masters=2, sync_every=4)")] == [
        "allreduce",
        "easgd, sync every 4",
        "downpour, 2 masters, sync every 4",
    ]


def test_the_command_line_the_magic_and_the_api_take_the_same_scale_options():
    from dataclasses import fields

    from nbdist.cli import build_parser
    from nbdist.magics import DistnnMagics

    argv = ["scale", "--model", "m.py", "--quick", "--setups", "gem", "--max-ranks", "256"]
    for args in (build_parser().parse_args(argv), DistnnMagics.distnn.parser.parse_args(argv)):
        given = {f.name: getattr(args, f.name) for f in fields(ScaleOptions) if getattr(args, f.name) is not None}
        assert ScaleOptions(**given).validate() == ScaleOptions(model="m.py", quick=True, setups="gem", max_ranks=256)


def test_the_cpu_meter_tells_the_studys_own_cpu_from_other_processes():
    """The meter reads the node's busy time and the study's processes' own: what this
    process burns counts as the study's, not as other processes' load."""
    import os
    import time

    from nbdist.scaling.load import CpuMeter

    meter = CpuMeter([os.getpid()])
    if not meter.available:
        pytest.skip("no /proc here")
    started, cpu = time.time(), time.process_time()
    while time.process_time() - cpu < 0.6:
        sum(range(10_000))
    time.sleep(0.25)
    meter.stop()
    burnt = time.process_time() - cpu
    ours = meter.ours[-1] - meter.ours[0]
    assert ours == pytest.approx(burnt, abs=0.1)
    # The busy time of the whole node holds this process's own.
    assert meter.busy[-1] - meter.busy[0] >= ours - 0.05
    assert meter.others(started, time.time()) >= 0.0


def test_the_rule_probes_time_every_rule_without_numpys_warnings():
    """The calibration times each rule on synthetic buffers, hundreds of calls on the same
    values: DiLoCo's overflowed and ADAG's exchange divided 0 by 0, and numpy's warnings
    about values nothing reads came out of `nbdist scale` as if the model were at fault."""
    import warnings

    from torch import nn

    from nbdist.backends import backend_for
    from nbdist.scaling.probes import rule_costs
    from nbdist.scaling.setups import master_worker_rules

    backend = backend_for(nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        step, exchange, apply, rounds, merge = rule_costs(backend, 0.5)
    for costs in (step, exchange, apply, rounds):
        assert set(costs) == set(master_worker_rules()) and all(c > 0 for c in costs.values())
    assert merge > 0
