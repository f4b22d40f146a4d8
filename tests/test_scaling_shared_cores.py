"""The performance model on shared cores: more ranks than cores, or cores that other
processes take part of (a loaded machine), against closed forms; and what the calibration
measures of the sharing (pure: no MPI)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_scaling_model import DOWNPOUR, S, Z, calibration

from nbdist.scaling import Machine, PerformanceModel, SetUp, Simulator, network
from nbdist.scaling.analysis import STALENESS_CYCLES, predicted_point
from nbdist.scaling.assemble import _growth, at_share, rank_shares
from nbdist.scaling.model import PASS_UPDATES, expected_max, makespan
from nbdist.scaling.queueing import mva_shared_cores
from nbdist.scaling.setups import Point


def on_cores(cores: float, physical: int = 2, **changes: object) -> PerformanceModel:
    """One node of `physical` cores of which the ranks get `cores` (others take the rest)."""
    return PerformanceModel(calibration(**changes), Machine(cores, network("ib-hdr"), nodes=1, physical=physical))


@pytest.mark.parametrize("cores", [0.3, 0.5, 0.8])
def test_a_worker_and_its_master_on_less_than_a_core_get_what_is_left(cores):
    """A worker and its master that sleep between polls, on cores of which other processes
    leave them `cores` < 1: the worker's compute and the master's service both run on
    those, one after the other, so an update takes (Z + S) / cores: X = cores / (Z + S), in
    the queueing network, the model and the simulator. (The master holding a whole core it
    does not have would give Z / cores + S.)"""
    closed = mva_shared_cores(1, Z, 0.0, S, cores)
    assert closed.x == pytest.approx(cores / (Z + S), rel=1e-9)
    model = on_cores(cores, physical=1, poll_sleep_s=0.0)  # two ranks on one core: they sleep
    assert model.predict(DOWNPOUR, 2).samples_per_s == pytest.approx(32 * cores / (Z + S), rel=1e-9)
    simulated = Simulator(model).run(DOWNPOUR, 2, cycles=40)
    assert simulated.samples_per_s == pytest.approx(32 * cores / (Z + S), rel=1e-6)


@pytest.mark.parametrize("cores", [0.5, 1.0, 1.5])
def test_ranks_that_poll_on_shared_cores_each_get_an_even_share(cores):
    """A worker and its master on a node of two cores of which other processes leave
    `cores` < 2: they poll (the node has a core each), so both stay runnable and each gets
    cores / 2 of a core all the time: an update takes 2 (Z + S) / cores."""
    model = on_cores(cores)
    assert model.predict(DOWNPOUR, 2).samples_per_s == pytest.approx(32 * cores / (2 * (Z + S)), rel=1e-9)
    simulated = Simulator(model).run(DOWNPOUR, 2, cycles=40)
    assert simulated.samples_per_s == pytest.approx(32 * cores / (2 * (Z + S)), rel=1e-6)


@pytest.mark.parametrize("workers", [2, 3, 5])
def test_workers_on_shared_cores_never_use_more_cpu_than_there_is(workers):
    """W workers and their master with less than a core between them: every update costs
    Z + S CPU seconds, so no more than cores / (Z + S) updates a second."""
    cores = 0.6
    point = on_cores(cores, physical=1, poll_sleep_s=0.0).predict(DOWNPOUR, workers + 1)
    # (the queueing network leaves computing workers a thousandth of a core at the least)
    assert point.samples_per_s / 32 <= cores / (Z + S) * (1 + 2e-3)
    assert point.samples_per_s / 32 >= 0.9 * cores / (Z + S)  # the master's short waits aside


def test_allreduce_ranks_that_poll_keep_their_share_and_ranks_that_sleep_give_it_away():
    """k ranks sharing c < k cores, deterministic steps of Z alone: where they outnumber
    the node's cores they sleep once done, and the step is the processor-sharing makespan;
    where the node has a core each but other processes take some, a rank that is done
    polls and keeps its share: the step is the slowest's work at c / k of a core."""
    spread = [0.5, 1.0, 1.5]
    setup = SetUp("allreduce")
    # Four ranks on two cores: sleeping waits (the closed form of processor sharing).
    sleeping = on_cores(2, spread=spread)
    point = sleeping.predict(setup, 4)
    assert point.oversubscribed
    assert point.step_s - point.communicate_s == pytest.approx(Z * makespan(spread, 4, 2), rel=1e-9)
    # Deterministic: every rank's work is Z, so the four take 4 Z / 2 cores.
    flat = on_cores(2).predict(setup, 4)
    assert flat.step_s - flat.communicate_s == pytest.approx(4 * Z / 2, rel=1e-9)
    # Two ranks on a node of two cores of which others leave 0.5: polling waits.
    polling = on_cores(0.5, spread=spread)
    point = polling.predict(setup, 2)
    assert not point.oversubscribed  # the ranks do not sleep: the node has a core each
    assert point.step_s - point.communicate_s == pytest.approx(Z * expected_max(spread, 2) * 2 / 0.5, rel=1e-9)


