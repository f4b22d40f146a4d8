"""Checkpoint writes off a master's serving loop: its share of each checkpoint and the
commits, done in order on a thread of their own.

A master that wrote its share and committed inline held every worker whose update came in
meanwhile, for the write, its digest, the fsyncs and the commit's renames: a few percent
of the workers' time on the digits CNN (bench/results/2026-11-25-overhead.md). Here the
master copies what it saves (a memcpy of its weights and optimiser state) and goes on; the
thread writes and fsyncs as before (train/checkpoint.py), so a checkpoint is exactly as
atomic and durable, only later. A share counts as written, and so can be committed, only
once `written()` has returned its label, which is after its fsyncs. Jobs run one at a time
in submission order: a commit never overtakes the share it needs, nor an earlier commit.

A failed job is raised in the master's thread at its next look, naming the checkpoint
(a full disk as the DiskFull that says where and how much: train/diskspace.py); jobs
after it are not run. `finish(timeout)` waits for every job, at the end of
a run and before a restart reads the checkpoints.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable

from nbdist.errors import DiskFull, TrainingError
from nbdist.train.diskspace import disk_full, is_disk_full

__all__ = ["CheckpointWriter", "CheckpointWriteFailed", "FINISH_SECONDS", "SETTLE_SECONDS"]

# How long the end of a run waits for the writes still queued: a disk that takes longer
# for a few files is hung (an NFS server gone), and the run says so instead of waiting.
FINISH_SECONDS = 300.0
# How long a rank whose run failed waits for its queued writes before it gives up on them
# (the last committed checkpoint stands).
SETTLE_SECONDS = 30.0


class CheckpointWriteFailed(TrainingError):
    """A checkpoint write or commit on the writer thread raised."""


class CheckpointWriter:
    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._done: list[str] = []
        self._lock = threading.Lock()
        self._pending = 0
        self._error: BaseException | None = None
        self._failed_job = ""
        self._thread: threading.Thread | None = None
        self._cpu_seconds = 0.0
        self._named_done = 0
        self._named_taken = 0

    def work_done(self) -> tuple[float, int, int]:
        """The CPU time the jobs done so far took on the writer's thread (their fsyncs'
        waits are not CPU), what checkpoints could take from training; how many of those
        jobs had a name (a rank's share of a checkpoint); and how many named jobs were
        submitted, done or not: train/checkpoint_cost.py."""
        with self._lock:
            return self._cpu_seconds, self._named_done, self._named_taken

    def submit(self, job: Callable[[], object], name: str | None = None) -> None:
        """Run `job()` after the jobs before it; `name` (a label), if given, is what
        `written()` gives back once it has run. The job must not read anything the caller
        changes later."""
        self._raise_failure()
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="nbdist-checkpoint-writer", daemon=True)
            self._thread.start()
        with self._lock:
            self._pending += 1
            self._named_taken += name is not None
        self._jobs.put((job, name))

    def written(self) -> list[str]:
        """The names of the jobs done since the last call, in order; raises
        CheckpointWriteFailed once a job failed."""
        self._raise_failure()
        with self._lock:
            done, self._done = self._done, []
        return done

    def finish(self, timeout: float = FINISH_SECONDS) -> list[str]:
        """Wait until every job submitted has run (at most `timeout` s); `written()`."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                pending = self._pending
            if pending == 0 or self._error is not None:
                return self.written()
            if time.monotonic() > deadline:
                raise CheckpointWriteFailed(
                    f"checkpoint writes did not finish within {timeout:.0f} s ({pending} still queued): the disk "
                    f"under the run directory is hung or far too slow; the last committed checkpoint stands"
                )
            time.sleep(0.001)

    def settle(self) -> None:
        """When a run fails: let the writes already queued finish (SETTLE_SECONDS at most),
        so that a restart reads the checkpoints as they stand, not half-way through a
        commit. A write that failed, or did not finish, leaves the last committed one."""
        with contextlib.suppress(CheckpointWriteFailed, DiskFull):
            self.finish(timeout=SETTLE_SECONDS)

    def _work(self) -> None:
        while True:
            job, name = self._jobs.get()
            started = time.thread_time()
            if self._error is None:
                try:
                    job()
                except BaseException as exc:  # raised in the master's thread
                    if is_disk_full(exc):  # a commit's small files (a share's is DiskFull already)
                        exc = disk_full(
                            exc, what=f"committing checkpoint {name}" if name else "committing a checkpoint"
                        )
                    self._error, self._failed_job = exc, name or "commit"
            with self._lock:
                self._pending -= 1
                self._cpu_seconds += time.thread_time() - started
                self._named_done += name is not None
                if self._error is None and name is not None:
                    self._done.append(name)

    def _raise_failure(self) -> None:
        if isinstance(self._error, DiskFull):
            raise DiskFull(str(self._error))
        if self._error is not None:
            raise CheckpointWriteFailed(f"writing checkpoint {self._failed_job} failed: {self._error}") from self._error
