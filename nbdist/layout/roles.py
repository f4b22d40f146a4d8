"""What one rank is in a layout (a Role), and the error of a layout that cannot be built."""

from __future__ import annotations

from dataclasses import dataclass

from nbdist.errors import UserError

__all__ = ["Role", "LayoutError"]


class LayoutError(UserError, ValueError):
    """A rank layout that cannot be built; the message says why and how to fix it."""


@dataclass(frozen=True, slots=True)
class Role:
    """What one world rank is in a `Layout`."""

    rank: int
    kind: str  # "coordinator" | "master" | "worker"
    group: int | None
    fold: int | None
    master: int | None  # a worker's master; None in allreduce and for the coordinator
    worker: int | None  # under its master (allreduce: within the fold)
    proc: int | None  # within its worker; 0 is the leader

    @property
    def run(self) -> tuple[int, int]:
        """(group, fold) of a rank of a run (the coordinator is in none: LayoutError)."""
        if self.group is None or self.fold is None:
            raise LayoutError(f"{self} is in no run")
        return self.group, self.fold

    @property
    def master_index(self) -> int:
        """A master's index, or a worker's master's (LayoutError where there is none)."""
        return _present(self.master, "master", self)

    @property
    def worker_index(self) -> int:
        return _present(self.worker, "worker", self)

    @property
    def proc_index(self) -> int:
        """The process within its worker (0: the leader)."""
        return _present(self.proc, "process of a worker", self)

    @property
    def is_top_master(self) -> bool:
        return self.kind == "master" and self.master == 0

    @property
    def is_sub_master(self) -> bool:
        return self.kind == "master" and (self.master or 0) > 0

    @property
    def is_leader(self) -> bool:
        return self.kind == "worker" and self.proc == 0

    def __str__(self) -> str:
        if self.kind == "coordinator":
            return f"rank {self.rank}: coordinator"
        where = f"group {self.group}, fold {self.fold}"
        if self.kind == "master":
            return f"rank {self.rank}: master {self.master} ({where})"
        boss = "" if self.master is None else f" of master {self.master}"
        return f"rank {self.rank}: worker {self.worker}{boss}, process {self.proc} ({where})"


def _present(index: int | None, what: str, role: Role) -> int:
    if index is None:
        raise LayoutError(f"{role} has no {what} index")
    return index