def test_the_masters_turn_on_a_core_pairs_updates_and_lowers_staleness():
    """Where an update waits for the master's turn on a core (ranks beyond the cores), the
    ones that come meanwhile are served in the same pass: the staleness falls below W - 1,
    and once the turn is longer than the gap between updates every pass serves
    PASS_UPDATES of them: W - 1 - (PASS_UPDATES - 1) / 2."""
    workers = 3
    none = on_cores(2).predict(DOWNPOUR, workers + 1)
    short = on_cores(2, turn_s=2e-4).predict(DOWNPOUR, workers + 1)
    long = on_cores(2, turn_s=1.0).predict(DOWNPOUR, workers + 1)
    assert long.staleness_mean < short.staleness_mean < none.staleness_mean <= workers - 1
    assert long.staleness_mean == pytest.approx(workers - 1 - (PASS_UPDATES - 1) / 2, rel=1e-9)
    # Without a count of turns, what time-slicing costs a step stands in for it.
    stand_in = on_cores(2, round_extra_s=2e-4).predict(DOWNPOUR, workers + 1)
    assert stand_in.staleness_mean == pytest.approx(short.staleness_mean, rel=1e-9)
    assert on_cores(2, turn_s=2e-4).turn_s(workers + 1) == pytest.approx(2e-4 * (workers + 1 - 2))


def test_a_top_masters_own_worker_pairs_with_the_sub_masters_pushes():
    """Two masters of one worker each: the top master's worker sees the sub-master's pushes
    as versions; a long turn on a core serves a push in the same pass as the update."""
    setup = SetUp("master-worker", "downpour", masters=2)
    none = on_cores(2).predict(setup, 4)
    long = on_cores(2, turn_s=1.0).predict(setup, 4)
    assert long.staleness_mean < none.staleness_mean


def test_calibration_runs_come_back_to_a_core_of_their_own_by_each_ranks_share():
    """A calibration run measured while the worker had 0.5 of a core and the master 0.25:
    its times halve, and the master's busy seconds per update are its busy share of the
    cycle as measured, times 0.25."""
    point = Point(
        DOWNPOUR,
        2,
        1,
        32,
        samples_per_s=1000.0,
        step_s=0.01,
        compute_s=0.006,
        communicate_s=0.003,
        wait_s=0.001,
        master_utilisation=0.2,
        extra={"others": 1.5, "shares": [0.25, 0.5]},
    )
    master_share, worker_share = rank_shares(point, 2)
    assert (master_share, worker_share) == (0.25, 0.5)
    own = at_share(point, worker_share, master_share)
    assert (own.step_s, own.compute_s, own.samples_per_s) == pytest.approx((0.005, 0.003, 2000.0))
    assert own.master_utilisation * own.step_s == pytest.approx(0.2 * 0.01 * 0.25)
    # Without the kernel's counts: even sharing of what the other processes left.
    point.extra = {"others": 1.5}
    assert rank_shares(point, 2) == [0.25, 0.25]


def test_time_slicing_costs_a_synchronous_step_once_whatever_the_ranks_beyond_the_cores():
    """A synchronous step on time-sliced cores waits for its last rank's last slice: what
    the probe measured with one runnable beyond the cores, once a step, with one or two
    beyond (a fraction of it where other processes leave a fraction of a core less)."""
    extra = 1e-3
    model = on_cores(2, round_extra_s=extra)
    assert [model.slicing_s(r) for r in (2, 2.5, 3, 4)] == pytest.approx([0.0, extra / 2, extra, extra])
    setup = SetUp("allreduce")
    for ranks in (3, 4):
        plain = on_cores(2).predict(setup, ranks)
        assert model.predict(setup, ranks).step_s == pytest.approx(plain.step_s + extra, rel=1e-9)


def test_a_synchronous_masters_round_is_time_sliced_only_by_the_ranks_that_compute():
    """A synchronous master on 3 ranks of 2 cores sleeps while its 2 workers compute: they
    have a core each and lose nothing to time slices; with 3 workers (4 ranks) they do."""
    setup = SetUp("master-worker", "downpour", synchronous=True)
    model, plain = on_cores(2, round_extra_s=1e-3), on_cores(2)
    assert model.round_runnable(setup, 3) == 2
    assert model.predict(setup, 3).step_s == pytest.approx(plain.predict(setup, 3).step_s, rel=1e-9)
    assert model.predict(setup, 4).step_s > plain.predict(setup, 4).step_s
    assert model.round_runnable(SetUp("allreduce"), 3) == 3


