"""The master of the master/worker (parameter server) topology: serving its clients.

Master (rank 0 of the `block` communicator) holds the centre. It keeps ONE receive posted
per client, for the small header of its next message, and serves whatever has arrived, so
every client is served in turn and none starves, unlike `recv(ANY_SOURCE)`. An update's
body (its payload and model state) is received only once its header is in, into one of
a few pooled buffers (transport/pool.py): the master's memory does not grow with its
number of clients. Asynchronous, a pass serves at most as many updates as the pool has
buffers (ASYNC_BODIES); the others stay ready and are served first at the next pass.
Synchronous, once every header of the round is in (they carry the sample counts), the
workers' bodies are streamed through the same few buffers into the rule's
`master_round`, which folds them into one round buffer as it draws them (the next body
is received while the rule works on the current one): the memory of a synchronous
master does not grow with its workers either. Only the bodies of a top master's
sub-masters are held for the round (one per sub-master, see _merge_masters).

Asynchronous: each update is applied as it comes and answered once the updates served
with it are applied too. Synchronous: the master waits for one update from every client
still training and applies them together; a client that has finished says DONE and
leaves the round, so a worker that ends early never blocks the others.

A master's clients are its workers and, at the top master of a run with `--masters` > 1,
the sub-masters (hierarchy.py), which run this same serving loop for their own workers
and differ from the top master only at the `Master` methods they override.

Every update carries the version of the centre it was computed from; the master records
staleness = current version - that version, per update and per client rank.

Replies leave without blocking the master: it sends a reply, posts the client's next
receive at once (the client sends nothing before it has taken its reply) and goes on
serving. The centre a reply reads must not move under it: before the next update moves
the centre, the master waits for the centre's replies still in flight, up to a moment
(REPLY_WAIT) - by then a client that runs has usually taken its reply, while the master
was receiving the next update. A reply still in flight after that (its client is frozen,
or descheduled) stays pending while the master serves the others: it reaches a slow
client partly updated, as a Hogwild read would; a frozen client's is discarded with it,
see below.

Failures. A client whose process died (MPI's fault tolerance reports it), or that stayed
silent or did not take its reply for longer than the peer timeout (frozen), is *lost*. Asynchronous, a lost worker is
dropped and the run goes on: from the next epoch its share of the data goes to the
others (membership.py), the loss is recorded, and if it wakes up it is answered DROPPED.
Synchronous (every round needs every worker), or a lost sub-master: the run cannot go
on, and a RunFailure ends it (the survivors restart from the last checkpoint when the
user allowed restarts; roles/runner.py).

Checkpoints. Synchronous runs checkpoint at epoch ends: every worker writes its share at
its epoch boundary, the master when the epoch ends. Asynchronous workers are at different
epochs, so an epoch-aligned checkpoint would hold only what the slowest one did: instead
the master takes a *snapshot* when an epoch is due, of what every live rank has now. It
saves the centre at once, answers each client's next update with SNAPSHOT instead of
applying it; the client saves its state (the update not applied: a resume redoes it, as
after a stop) and sends the update again. The checkpoint commits when every live client
has acknowledged it.

The modules, along the data flow of one pass of `serve` (run.py): clients.py (whom it
serves), receive.py (headers, bodies, what each message asks for), apply.py (the rule on
the updates), replies.py (answers that do not block, the centre they read), epochs.py
(tallies, validation, checkpoints), state.py (the Master's state and the decisions a
sub-master takes differently). The MPI side is transport/master_channel.py.
"""

from __future__ import annotations

from nbdist.roles.master.clients import SUB_MASTER, WORKER, Client, worker_clients
from nbdist.roles.master.epochs import (
    average_state,
    commit_ready_checkpoints,
    finish_checkpoints,
    open_tallies,
    restore_tallies,
)
from nbdist.roles.master.replies import settle_centre
from nbdist.roles.master.run import open_master, run_master, serve, serve_and_settle, share_initial_weights
from nbdist.roles.master.state import Master

__all__ = [
    "Master",
    "Client",
    "run_master",
    "worker_clients",
    "share_initial_weights",
    "open_master",
    "serve",
    "serve_and_settle",
    "settle_centre",
    "average_state",
    "open_tallies",
    "restore_tallies",
    "commit_ready_checkpoints",
    "finish_checkpoints",
    "WORKER",
    "SUB_MASTER",
]
