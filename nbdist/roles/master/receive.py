"""Reading what clients sent: waiting for headers (any client, or a whole synchronous
round), receiving bodies into the pool, and sorting each message into an update to
apply, a reply to give at once, or a client that leaves."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from nbdist.algorithms.base import Update
from nbdist.errors import TrainingError
from nbdist.roles.master.clients import SUB_MASTER, WORKER
from nbdist.roles.master.epochs import (
    note_checkpoint_ack,
    tally_message,
)
from nbdist.roles.master.replies import REPLY_WAIT, check_replies, reply, reply_left
from nbdist.transport import messages as m
from nbdist.transport.master_channel import Transfer
from nbdist.transport.waiting import CommFailure, WaitTimeout

if TYPE_CHECKING:
    from nbdist.roles.master.state import Master

__all__ = ["SILENCE_CHECK_EVERY", "wait_for_clients", "read_messages", "round_updates"]

# Longest a master waits for messages before it looks at its clients' silence again.
SILENCE_CHECK_EVERY = 0.5


def wait_for_clients(me: Master) -> list[int]:
    """The clients whose message is in: any one when asynchronous, every client still
    training when synchronous. Clients found dead, or silent for longer than the peer
    timeout, are lost on the way (Master.lose)."""
    t0 = time.perf_counter()
    carried, me.waiting = me.waiting, []  # ready since the last pass: served first
    ready: set[int] = set(carried)
    synchronous = me.ctx.options.synchronous
    while me.active:
        check_replies(me)
        # Also while the others keep the master busy: a frozen client sends nothing.
        silence_due = time.monotonic() - me.silence_checked >= SILENCE_CHECK_EVERY
        # Dropped clients keep their receive posted: one that wakes up is told DROPPED.
        done, failed = me.channel.wait_headers(timeout=0 if ready or silence_due else SILENCE_CHECK_EVERY)
        for i in failed:
            if i in me.active:
                me.lose(i, "died", gone=True)
        for i in done:
            me.clients[i].silence.heard()
        if silence_due:
            # Only once the headers that came are taken in: a master held up elsewhere
            # (for a peer timeout, by a body that did not come) would otherwise find a
            # client whose header waited unread as silent as a frozen one.
            me.silence_checked = time.monotonic()
            _check_silence(me)
        ready.update(done)
        if ready and (not synchronous or me.active <= ready):
            break
    me.phases["wait"] += time.perf_counter() - t0
    order = carried + sorted(ready - set(carried))
    return [i for i in order if i in me.active or i in me.dropped]


def _check_silence(me: Master) -> None:
    """Clients whose message the master still waits for, silent too long since it last
    answered them: lost (frozen, or far slower than their peer timeout allows)."""
    for i in sorted(me.active):
        silence = me.clients[i].silence
        if me.channel.listening(i) and silence.exceeded:
            me.lose(
                i,
                f"sent nothing for {silence.silent_for():.0f} s (the peer timeout is {silence.limit:.0f} s)",
                gone=False,
            )


def read_messages(me: Master, ready: list[int]) -> list[tuple[int, Update]]:
    """Handle what the `ready` clients sent (those the pool has bodies for); returns the
    updates to apply. Every body received is given back by its reply (`reply`)."""
    updates: list[tuple[int, Update]] = []
    # Synchronous: the workers' bodies are received as the round applies them (round_updates).
    streamed = {i for i in ready if me.ctx.options.synchronous and me.clients[i].kind == WORKER}
    for i in _receive_bodies(me, ready, streamed):
        client = me.clients[i]
        msg = client.inbox
        kind = msg.header[m.KIND]
        if i in me.dropped:
            # Woke up after the run went on without it: it must leave.
            if kind not in (m.DONE, m.ERROR, m.LOST) and _body_in(me, i):
                reply(me, i, m.DROPPED, me.centre, repost=False)
            continue
        note_checkpoint_ack(me, i, msg)
        if kind == m.DONE:
            _retire(me, i)
            me.finished.add(i)
            continue
        if kind in (m.ERROR, m.LOST):
            text = _error_text(me, i)
            if kind == m.LOST:
                _retire(me, i)
                me.lose(i, text, gone=True)
            else:
                _client_failed(me, i, text)
            continue
        if msg.has(m.STOP_REQUEST):
            me.request_stop("stop requested")
        if me.stopping:
            # The update is dropped (and not counted): the client checkpoints the
            # state it had before it and leaves.
            if _body_in(me, i):
                reply(me, i, m.STOP, me.centre)
            continue
        if me.snapshot and i not in me.snapshot_told:
            # Not applied: the client saves the state it had before it, then sends it again.
            if _body_in(me, i):
                me.snapshot_told.add(i)
                reply(me, i, m.SNAPSHOT, me.centre, label=me.snapshot)
            continue
        tally_message(me, i, msg)
        # Staleness is set when the update is applied (apply_updates), not now: the
        # updates of one batch are applied one by one, each one version later.
        update = Update(None, 0, int(msg.header[m.SAMPLES]), int(msg.header[m.VERSION]))
        if i not in streamed:
            me.states[i] = client.body.state
            update.payload = client.body.payload
        updates.append((i, update))
    return updates


def _body_in(me: Master, i: int) -> bool:
    """Whether client i's body is in, receiving it now if it was left to a synchronous
    round (round_updates) that will not apply it: it was sent, and must be received
    before the reply. False when it did not arrive (the client is lost)."""
    client = me.clients[i]
    if client.body is not None or client.inbox.header[m.KIND] != m.UPDATE:
        return True
    body = _take_body(me)
    if body is None:  # between rounds every body is free
        raise TrainingError("internal: no receive buffer free for a synchronous master")
    return _body_arrived(me, i, _receive_body(me, i, body))


def round_updates(me: Master, round: list[tuple[int, Update]]) -> Iterator[Update]:
    """A synchronous round's updates for the rule's master_round, each body received as
    the rule draws it and given back once the rule draws the next; the next body's
    receive is posted first, so that it arrives while the rule works on this one: the
    round holds two bodies, not one per worker. A body that does not arrive loses its
    client, which ends a synchronous run."""
    receiving: dict[int, Transfer] = {}
    for k, (i, update) in enumerate(round):
        for ahead in (k, k + 1):
            if ahead < len(round) and ahead not in receiving and (body := me.pool.take()) is not None:
                receiving[ahead] = _receive_body(me, round[ahead][0], body)
        if k not in receiving:  # the previous body was given back: cannot happen
            raise TrainingError("internal: no receive buffer free for a synchronous round")
        t0 = time.perf_counter()
        arrived = _body_arrived(me, i, receiving.pop(k))
        me.phases["wait"] += time.perf_counter() - t0
        if not arrived:  # lose() raises for a synchronous worker: only a bug gets here
            raise TrainingError(f"internal: {me.clients[i].describe(me.ctx)} left a synchronous round")
        client = me.clients[i]
        me.states[i] = client.body.state
        update.payload = client.body.payload
        yield update
        update.payload = None
        me.pool.give_back(client.body)
        client.body = None


def _receive_bodies(me: Master, ready: list[int], streamed: set[int]) -> list[int]:
    """Receive the bodies of the ready clients' updates into pooled buffers, but those of
    `streamed` clients (a synchronous round receives them as it applies them); returns
    the clients served now: those without an update first, then the updates, each in
    order. Those the pool has no buffer for wait for the next pass, in order; a client
    whose body does not follow its header is lost."""
    t0 = time.perf_counter()
    served: list[int] = []
    receiving: list[tuple[int, Transfer | None]] = []
    for i in ready:
        client = me.clients[i]
        if client.inbox.header[m.KIND] != m.UPDATE:
            served.append(i)
            continue
        if i in streamed:
            receiving.append((i, None))
            continue
        body = None if me.waiting else _take_body(me)
        if body is None:
            me.waiting.append(i)
            continue
        receiving.append((i, _receive_body(me, i, body)))
    for i, request in receiving:
        if request is None or _body_arrived(me, i, request):
            served.append(i)
    me.phases["wait"] += time.perf_counter() - t0  # receiving is part of waiting for a message
    return served


def _take_body(me: Master) -> m.Body | None:
    """A free body; when all are lent, one that a reply in flight gives back soon. A reply
    that does not leave within REPLY_WAIT (its client is frozen, or descheduled) has its
    body written off, and a new one is made: the others are not served at its pace."""
    body = me.pool.take()
    if body is None:
        check_replies(me)
        body = me.pool.take()
    if body is None:
        holders = [i for i, pending in me.replying.items() if pending.body is not None]
        if holders and not reply_left(me, holders[0], REPLY_WAIT) and holders[0] in me.replying:
            stuck = me.replying[holders[0]]
            me.pool.write_off(stuck.body)  # the reply in flight keeps the buffer alive
            stuck.body = None
        body = me.pool.take()
    return body


def _receive_body(me: Master, i: int, body: m.Body) -> Transfer:
    client = me.clients[i]
    client.body = body
    return me.channel.receive_body(i, body.incoming(client.codec is not None))


def _body_arrived(me: Master, i: int, receiving: Transfer) -> bool:
    """Wait for client i's body, sent right after its header (within the peer timeout)."""
    client = me.clients[i]
    try:
        receiving.wait(client.silence.limit)
        if client.codec is not None:  # the one place a worker's encoded payload is decoded
            client.codec.decode(client.body.wire, client.body.payload)
        return True
    except CommFailure:
        me.pool.write_off(client.body)
        client.body = None
        me.channel.forget(i)
        if i in me.active:
            me.lose(i, "died", gone=True)
    except WaitTimeout:
        me.pool.write_off(client.body)  # still posted: MPI may yet write into it
        client.body = None
        if i in me.active:
            me.lose(
                i,
                f"sent a header but not its update within {client.silence.limit:.0f} s (the peer timeout)",
                gone=False,
            )
    return False


def _error_text(me: Master, i: int) -> str:
    """The text that follows an ERROR or LOST header (sent right after it)."""
    try:
        return str(me.channel.error_text(i, me.clients[i].silence.limit))
    except (WaitTimeout, CommFailure):
        return "failed (its message did not arrive)"


def _retire(me: Master, i: int) -> None:
    me.active.discard(i)
    me.channel.forget(i)


def _client_failed(me: Master, i: int, text: str) -> None:
    client = me.clients[i]
    me.error = me.error or text
    me.failed.add(i)
    me.request_stop(f"error on {client.describe(me.ctx)}")
    if client.kind == SUB_MASTER:
        # It still has workers to stop: it passes this STOP on to them, then says DONE,
        # so no rank is still writing into the run directory when the top master leaves.
        reply(me, i, m.STOP, me.centre)
    else:
        _retire(me, i)