def test_a_sleeping_synchronous_masters_round_waits_two_turns_not_an_allreduces_slicing():
    """3 workers and their sleeping master on 2 cores: the round waits for the master's turn
    when the last body comes and the last worker's when the replies go out, in the model
    and in the simulator; an allreduce's step keeps the measured slicing, which also
    stands in where the calibration counted no turns."""
    setup = SetUp("master-worker", "downpour", synchronous=True)
    turn, extra = 2e-4, 1e-3
    model, plain = on_cores(2, turn_s=turn, round_extra_s=extra), on_cores(2)
    assert model.round_slicing_s(setup, 4) == pytest.approx(2 * turn)
    assert model.predict(setup, 4).step_s == pytest.approx(plain.predict(setup, 4).step_s + 2 * turn, rel=1e-9)
    simulated = Simulator(model).run(setup, 4, cycles=40).step_s - Simulator(plain).run(setup, 4, cycles=40).step_s
    assert simulated == pytest.approx(2 * turn, rel=1e-6)
    assert model.round_slicing_s(SetUp("allreduce"), 3) == pytest.approx(extra)
    assert on_cores(2, round_extra_s=extra).round_slicing_s(setup, 4) == pytest.approx(extra)


def test_an_asynchronous_workers_cycle_waits_once_for_the_masters_turn():
    """On 4 ranks of 2 cores an asynchronous worker, blocked on its reply, loses the
    master's wait for a core (two runnable beyond the cores: two turns' worth) once an
    exchange; a synchronous one does not (its round is charged), nor one with a core."""
    turn = 2e-4
    plain, turns = on_cores(2), on_cores(2, turn_s=turn)
    assert turns.exchange(DOWNPOUR, 32, 3, 4).delay - plain.exchange(DOWNPOUR, 32, 3, 4).delay == pytest.approx(
        2 * turn
    )
    synchronous = SetUp("master-worker", "downpour", synchronous=True)
    assert turns.exchange(synchronous, 32, 3, 4).delay == pytest.approx(plain.exchange(synchronous, 32, 3, 4).delay)
    own = on_cores(4, physical=4, turn_s=turn).exchange(DOWNPOUR, 32, 3, 4)
    assert own.delay == pytest.approx(on_cores(4, physical=4).exchange(DOWNPOUR, 32, 3, 4).delay)


def test_a_measured_asynchronous_points_staleness_is_the_simulators():
    """The prediction beside a measured point: the model's rate, and for an asynchronous
    set-up the simulator's staleness over STALENESS_CYCLES (the model's pairs fewer)."""
    model = on_cores(2, turn_s=2e-4, spread=[0.5, 1.0, 1.5])
    measured = Point(DOWNPOUR, 4, 3, 32, samples_per_s=1.0, step_s=0.01, compute_s=0.0, communicate_s=0.0, wait_s=0.0)
    predicted = predicted_point(model, measured)
    played = Simulator(model).run(DOWNPOUR, 4, 32, cycles=STALENESS_CYCLES)
    assert predicted.samples_per_s == pytest.approx(model.predict(DOWNPOUR, 4).samples_per_s)
    assert (predicted.staleness_mean, predicted.staleness_p99) == (played.staleness_mean, played.staleness_p99)
    assert predicted.staleness_mean != model.predict(DOWNPOUR, 4).staleness_mean
    allreduce = Point(
        SetUp("allreduce"), 4, 4, 32, samples_per_s=1.0, step_s=0.01, compute_s=0.0, communicate_s=0.0, wait_s=0.0
    )
    assert predicted_point(model, allreduce).staleness_mean == 0.0


def _run(setup: SetUp, ranks: int, batch: int, compute: float) -> Point:
    return Point(
        setup,
        ranks,
        1,
        batch,
        samples_per_s=batch / compute,
        step_s=compute,
        compute_s=compute,
        communicate_s=0.0,
        wait_s=0.0,
        extra={"shares": [1.0] * ranks},
    )


def test_the_calibrations_growth_with_the_batch_comes_from_the_real_runs():
    """A step's growth per sample is the lone allreduce rank's at four times the batch over
    that at the batch; the probe's only where that run is missing or shows no growth."""
    found = {"per_sample_s": 5e-5}
    alone = _run(SetUp("allreduce"), 1, 32, 4.0e-3)
    notes: list[str] = []
    assert _growth(found, alone, _run(SetUp("allreduce"), 1, 128, 13.6e-3), 2, notes) == pytest.approx(1e-4)
    assert "100 us per sample (the probe's 50 us)" in notes[0]
    assert _growth(found, alone, None, 2, notes) == 5e-5
    assert _growth(found, alone, _run(SetUp("allreduce"), 1, 128, 3.9e-3), 2, notes) == 5e-5


