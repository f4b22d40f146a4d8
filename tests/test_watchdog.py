"""nbdist/watchdog.py's process groups: a child forked by a session leader and orphaned
when the leader ends (a controller's scheduler, forked while the controller is stopped)
is still found, and taken down, through the leader's group."""

import subprocess
import sys

import psutil

from nbdist.watchdog import process_groups, take_down

# A session leader that forks a child, prints its pid and exits: the child lives on with
# parent 1, outside the leader's tree but in its process group.
LEADER = """
import os, sys, time
child = os.fork()
if child == 0:
    time.sleep(60)
    os._exit(0)
print(child, flush=True)
"""


def test_an_orphan_of_a_session_leader_is_found_by_its_group_and_taken_down():
    leader = subprocess.Popen([sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True, start_new_session=True)
    orphan = psutil.Process(int(leader.stdout.readline()))
    try:
        assert leader.wait(timeout=30) == 0
        assert orphan.is_running() and orphan.ppid() != leader.pid  # reparented: not below the leader
        assert [p.pid for p in process_groups([leader.pid])] == [orphan.pid]
        take_down(process_groups([leader.pid]), grace=5.0)
        assert not orphan.is_running()
        assert process_groups([leader.pid]) == []
    finally:
        if orphan.is_running():
            orphan.kill()
