"""Dynamic local updates (DyLU, Liu et al. 2024, arXiv:2401.09135; issue 29):
async_local_sgd(dynamic_steps=True) scales each worker's number of local steps by its
speed relative to the fastest worker, H_i = floor(H * v_i / v_max), at least 1. The step
counts against that formula written out here; the master's timing of the windows
(roles/master/windows.py) on given clocks; the window a worker's rule state then keeps;
the header slot that carries it; the bad input. The real runs (one worker made slower)
are in test_new_rules_mpi.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from nbdist.algorithms import AsyncLocalSGD, DiLoCo, make_algorithm
from nbdist.errors import OptionsError
from nbdist.options import TrainOptions
from nbdist.roles.master.windows import WorkerWindows
from nbdist.roles.runner import warm_start_phase
from nbdist.specs import SpecError, parse_spec
from nbdist.train.rules import check_windows, resolve_rules
from nbdist.transport import messages as m

H = 8


def paper_steps(h, speeds):
    """Liu et al. 2024, DyLU: H_i = floor(H * v_i / max_j v_j), and at least one step."""
    fastest = max(speeds)
    return [max(1, math.floor(h * v / fastest)) for v in speeds]


def rule_steps(rule, h, speeds):
    return [rule.next_window(h, v, max(speeds)) for v in speeds]


def test_the_step_counts_are_the_papers():
    rule = AsyncLocalSGD(dynamic_steps=True)
    assert rule_steps(rule, H, [1.0, 0.5, 0.25]) == [8, 4, 2] == paper_steps(H, [1.0, 0.5, 0.25])
    # The floor, and at least one step however slow.
    assert rule_steps(rule, H, [1.0, 0.3, 0.01]) == [8, 2, 1] == paper_steps(H, [1.0, 0.3, 0.01])
    # Speeds in samples per second, in any order: only their ratios count.
    speeds = list(np.random.default_rng(3).uniform(10.0, 5000.0, size=40))
    for h in (1, 3, 8, 50):
        assert rule_steps(rule, h, speeds) == paper_steps(h, speeds)


def test_without_dynamic_steps_every_worker_keeps_the_window():
    for rule in (AsyncLocalSGD(), DiLoCo()):
        assert not rule.adapts_windows
        assert rule_steps(rule, H, [1.0, 0.5, 0.25]) == [H, H, H]
    assert AsyncLocalSGD(dynamic_steps=True).adapts_windows


def test_an_unknown_speed_keeps_the_window():
    rule = AsyncLocalSGD(dynamic_steps=True)
    assert rule.next_window(H, 0.0, 100.0) == H  # not timed yet
    assert rule.next_window(H, 100.0, 0.0) == H  # nobody timed yet


def test_the_worker_takes_the_window_its_master_names():
    rule = AsyncLocalSGD(inner_steps=H, dynamic_steps=True)
    params = np.zeros(3, np.float32)
    state = rule.new_worker_state(3, H)
    rule.worker_start(state, params)
    grad = np.full(3, 0.1, np.float32)

    class Sgd:
        def step(self, g):
            params[...] -= g

    def window():
        steps = 1
        while not rule.worker_step(state, params, grad, Sgd()):
            steps += 1
        rule.worker_message(state, params, np.empty(3, np.float32))
        return steps

    assert window() == H  # the first window: no speed known yet
    rule.worker_window(state, 2)
    assert window() == 2 and window() == 2
    assert state.to_arrays()["sync_every"] == 2  # in the worker's checkpoint share
    rule.worker_window(state, H)
    assert window() == H


def test_the_master_times_windows_from_its_reply_to_the_next_arrival():
    rule = AsyncLocalSGD(dynamic_steps=True)
    windows = WorkerWindows(rule, H, 3)
    # First windows: not begun by a reply, so not timed; the next window is H.
    windows.arrived(0, 256, at=10.0)
    assert windows.speeds[0] == 0.0 and windows.name(0, [0, 1, 2]) == H
    windows.begin(0, 10.0, timed=True)
    windows.begin(1, 10.0, timed=True)
    windows.begin(2, 10.0, timed=True)
    windows.arrived(0, 256, at=11.0)  # 256 samples/s
    assert windows.name(0, [0, 1, 2]) == H
    windows.arrived(1, 256, at=12.0)  # half as fast
    assert windows.speeds[1] == 128.0 and windows.name(1, [0, 1, 2]) == 4
    windows.arrived(2, 256, at=14.0)  # a quarter
    assert windows.name(2, [0, 1, 2]) == 2
    # Once the fastest no longer trains (dropped, or done), the others are measured
    # against the fastest left.
    assert windows.name(1, [1, 2]) == H and windows.name(2, [1, 2]) == 4
    # A reply that is no CONTINUE (a STOP) begins no timed window.
    windows.begin(2, 20.0, timed=False)
    windows.arrived(2, 32, at=20.5)
    assert windows.speeds[2] == 64.0


def test_an_update_sent_back_by_a_snapshot_is_timed_to_its_first_arrival():
    """A checkpoint's SNAPSHOT answers an update without applying it; the worker saves its
    share and sends the update again. Its window ended when it first arrived: a slow worker
    whose every window meets a faster worker's checkpoint is timed all the same."""
    windows = WorkerWindows(AsyncLocalSGD(dynamic_steps=True), H, 2)
    windows.begin(0, 0.0, timed=True)
    windows.arrived(0, 256, at=1.0)  # 256 samples/s
    windows.begin(1, 0.0, timed=True)
    windows.sent_back(1, arrived=4.0)  # a quarter as fast; the share's save takes 3 s more
    windows.arrived(1, 256, at=7.0)
    assert windows.speeds[1] == 64.0 and windows.name(1, [0, 1]) == 2
    # The next window is timed from its own CONTINUE, to its own arrival.
    windows.begin(1, 8.0, timed=True)
    windows.arrived(1, 64, at=9.0)
    assert windows.speeds[1] == 64.0