# The probes measure this process's CPU seconds: in the suite's own process other tests'
# threads may still run and count, so these checks run in a fresh interpreter.
def _in_a_fresh_python(code: str) -> dict:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


METER_CHECK = """
import json, os, time
from nbdist.scaling.load import CpuMeter, thread_turns, window_load

meter = CpuMeter([os.getpid()])
if not meter.available or thread_turns() == (0.0, 0.0, 0):
    print(json.dumps({"skip": True}))
    raise SystemExit
started, cpu = time.time(), time.process_time()
before = thread_turns()
while time.process_time() - cpu < 0.6:
    sum(range(10_000))
after = thread_turns()
meter.stop()
ran, share = meter.schedule(started, time.time(), 1)[0]
load = window_load(meter, [started, time.time()], 1)
print(json.dumps({"ran": ran, "share": share, "before": before, "after": after, "load": load}))
"""


def test_the_meter_tells_what_each_process_got_of_a_core():
    """The meter's schedule of a process: the share of the window it ran, and of the
    time it was runnable, the share it was on a core (at most 1)."""
    got = _in_a_fresh_python(METER_CHECK)
    if got.get("skip"):
        pytest.skip("no /proc schedstat here")
    ran, share, before, after = got["ran"], got["share"], got["before"], got["after"]
    assert 0.0 < ran <= 1.0 + 0.05
    assert share is not None and 0.0 < share <= 1.0
    assert after[0] - before[0] >= 0.5  # the thread's own seconds on a core
    assert after[2] > before[2]
    assert got["load"]["ran"] == [pytest.approx(ran)] and len(got["load"]["shares"]) == 1


def test_the_probe_times_a_cores_own_seconds():
    """A probe's stopwatch counts the work's own CPU seconds: a sleep costs next to none,
    and busy work no more than its wall-clock time. In a fresh interpreter: the suite's
    process may have other tests' threads running, whose CPU seconds are the process's too."""
    check = (
        "import time\n"
        "from nbdist.scaling.probes import _OwnCore\n"
        "clock = _OwnCore()\n"
        "time.sleep(0.2)\n"
        "asleep = clock.seconds()\n"
        "wall = time.perf_counter()\n"  # before the clock starts, read after it stops
        "clock = _OwnCore()\n"
        "sum(range(200_000))\n"
        "busy = clock.seconds()\n"
        "import json\n"
        "print(json.dumps({'asleep': asleep, 'busy': busy, 'wall': time.perf_counter() - wall}))\n"
    )
    got = _in_a_fresh_python(check)
    asleep, busy, wall = got["asleep"], got["busy"], got["wall"]
    assert asleep < 0.1
    assert 0.0 < busy <= wall


SETTLE_CHECK = """
import json, resource
import numpy as np
from nbdist.scaling.calibrate import _in_memory
from nbdist.scaling.probes import build_backend, settle_allocator
from nbdist.train.definition import load_model_file

definition = load_model_file("examples/digits_cnn.py")
data = _in_memory(definition.make_data())
backend = build_backend(definition, data, 1, 0)
x, y = data.train_batch(np.arange(128))

def faults_per_step():
    backend.compute_gradients(x, y)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        backend.compute_gradients(x, y)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 10

weights = np.array(backend.rule_params, copy=True)
fresh = faults_per_step()
settle_allocator(backend, data, 32)
settled = faults_per_step()
print(json.dumps({"fresh": fresh, "settled": settled,
                  "same_weights": bool(np.array_equal(weights, np.asarray(backend.rule_params)))}))
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or __import__("platform").libc_ver()[0] != "glibc",
    reason="the allocator's thresholds are glibc's",
)
def test_the_probe_settles_the_allocator_before_it_times_steps():
    """In a fresh process, steps at four times the batch page-fault their activations in
    anew (glibc gives the blocks back to the kernel); after settle_allocator they reuse
    the heap, as a run's ranks do by their steady state. The weights stay as they were (the
    noise scale is measured at the initial weights). Settling alone left it to where the
    blocks landed (now and then a process trimmed every step all the same); with glibc's
    thresholds fixed first, as the MPI reducer's ranks fix them, it does not."""
    got = _in_a_fresh_python(SETTLE_CHECK)
    assert got["same_weights"]
    assert got["settled"] < got["fresh"] / 10, got
