"""transport/heap.py: a rank's freed buffers come back without new page faults.

A step of the MPI reducer allocates one temporary per bucket (Open MPI's Iallreduce),
all alive together, and frees them at its end. Here a fresh interpreter does the same with
eight 4 MiB numpy buffers a step and counts the minor page faults of the later steps
(the kernel's zero-filling of new pages): many with glibc's default thresholds, where the
freed heap top is given back each step, and almost none with keep_freed_memory.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only"
)

BUCKETS, BUCKET_FLOATS, STEPS = 8, 2**20, 10
PAGES_PER_STEP = BUCKETS * BUCKET_FLOATS * 4 // 4096

STEP_FAULTS = f"""
import json, resource, sys
import numpy as np
from nbdist.transport.heap import keep_freed_memory
kept = keep_freed_memory({BUCKETS * BUCKET_FLOATS * 4}) if sys.argv[1] == "keep" else None
def step():
    buffers = [np.ones({BUCKET_FLOATS}, np.float32) for _ in range({BUCKETS})]  # written: pages touched
    del buffers
step(); step()  # the first steps may grow the heap either way
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range({STEPS}):
    step()
print(json.dumps({{"kept": kept, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}}))
"""


def _faults(mode: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", STEP_FAULTS, mode], capture_output=True, text=True, timeout=60, check=True
    )
    return json.loads(out.stdout)


def test_kept_heap_serves_each_step_without_new_pages():
    default, kept = _faults("default"), _faults("keep")
    assert kept["kept"] is True
    # glibc's own thresholds: the freed buffers go back to the kernel and come back as new pages.
    assert default["faults"] >= STEPS * PAGES_PER_STEP // 4, default
    # Kept: the same steps touch pages the heap already holds.
    assert kept["faults"] < STEPS * PAGES_PER_STEP // 20, kept


def test_keep_freed_memory_is_idempotent():
    from nbdist.transport.heap import keep_freed_memory

    assert keep_freed_memory(1) and keep_freed_memory(1) and keep_freed_memory(2**40)