def test_the_speeds_checkpoint_and_resume():
    rule = AsyncLocalSGD(dynamic_steps=True)
    windows = WorkerWindows(rule, H, 2)
    windows.begin(1, 0.0, timed=True)
    windows.arrived(1, 64, at=2.0)
    saved = windows.to_json()
    resumed = WorkerWindows(rule, H, 2)
    resumed.load_json(saved)
    assert resumed.speeds == [0.0, 32.0]
    other = WorkerWindows(rule, H, 3)  # laid out on more workers: timed anew
    other.load_json(saved)
    assert other.speeds == [0.0, 0.0, 0.0]


def test_the_reply_header_carries_the_window_before_the_membership():
    header = m.new_header(3)
    assert header.size == m.HEADER_FLOATS // 2 + 1 + 3
    header[m.WINDOW] = 5
    header[m.MEMBERS + 0] = header[m.MEMBERS + 2] = 1.0
    assert m.members_in(header) == (0, 2)


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("value", ["1", "'yes'", "None", "0.5"])
def test_dynamic_steps_is_true_or_false(value):
    with pytest.raises(SpecError, match=r"async_local_sgd: dynamic_steps must be True or False, got"):
        make_algorithm(parse_spec(f"async_local_sgd(dynamic_steps={value})"))


def test_dynamic_steps_in_a_synchronous_run_is_one_clear_error():
    options = TrainOptions(algorithm="async_local_sgd(dynamic_steps=True)", synchronous=True)
    rule = resolve_rules(options)[0]
    with pytest.raises(OptionsError, match=r"drop --synchronous .*or set dynamic_steps=False"):
        check_windows(rule, options)
    check_windows(resolve_rules(options.replace(synchronous=False))[0], options.replace(synchronous=False))
    check_windows(resolve_rules(TrainOptions(algorithm="async_local_sgd", synchronous=True))[0], options)


def test_a_warm_start_before_dynamic_steps_is_accepted():
    """The synchronous first phase of --warm-start-epochs is checked against the whole
    run, which is asynchronous: the windows adapt from the switch on."""
    whole = TrainOptions(algorithm="async_local_sgd(dynamic_steps=True)", warm_start_epochs=1, epochs=3)
    phase = warm_start_phase(whole.validate())
    assert phase is not None and phase.synchronous
    check_windows(resolve_rules(phase)[0], whole)
