"""--busy-poll auto on shared cores: the rule on synthetic counters, the watch on a counters
file, and a real wait whose core another process spins on."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from nbdist.transport import core_share, waiting
from nbdist.transport.core_share import FREE, MIN_RUNNABLE, SHARED, WINDOW, CoreWatch, keep_polling


@pytest.mark.parametrize(
    ("polling", "ran", "waited", "polls"),
    [
        (True, 1.0, 0.0, True),  # a core of its own
        (True, 1.0 - SHARED / 2, SHARED / 2, True),  # a little wait: not worth giving up polling
        (True, 1.0 - SHARED, SHARED, True),  # at the limit
        (True, 0.6, 0.4, False),  # another job takes turns on the core
        (True, 0.5, 0.5, False),
        (False, 0.6, 0.4, False),  # still shared: goes on sleeping
        (False, 1.0 - (FREE + SHARED) / 2, (FREE + SHARED) / 2, False),  # between the two: stays
        (True, 1.0 - (FREE + SHARED) / 2, (FREE + SHARED) / 2, True),  # between the two: stays
        (False, 1.0 - FREE / 2, FREE / 2, True),  # the other work is gone: polls again
        (False, 1.0, 0.0, True),
        (True, MIN_RUNNABLE / 4, MIN_RUNNABLE / 2, True),  # asleep most of the window: no verdict
        (False, MIN_RUNNABLE / 4, 0.0, False),
    ],
)
def test_the_rule_polls_while_the_rank_waits_little_for_its_core(polling, ran, waited, polls):
    assert keep_polling(polling, ran, waited) is polls


def _counters(path, ran: float, waited: float) -> None:
    path.write_text(f"{int(ran * 1e9)} {int(waited * 1e9)} 42\n")


def test_the_watch_applies_the_rule_to_each_window_of_the_counters(tmp_path):
    stats = tmp_path / "schedstat"
    _counters(stats, 10.0, 1.0)
    watch = CoreWatch(polling=True, now=0.0, path=str(stats))
    _counters(stats, 10.5, 1.5)  # half of the window waiting for the core ...
    assert watch.check(WINDOW / 2) is True  # ... not looked at before the window ends
    assert watch.check(WINDOW) is False
    _counters(stats, 11.0, 1.6)  # still waiting a sixth of the time: goes on sleeping
    assert watch.check(2 * WINDOW) is False
    _counters(stats, 12.0, 1.6 + FREE / 4)
    assert watch.check(3 * WINDOW) is True
    watch.close()


def test_without_the_counters_the_watch_keeps_the_start_up_choice(tmp_path):
    watch = CoreWatch(polling=True, now=0.0, path=str(tmp_path / "missing"))
    assert watch.check(10 * WINDOW) is True


@pytest.fixture
def auto_polling(monkeypatch):
    """--busy-poll auto for this process's waits; the sleeps they take, recorded (not slept)."""
    taken: list[float] = []
    monkeypatch.setattr(waiting.time, "sleep", taken.append)
    waiting.poll_without_sleeping(True, while_core_free=True)
    try:
        yield taken
    finally:
        waiting.poll_without_sleeping(False)


@pytest.mark.skipif(not os.path.exists(core_share.SCHEDSTAT), reason="the kernel keeps no per-thread schedstat")
def test_an_auto_polling_wait_sleeps_once_another_process_spins_on_its_core(auto_polling):
    core = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    spinner = subprocess.Popen(
        [sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{core}}})\nwhile True: pass"]
    )
    try:
        os.sched_setaffinity(0, {core})  # this thread only: the spinner's core
        with pytest.raises(waiting.WaitTimeout):
            waiting.wait_for(lambda: False, timeout=3 * WINDOW)
        assert auto_polling, "the wait went on polling a core that another process needed"
        assert max(auto_polling) <= waiting.LONGEST_SLEEP
    finally:
        os.sched_setaffinity(0, before)
        spinner.kill()
        spinner.wait()
