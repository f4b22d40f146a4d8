"""Which engines of a cluster are dead, and why.

An engine counts as dead when

- its process is gone (engines on this host are looked up by pid),
- the controller unregistered it (its nanny reports the engine's exit at once; the
  controller's heartbeat drops an engine that stopped answering, after 30 s),
- a job gave up on it: it did not stop when asked, and then not when told to abandon
  (it may be blocked inside MPI, or inside the model's own code), or
- it is idle and does not answer a ping within `PING_SECONDS` (frozen: kill -STOP, or a
  node that stopped answering).

An engine that runs a task of ours is busy, not dead: it cannot answer a ping until the
task ends, and the controller's heartbeat (answered by a thread of its own) vouches for it.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import psutil

__all__ = ["DeadEngine", "Liveness", "PING_SECONDS"]

PING_SECONDS = 5.0


class Engine(Protocol):
    """What the health checks read of an engine (cluster.EngineInfo, frozen: read-only)."""

    @property
    def engine_id(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def host(self) -> str: ...
    @property
    def pid(self) -> int: ...
    @property
    def uuid(self) -> str: ...


@dataclass(frozen=True, slots=True)
class DeadEngine:
    rank: int
    engine_id: int
    host: str
    pid: int
    why: str
    since: float  # time.time() when it was found dead (or the controller dropped it)

    def __str__(self) -> str:
        return f"rank {self.rank} (engine {self.engine_id} on {self.host}, pid {self.pid}): {self.why}"


def process_gone(host: str, pid: int) -> bool:
    """True when `pid` runs on this host and is gone (or a zombie). Engines elsewhere: False."""
    if host != socket.gethostname():
        return False
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return False


class Liveness:
    """What a cluster knows about its engines' health, from the client's notifications,
    the processes themselves, pings and the jobs that gave up on an engine."""

    def __init__(self, ping_seconds: float = PING_SECONDS):
        self.ping_seconds = ping_seconds
        self._unregistered: dict[str, float] = {}  # engine uuid -> when the controller dropped it
        self._stuck: dict[str, tuple[str, float]] = {}  # engine uuid -> (why, when)
        self._pings: dict[str, _Ping] = {}  # engine uuid -> its unanswered ping

    def on_registration_event(self, event: dict[str, Any]) -> None:
        """The client's registration callback (it runs on the client's IO thread)."""
        if event.get("event") == "unregister" and event.get("uuid"):
            self._unregistered.setdefault(event["uuid"], time.time())

    def mark_stuck(self, engines: Iterable[Engine], why: str) -> None:
        now = time.time()
        for engine in engines:
            self._stuck.setdefault(engine.uuid, (why, now))

    def busy(self, client: Any, engine: Engine) -> bool:
        """The engine runs (or has queued) a task of this client's other than our ping."""
        outstanding = set(getattr(client, "_outstanding_dict", {}).get(engine.uuid, ()))
        ping = self._pings.get(engine.uuid)
        if ping is not None:
            outstanding -= set(ping.reply.msg_ids)
        return bool(outstanding)

    def verdict(self, client: Any, engine: Engine) -> tuple[str, float] | None:
        """Why the engine is dead and since when, without pinging it; None if not known dead."""
        now = time.time()
        if process_gone(engine.host, engine.pid):
            return "its process is gone", self._unregistered.get(engine.uuid, now)
        if engine.uuid in self._unregistered or client._engines.get(engine.engine_id) != engine.uuid:
            return "the controller dropped it (its engine exited or missed heartbeats)", self._unregistered.get(
                engine.uuid, now
            )
        if engine.uuid in self._stuck:
            why, since = self._stuck[engine.uuid]
            return f"stuck: {why}", since
        ping = self._pings.get(engine.uuid)
        if ping is not None and not ping.reply.ready() and (ping.expired or now - ping.sent > self.ping_seconds):
            return f"no reply to a ping within {self.ping_seconds:g} s (frozen?)", ping.sent
        return None

    def dead(self, client: Any, engines: Sequence[Engine], *, ping: bool = True) -> list[DeadEngine]:
        """The dead among `engines`, the first to die first. With `ping`, idle engines not
        known dead are pinged, and those that do not answer within the deadline are dead."""
        found: list[DeadEngine] = []
        to_ping = []
        for engine in engines:
            verdict = self.verdict(client, engine)
            if verdict is not None:
                found.append(_dead(engine, *verdict))
            elif ping and not self.busy(client, engine):
                to_ping.append(engine)
        if to_ping:
            self._ping(client, to_ping)
            for engine in to_ping:
                verdict = self.verdict(client, engine)
                if verdict is not None:
                    found.append(_dead(engine, *verdict))
        return sorted(found, key=lambda d: d.since)

    def _ping(self, client: Any, engines: list[Engine]) -> None:
        for engine in engines:
            previous = self._pings.get(engine.uuid)
            if previous is None or previous.reply.ready():  # one ping at a time per engine
                self._pings[engine.uuid] = _Ping(client[engine.engine_id].apply_async(os.getpid), time.time())
        deadline = time.monotonic() + self.ping_seconds
        for engine in engines:
            ping = self._pings[engine.uuid]
            ping.reply.wait(max(0.0, deadline - time.monotonic()))
            if ping.reply.ready():
                del self._pings[engine.uuid]
            else:
                ping.expired = True  # waited until the deadline: dead from now on, until it answers


@dataclass(slots=True)
class _Ping:
    reply: Any  # the AsyncResult of os.getpid on the engine
    sent: float
    expired: bool = False


def _dead(engine: Engine, why: str, since: float) -> DeadEngine:
    return DeadEngine(engine.rank, engine.engine_id, engine.host, engine.pid, why, since)
