"""An asynchronous master's ends of epochs, without MPI: its real state (roles/master),
set up by settle() as rank 0 of a 1 master + 3 EASGD workers run of the digits GAN, its
validations on a real background replica. The workers' messages are the headers they
send, tallied as the serving loop tallies them (no centre moves: none is sent)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from nbdist.backends import DeviceRequest
from nbdist.metrics.log import RunLog
from nbdist.options import TrainOptions
from nbdist.roles.master.clients import WORKER, Client
from nbdist.roles.master.epochs import collect_validation, tally_message
from nbdist.roles.master.run import open_epochs, open_master
from nbdist.roles.master.state import Master
from nbdist.train.checkpoint import Checkpoints
from nbdist.train.context import RankContext
from nbdist.train.definition import load_model_file
from nbdist.train.history import HistoryFile
from nbdist.train.settle import settle
from nbdist.train.stopping import VALIDATED_WITH, EarlyStopping, StopFlag
from nbdist.transport import messages as m

GAN = str(Path(__file__).resolve().parent.parent / "examples" / "digits_gan.py")
WORKERS = 3


def _master(tmp_path: Path, validate_every: int = 1, epochs: int = 30) -> Master:
    """The top master of a fresh run, its clients' headers posted (serve's start)."""
    options = TrainOptions(
        model=GAN,
        gan=True,
        algorithm="easgd",
        epochs=epochs,
        early_stopping=1,
        monitor="val_mmd",
        validate_every=validate_every,
        checkpoint_every=0,
        runs_dir=str(tmp_path),
        quiet=True,
    )
    got = settle(options, load_model_file(GAN), WORKERS + 1, 0, DeviceRequest("cpu"))
    assert got.role.kind == "master"
    ctx = RankContext(
        options=got.options,
        layout=got.layout,
        role=got.role,
        comms=None,  # type: ignore[arg-type]  # nothing here talks to another rank
        backend=got.backend,
        data=got.data,
        algorithm=got.algorithm,
        sync_every=got.sync_every,
        worker_optimizer=got.worker_optimizer,
        master_optimizer=got.master_optimizer,
        run_dir=tmp_path,
        run_id="run",
        log=RunLog(tmp_path, "run", 0, "master"),
        stop=StopFlag(),
        checkpoints=Checkpoints(tmp_path),
        history_file=HistoryFile(tmp_path, writer=True),
        resume_from=None,
        early=EarlyStopping("val_mmd", 1, 0.0, None),
        is_leader=True,
        make_replica=got.make_replica,
        peers=None,  # type: ignore[arg-type]
        worker_lr=got.worker_lr,
        master_lr=got.master_lr,
    )
    me = Master(ctx)
    open_master(me, [Client(None, w + 1, WORKER, w + 1) for w in range(WORKERS)])  # posts nothing
    open_epochs(me)
    return me


def _ends_epoch(me: Master, i: int, epoch: int) -> None:
    """Client i's last update of `epoch` (its share of the data) comes in."""
    time.sleep(0.01)  # the master's clock moves on between messages, as between real ones
    msg = m.Message()
    msg.header[m.KIND], msg.header[m.EPOCH], msg.header[m.FLAGS] = m.UPDATE, epoch, m.EPOCH_END
    share = me.ctx.data.n_train // WORKERS
    msg.header[m.SAMPLES], msg.header[m.LOSS_SUM], msg.header[m.METRIC_SUM] = share, share, 0.5 * share
    me.clients[i].silence.heard()
    tally_message(me, i, msg)


@pytest.fixture
def master(tmp_path):
    me = _master(tmp_path)
    yield me
    me.ctx.log.close()
    me.ctx.data.close()


def test_two_epochs_that_end_together_share_one_validation(master):
    """Workers 1 and 2 send nothing (still starting, or descheduled on a loaded node) while
    worker 0 trains two epochs: the first cannot end without them until they are late,
    which worker 0's second epoch shows. Both end in that loop turn, on one centre: one
    validation, in both records, and patience counts it once (before, the same weights
    were validated twice, and the second, equal value stopped this run as no improvement)."""
    me = master
    _ends_epoch(me, 0, 0)
    assert me.pop_finished_epochs() == []  # the others are not late yet: waited for
    _ends_epoch(me, 0, 1)
    finished = me.pop_finished_epochs()
    assert [epoch for epoch, _, _ in finished] == [0, 1]
    assert [tally.behind for _, tally, _ in finished] == [2, 2]
    # The time since the run's start, shared: the second epoch's own is microseconds.
    (_, _, one), (_, _, other) = finished
    assert one == other and one >= 0.01

    me.end_epochs(finished)
    collect_validation(me, block=True)

    first, second = me.history
    assert (first["epoch"], second["epoch"]) == (1, 2)
    assert first["val_mmd"] == second["val_mmd"] and first["val_loss"] == second["val_loss"]
    assert first["samples_seen"] == second["samples_seen"]
    assert first[VALIDATED_WITH] == 2 and VALIDATED_WITH not in second
    assert me.stopping == "", me.stopping
    assert me.ctx.early.bad_rounds == 0 and me.ctx.early.best == second["val_mmd"]


def test_epochs_that_end_together_keep_their_order_and_validate_every(tmp_path):
    """With --validate-every 2, three epochs ending together: the second (due) is the one
    validation, the first waits for it to enter the history before it, the third (not
    due) follows without one."""
    me = _master(tmp_path, validate_every=2)
    try:
        for epoch in range(3):
            _ends_epoch(me, 0, epoch)
        finished = me.pop_finished_epochs()
        assert [epoch for epoch, _, _ in finished] == [0, 1, 2]
        me.end_epochs(finished)
        collect_validation(me, block=True)
        assert [h["epoch"] for h in me.history] == [1, 2, 3]
        assert ["val_mmd" in h for h in me.history] == [False, True, False]
        assert not any(VALIDATED_WITH in h for h in me.history)
        assert not me.validator.busy and not me.sharing
    finally:
        me.ctx.log.close()
        me.ctx.data.close()


def test_the_last_epoch_waits_for_late_workers_and_counts_every_sample(tmp_path):
    """Workers 1 and 2 are late while worker 0 trains both epochs of a 2-epoch run: the
    first epoch ends without them, as any asynchronous epoch may; the last one waits for
    their shares (no later epoch would count them, and the master applies them anyway),
    so the run's records count every sample once per epoch (before, the last record went
    out without them, `samples_pending`, and no record ever counted them)."""
    me = _master(tmp_path, epochs=2)
    try:
        _ends_epoch(me, 0, 0)
        _ends_epoch(me, 0, 1)
        finished = me.pop_finished_epochs()
        assert [(epoch, tally.behind) for epoch, tally, _ in finished] == [(0, 2)]
        for i in (1, 2):
            _ends_epoch(me, i, 0)  # late: counted in the last epoch
        assert me.pop_finished_epochs() == []  # the last epoch still waits for them
        for i in (1, 2):
            _ends_epoch(me, i, 1)
        last = me.pop_finished_epochs()
        assert [(epoch, tally.behind) for epoch, tally, _ in last] == [(1, 0)]
        share = me.ctx.data.n_train // WORKERS
        # An epoch's record counts its tally's samples (epoch_metrics): 1 share, then 5.
        assert [tally.train.n for _, tally, _ in finished + last] == [share, 5 * share]
        assert last[0][1].late == 2 * share
    finally:
        me.ctx.log.close()
        me.ctx.data.close()
