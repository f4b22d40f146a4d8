"""Replies that leave without blocking the master, and the centre they read: it must not
move under a reply still in flight (settle_centre), and a client that does not take its
reply within the peer timeout is lost."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from nbdist.roles.master.clients import WORKER
from nbdist.transport import messages as m
from nbdist.transport.master_channel import Transfer
from nbdist.transport.waiting import CommFailure, WaitTimeout

if TYPE_CHECKING:
    from nbdist.roles.master.state import Master

__all__ = ["REPLY_WAIT", "reply", "settle_centre", "reply_left", "check_replies"]

# How long a master waits for a reply of the centre to leave before it moves the centre.
REPLY_WAIT = 0.5


@dataclass(slots=True)
class _Reply:
    """A reply still in flight: its sends, whether it reads the centre, the pooled body it
    reads instead (given back once it has left), and since when."""

    sends: Transfer
    reads_centre: bool
    body: m.Body | None = None
    since: float = field(default_factory=time.monotonic)


def reply(me: Master, i: int, kind: float, payload: np.ndarray, *, label: str = "", repost: bool = True) -> None:
    """Answer client i (header, then the payload array itself) without waiting for it to
    leave, and post its next receive: the client sends nothing before it has taken the
    reply. The body of its update goes back to the pool, once the reply has left when
    the reply is that body (check_replies).

    The header names the workers that share the next epoch's data when the client's
    message ended an epoch."""
    t0 = time.perf_counter()
    if i in me.replying:  # its previous reply, taken by now: the client has sent again
        reply_left(me, i, REPLY_WAIT)
    client, header = me.clients[i], me.reply_headers[i]
    header[m.KIND] = kind
    header[m.VERSION] = me.version
    header[m.CHECKPOINT] = m.label_code(label or me.stop_label) if kind in (m.STOP, m.SNAPSHOT) else m.NO_CHECKPOINT
    epoch = int(client.inbox.header[m.EPOCH]) + (1 if client.inbox.has(m.EPOCH_END) else 0)
    header[m.EPOCH] = epoch
    header[m.WINDOW :] = 0.0
    if me.windows is not None and client.kind == WORKER:
        # Dynamic local steps: a CONTINUE begins the worker's next window, of the length
        # named when its update was applied (master/windows.py); other replies time none.
        header[m.WINDOW] = me.windows.named[i] if kind == m.CONTINUE else 0.0
        if kind == m.SNAPSHOT:
            me.windows.sent_back(i, client.silence.last)
        else:
            me.windows.begin(i, time.monotonic(), timed=kind == m.CONTINUE)
    if me.members.workers:
        for w in me.members.of(epoch, me.live_workers()):
            header[m.MEMBERS + w] = 1.0
    body, client.body = client.body, None
    held = body if body is not None and np.may_share_memory(payload, body.buffer) else None
    if body is not None and held is None:
        me.pool.give_back(body)
    me.replying[i] = _Reply(me.channel.reply(i, header, payload), reads_centre=_reads_centre(me, payload), body=held)
    client.silence.restart()  # its next message comes after its next steps, from now
    if repost:
        me.channel.post(i)
    reply_left(me, i, 0)
    me.phases["reply"] += time.perf_counter() - t0


def _reads_centre(me: Master, payload: np.ndarray) -> bool:
    """Whether a reply reads what the next round or update overwrites: the centre, or the
    round buffer (EASGD's synchronous reply, the centre before the round)."""
    return np.may_share_memory(payload, me.centre) or (
        me.round_buffer is not None and np.may_share_memory(payload, me.round_buffer)
    )


def settle_centre(me: Master) -> None:
    """Before the centre moves: wait for the replies that still read it, each once and for
    up to REPLY_WAIT (one still in flight after that reaches its client partly updated)."""
    t0 = time.perf_counter()
    for i in [i for i, pending in me.replying.items() if pending.reads_centre]:
        if i in me.replying and not reply_left(me, i, REPLY_WAIT):
            me.replying[i].reads_centre = False
    me.phases["reply"] += time.perf_counter() - t0


def reply_left(me: Master, i: int, wait: float) -> bool:
    """Whether client i's reply has left (waiting up to `wait` seconds); then the body it
    read goes back to the pool. A client found dead meanwhile is lost."""
    pending = me.replying[i]
    try:
        if wait > 0:
            pending.sends.wait(wait)
        elif not pending.sends.done():
            return False
    except WaitTimeout:
        return False
    except CommFailure:
        del me.replying[i]
        if pending.body is not None:
            me.pool.write_off(pending.body)
        me.channel.forget(i)
        if i in me.active:
            me.lose(i, "died", gone=True)
        return True
    del me.replying[i]
    if pending.body is not None:
        me.pool.give_back(pending.body)
    return True


def check_replies(me: Master) -> None:
    """Replies still in flight: give back the bodies of those that have left; lose the
    clients that have not taken theirs within the peer timeout (frozen). A dropped
    client's reply stays in flight (its body written off: the pool makes another): if it
    wakes up and takes it, its next update is received and answered DROPPED."""
    for i in list(me.replying):
        if reply_left(me, i, 0):
            continue
        pending, limit = me.replying[i], me.clients[i].silence.limit
        if i in me.active and time.monotonic() - pending.since > limit:
            if pending.body is not None:
                me.pool.write_off(pending.body)
                pending.body = None
            me.lose(i, f"did not take its reply for {limit:.0f} s (the peer timeout)", gone=False)
