"""Freed memory kept for the next step: glibc's malloc told not to hand buffers back.

Open MPI's nonblocking allreduce (libnbc, behind every `Iallreduce` of the MPI reducer)
allocates a temporary buffer the size of its bucket for each reduction and frees it when
the reduction completes, every step. glibc serves a large allocation with a fresh `mmap`
(above its mmap threshold, which it raises only as such blocks are freed) and returns the
top of its heap to the kernel once more than its trim threshold is free: either way the
next step's buffers are new pages, which the kernel zero-fills one page fault at a time,
on the core that should be training. A rank allocates the same sizes every step, so
`keep_freed_memory` fixes both thresholds once: buffers up to glibc's ceiling come from
the heap, and the heap keeps what a step frees for the next one (the rank's resident
memory stays at its peak; the trim threshold bounds what it holds on to).

Only where the process runs on glibc; elsewhere (musl, macOS) nothing changes.
"""

from __future__ import annotations

import ctypes
import platform

__all__ = ["keep_freed_memory"]

# mallopt's parameter numbers (malloc.h).
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# glibc's largest mmap threshold on a 64-bit system (DEFAULT_MMAP_THRESHOLD_MAX): a
# bucket larger than this is still mapped afresh.
MMAP_THRESHOLD_MAX = 32 * 2**20
# The least free heap top kept (a step frees all its buckets' temporaries together).
MIN_TRIM_THRESHOLD = 64 * 2**20
C_INT_MAX = 2**31 - 1

_kept_bytes = 0  # the trim threshold set so far (0: not set by this process)


def keep_freed_memory(step_bytes: int) -> bool:
    """Keep up to twice `step_bytes` (what a step allocates and frees: the gradient, for
    the reducer's temporaries) of freed heap for the next step, and serve allocations up
    to glibc's ceiling from the heap. Idempotent; a larger `step_bytes` raises the bound.
    Whether glibc took the settings (False elsewhere)."""
    global _kept_bytes
    trim = min(max(MIN_TRIM_THRESHOLD, 2 * int(step_bytes)), C_INT_MAX)
    if trim <= _kept_bytes:
        return True
    mallopt = _glibc_mallopt()
    if mallopt is None:
        return False
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX) and mallopt(M_TRIM_THRESHOLD, trim)):
        return False
    _kept_bytes = trim
    return True


def _glibc_mallopt():
    """The process's own `mallopt` where its C library is glibc, else None."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library already loaded into the process
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt
