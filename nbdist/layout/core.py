"""Layout: the roles of N_ranks MPI ranks, built from (N_G, N_F, N_M, N_W, N_P), inferred
from a rank count, and checked with errors that say how to fix them."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from nbdist.layout.communicators import Communicators, split_communicators
from nbdist.layout.roles import LayoutError, Role
from nbdist.layout.tree import draw_tree, layout_nodes, plural

if TYPE_CHECKING:  # pragma: no cover
    from mpi4py import MPI

__all__ = ["Layout", "TOPOLOGIES"]

TOPOLOGIES = ("master-worker", "allreduce")

# Option names as the command line and the magics spell them; error messages name them
# so that the fix can be typed as read.
_FLAG = {
    "workers": "--workers",
    "masters": "--masters",
    "procs_per_worker": "--procs-per-worker",
    "groups": "--groups",
    "folds": "--folds",
}


def _count(name: str, value: Any) -> int:
    # bool is an int to Python, but `workers=True` is a bug, not a count.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise LayoutError(f"{name} must be a whole number >= 1, got {value!r}: set {_FLAG[name]} to 1 or more")
    return int(value)


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """The roles of N_ranks = [1] + N_G x N_F x (N_M + N_M x N_W x N_P) MPI ranks.

    `workers` is per master (allreduce: per fold); `masters` is ignored (set to 0) in the
    allreduce topology, where every rank is a worker process.
    """

    workers: int = 1
    masters: int = 1
    procs_per_worker: int = 1
    groups: int = 1
    folds: int = 1
    topology: str = "master-worker"
    coordinator: bool = False
    roles: tuple[Role, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.topology not in TOPOLOGIES:
            raise LayoutError(
                f"unknown topology {self.topology!r}: use --topology master-worker or --topology allreduce"
            )
        for name in ("workers", "procs_per_worker", "groups", "folds"):
            object.__setattr__(self, name, _count(name, getattr(self, name)))
        if self.topology == "allreduce":
            # No masters at all, whatever was passed: the same options can then be
            # reused when switching topology in a notebook.
            object.__setattr__(self, "masters", 0)
        else:
            object.__setattr__(self, "masters", _count("masters", self.masters))
        if not isinstance(self.coordinator, bool):
            raise LayoutError(f"coordinator must be True or False, got {self.coordinator!r}")
        object.__setattr__(self, "roles", self._build_roles())

    # -- construction ---------------------------------------------------------------

    @classmethod
    def for_world(cls, size: int, *, workers: int | None = None, **options: Any) -> Layout:
        """The layout of `size` ranks; with `workers=None` the worker count is inferred."""
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
            raise LayoutError(f"the number of MPI ranks must be a whole number >= 1, got {size!r}")
        size = int(size)
        if workers is not None:
            layout = cls(workers=workers, **options)
            if layout.n_ranks != size:
                started = "1 was" if size == 1 else f"{size} were"
                hint = "change --workers"
                fits = cls._infer_workers(size, layout)
                if fits is not None:
                    hint = f"use --workers {fits} to fit {size} ranks"
                raise LayoutError(
                    f"this layout needs {layout.n_ranks} ranks "
                    f"({layout._formula(str(layout.workers))}), but {started} started: "
                    f"start {layout.n_ranks} ranks (-n {layout.n_ranks}), or {hint}"
                )
            return layout

        probe = cls(workers=1, **options)  # validates every other option first
        fixed, step = probe._fixed_and_step()
        fits = cls._infer_workers(size, probe)
        if fits is None:
            valid = [fixed + step * w for w in (1, 2, 3)]
            scaled = "W" if step == 1 else f"{step} x W"
            needs = f"{fixed} + {scaled}" if fixed else scaled
            per = "per master" if probe.topology == "master-worker" else "per fold"
            # The valid sizes either side of the one asked for, as ready-to-type fixes (the
            # smallest when the one asked for is below it).
            below = (size - fixed) // step
            workers = [w for w in (below, below + 1) if w >= 1] or [1]
            runs = [f"-n {fixed + step * w} (W = {w})" for w in workers]
            knobs = ["--procs-per-worker", "--groups", "--folds"]
            if probe.topology == "master-worker":
                knobs.insert(0, "--masters")
            raise LayoutError(
                f"{plural(size, 'rank')} cannot be laid out as {probe._formula('W')}: "
                f"this layout needs {needs} ranks for W workers {per} "
                f"({', '.join(map(str, valid))}, ...): start {' or '.join(runs)}, or change "
                f"{', '.join(knobs)}"
            )
        return cls(workers=fits, **options)

    @classmethod
    def fitting(cls, size: int, *, masters: int = 1, **options: Any) -> Layout:
        """The layout of `size` ranks nearest to `masters` masters, the workers inferred:
        that many masters if they fit, else the most below that do. For a run laid out
        anew on a size it did not choose (a restart on the ranks left, a resume on another
        `-n`): 5 ranks take 2 masters x (1 + W workers) nowhere, 1 master + 4 workers
        instead. Raises `for_world`'s error for `masters` when no count fits."""
        try:
            return cls.for_world(size, masters=masters, **options)
        except LayoutError as exc:
            first = exc
        if isinstance(masters, numbers.Integral) and not isinstance(masters, bool):
            for fewer in range(int(masters) - 1, 0, -1):
                try:
                    return cls.for_world(size, masters=fewer, **options)
                except LayoutError:
                    continue
        raise first

    @classmethod
    def within(cls, size: int, **options: Any) -> Layout:
        """The `fitting` layout of the most ranks, at most `size`: a pipeline of 2 stages
        per worker that lost a rank (1 master + 2 workers x 2 stages, 4 ranks left) goes on
        as 1 master + 1 worker of 2 on 3 of them. Raises `fitting`'s error for `size`
        when no size fits."""
        try:
            return cls.fitting(size, **options)
        except LayoutError as exc:
            first = exc
        for fewer in range(size - 1, 0, -1):
            try:
                return cls.fitting(fewer, **options)
            except LayoutError:
                continue
        raise first

    @staticmethod
    def _infer_workers(size: int, layout: Layout) -> int | None:
        fixed, step = layout._fixed_and_step()
        workers, rest = divmod(size - fixed, step)
        return workers if rest == 0 and workers >= 1 else None

    def _fixed_and_step(self) -> tuple[int, int]:
        # n_ranks = fixed + step x workers: the arithmetic behind inference and its errors.
        runs = self.groups * self.folds
        fixed = int(self.coordinator) + runs * self.masters
        step = runs * max(self.masters, 1) * self.procs_per_worker
        return fixed, step

    def _build_roles(self) -> tuple[Role, ...]:
        roles: list[Role] = []
        if self.coordinator:
            roles.append(Role(0, "coordinator", None, None, None, None, None))

        def add_workers(g: int, f: int, m: int | None) -> None:
            for w in range(self.workers):
                for p in range(self.procs_per_worker):
                    roles.append(Role(len(roles), "worker", g, f, m, w, p))

        for g in range(self.groups):
            for f in range(self.folds):
                if self.topology == "allreduce":
                    add_workers(g, f, None)
                    continue
                for m in range(self.masters):
                    roles.append(Role(len(roles), "master", g, f, m, None, None))
                    add_workers(g, f, m)
        return tuple(roles)

    # -- queries ---------------------------------------------------------------------

    @property
    def n_ranks(self) -> int:
        fixed, step = self._fixed_and_step()
        return fixed + step * self.workers

    @property
    def ranks_per_run(self) -> int:
        """Ranks of one training run (one fold of one group)."""
        return (self.n_ranks - int(self.coordinator)) // (self.groups * self.folds)

    def role(self, rank: int) -> Role:
        if not 0 <= rank < self.n_ranks:
            raise LayoutError(f"rank {rank} is outside this layout of {self.n_ranks} ranks (0-{self.n_ranks - 1})")
        return self.roles[rank]

    def fold_ranks(self, group: int, fold: int) -> list[int]:
        """The world ranks of one training run, in rank order."""
        if not (0 <= group < self.groups and 0 <= fold < self.folds):
            raise LayoutError(
                f"there is no group {group}, fold {fold} in a layout of "
                f"{plural(self.groups, 'group')} x {plural(self.folds, 'fold')}"
            )
        start = int(self.coordinator) + (group * self.folds + fold) * self.ranks_per_run
        return list(range(start, start + self.ranks_per_run))

    # -- printing --------------------------------------------------------------------

    def _formula(self, workers: str) -> str:
        """The layout as a product, e.g. "2 groups x 1 fold x (1 master + 4 workers)"."""
        unit = plural(workers, "worker")
        if self.procs_per_worker > 1:
            unit += f" of {self.procs_per_worker} processes"
        if self.topology == "allreduce":
            inner = unit
        elif self.masters == 1:
            inner = f"1 master + {unit}"
        else:
            inner = f"{self.masters} masters x (1 + {unit})"
        if self.groups > 1 or self.folds > 1:
            if self.topology == "master-worker" and self.masters == 1:
                inner = f"({inner})"
            inner = f"{plural(self.groups, 'group')} x {plural(self.folds, 'fold')} x {inner}"
        return f"1 coordinator + {inner}" if self.coordinator else inner

    def describe(self) -> str:
        """One line, e.g. "11 ranks: 1 coordinator + 2 groups x 1 fold x (1 master + 4 workers)"."""
        return f"{plural(self.n_ranks, 'rank')}: {self._formula(str(self.workers))}"

    def to_dict(self) -> dict[str, Any]:
        """The tree as plain JSON-able data: options, then nested nodes.

        Every node has `kind`, `ranks` (the world ranks below it, sorted) and `children`;
        groups, folds, masters and workers carry their `index`, masters `top`, and
        coordinator/master/worker nodes their own `rank` (a worker's: its leader's).
        """
        options = {
            name: getattr(self, name)
            for name in ("topology", "workers", "masters", "procs_per_worker", "groups", "folds", "coordinator")
        }
        return {"options": options, "n_ranks": self.n_ranks, "describe": self.describe(), "nodes": layout_nodes(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Layout:
        """The layout that `to_dict` described."""
        return cls(**data["options"])

    def tree(self) -> str:
        """A printable tree; group and fold levels of count 1 are folded into one line."""
        return draw_tree(self)

    def __str__(self) -> str:
        return self.tree()

    # -- MPI -------------------------------------------------------------------------

    def split(self, comm: MPI.Intracomm) -> Communicators:
        """This rank's sub-communicators; collective over `comm`.

        Every rank makes the same `Split` calls in the same order (non-members pass
        `MPI.UNDEFINED` and get `MPI.COMM_NULL`), so no rank can wait on a split that
        another rank skipped. Splits that no rank of this topology joins are not made.
        """
        if comm.Get_size() != self.n_ranks:
            # Every rank sees the same size, so every rank raises: no hang.
            raise LayoutError(
                f"this layout needs {self.n_ranks} ranks ({self._formula(str(self.workers))}), "
                f"but the communicator has {comm.Get_size()}: start {self.n_ranks} ranks (-n {self.n_ranks}), "
                f"or build the layout with Layout.for_world({comm.Get_size()}, ...)"
            )
        return split_communicators(self, comm)
