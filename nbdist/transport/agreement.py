"""Set-up errors agreed on by every rank: one rank's mistake becomes the same error on all.

A rank whose set-up failed (a model that does not build, a missing file) must not leave
the others waiting in the first collective of the training: every rank reaches `agree`
with its error or None, and all raise the first failed rank's error, of its class.
"""

from __future__ import annotations

from typing import Any

from nbdist.errors import UserError
from nbdist.transport.collectives import Collectives
from nbdist.transport.peers import SETUP_TIMEOUT

__all__ = ["agree"]


def agree(comm: Any, error: BaseException | None, collectives: Collectives | None = None) -> None:
    """Collective: raise the same UserError on every rank when any rank failed setup (of
    the first failed rank's class, so that a caller can tell kinds of mistakes apart).

    Polled, with a deadline (SETUP_TIMEOUT): a rank that never gets here is named (with
    `collectives` that can call the roll) instead of leaving the others waiting."""
    collectives = collectives or Collectives(lambda: SETUP_TIMEOUT)
    messages = collectives.allgather(comm, None if error is None else _describe(error), "the end of set-up")
    failed = [(rank, tuple(msg)) for rank, msg in enumerate(messages) if msg is not None]
    if not failed:
        return
    texts = {msg for _, (_, msg) in failed}
    rank, (kind, msg) = failed[0]
    if len(failed) < len(messages) and len(texts) == 1:
        msg = f"{msg} (on rank{'s' if len(failed) > 1 else ''} {', '.join(str(r) for r, _ in failed)})"
    raise _error_class(kind)(msg)


def _describe(error: BaseException) -> tuple[str, str]:
    """The error's class (by name) and message, as every rank can rebuild it: nbdist's own
    classes travel, a class from the user's code would not exist on every rank."""
    if isinstance(error, UserError):
        kind = type(error) if type(error).__module__.startswith("nbdist.") else UserError
        return f"{kind.__module__}:{kind.__qualname__}", str(error)
    return f"{UserError.__module__}:{UserError.__qualname__}", f"{type(error).__name__}: {error}"


def _error_class(name: str) -> type[UserError]:
    import importlib

    module, _, qualname = name.partition(":")
    kind: Any = importlib.import_module(module) if module.startswith("nbdist.") else None
    for part in qualname.split(".") if kind is not None else ():
        kind = getattr(kind, part, None)
    return kind if isinstance(kind, type) and issubclass(kind, UserError) else UserError
