"""Requests left in flight when a run ends early keep their buffers until MPI is done with
them (waiting.keep_pending): a late message into freed memory killed the next job's engine.

On COMM_SELF, in this process: the "late" message is sent by the test itself, after the
owner of the receive and its buffer are gone."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

MPI = pytest.importorskip("mpi4py.MPI")

from nbdist.transport import messages as m  # noqa: E402
from nbdist.transport import waiting  # noqa: E402
from nbdist.transport.deadlines import Silence  # noqa: E402
from nbdist.transport.master_channel import MasterChannel  # noqa: E402
from nbdist.transport.worker_channel import WorkerChannel  # noqa: E402


@pytest.fixture(autouse=True)
def _nothing_kept_before_or_after():
    waiting.release_completed()
    assert waiting.release_completed() == 0
    yield
    waiting.forget_abandon()
    assert waiting.release_completed() == 0, "a test left a receive posted"


def _late(comm, array: np.ndarray, tag: int) -> None:
    """The message a peer sends after this rank has given up on it."""
    comm.Isend(array, dest=0, tag=tag).Wait()


def test_a_dropped_worker_channel_keeps_its_reply_buffers_until_the_reply_lands():
    comm = MPI.COMM_SELF
    header, payload = np.zeros(4, np.float32), np.zeros(1000, np.float32)
    channel = WorkerChannel(comm, header, payload, Silence(5.0), master="the master", master_rank=0, describe=str)
    channel.expect_reply()
    alive = weakref.ref(payload)
    del channel, header, payload
    gc.collect()
    assert alive() is not None, "the payload was freed while its receive was still posted"
    assert waiting.release_completed() == 2
    _late(comm, np.ones(4, np.float32), m.TAG_REPLY_HEADER)
    _late(comm, np.full(1000, 7.0, np.float32), m.TAG_REPLY)
    assert alive() is not None and float(alive()[0]) == 7.0  # the late reply landed in the kept buffer
    assert waiting.release_completed() == 0
    gc.collect()
    assert alive() is None, "a completed request was kept"


def test_a_dropped_master_channel_keeps_its_posted_header_buffers():
    comm = MPI.COMM_SELF
    inbox = np.zeros(m.HEADER_FLOATS, np.float32)
    channel = MasterChannel([(comm, 0, inbox)])
    channel.post(0)
    alive = weakref.ref(inbox)
    del channel, inbox
    gc.collect()
    assert alive() is not None
    _late(comm, np.ones(m.HEADER_FLOATS, np.float32), m.TAG_UPDATE)
    assert waiting.release_completed() == 0
    gc.collect()
    assert alive() is None


def test_a_wait_that_is_abandoned_keeps_what_it_waited_for():
    comm = MPI.COMM_SELF
    buffer = np.zeros(256, np.float64)
    alive = weakref.ref(buffer)
    waiting.abandon()
    with pytest.raises(waiting.Abandoned):
        waiting.wait_all([comm.Irecv(buffer, source=0, tag=99)], timeout=5.0)
    waiting.forget_abandon()
    del buffer
    gc.collect()
    assert alive() is not None and waiting.release_completed() == 1
    _late(comm, np.arange(256, dtype=np.float64), 99)
    assert float(alive()[255]) == 255.0
    assert waiting.release_completed() == 0


def test_a_wait_that_times_out_keeps_what_it_waited_for():
    comm = MPI.COMM_SELF
    buffer = np.zeros(8, np.int64)
    alive = weakref.ref(buffer)
    with pytest.raises(waiting.WaitTimeout):
        waiting.wait_all([comm.Irecv(buffer, source=0, tag=98)], timeout=0.05)
    del buffer
    gc.collect()
    assert alive() is not None
    _late(comm, np.arange(8, dtype=np.int64), 98)
    assert waiting.release_completed() == 0
    gc.collect()
    assert alive() is None


def test_kept_requests_that_completed_are_let_go_while_a_run_goes_on():
    comm = MPI.COMM_SELF
    for _ in range(3 * waiting.KEPT_BEFORE_RELEASE):
        sent = comm.Isend(np.ones(4), dest=0, tag=97)
        comm.Recv(np.empty(4), source=0, tag=97)
        waiting.keep_pending([sent])  # done, but not yet tested: not null
    assert len(waiting._kept) <= waiting.KEPT_BEFORE_RELEASE + 1
