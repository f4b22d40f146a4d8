"""One rank of bench/startup.py: `python -m nbdist ARGS` with a clock on its phases.

It times the real command: the phase ends are marked by wrapping a few of nbdist's
functions (nothing else changes), and each rank writes, when its `main()` returns, the
wall-clock time (time.time(), comparable across the ranks of one machine) and the CPU
time it had used at the end of each phase into $NBDIST_STARTUP_MARKS/rank-N.json.
What comes after `main()` (leaving the run, the exit) is the job's end time minus the
last mark, taken by the launcher.
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import time


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


MARKS: list[tuple[str, float, float]] = [("python up", time.time(), _cpu())]


def mark(name: str) -> None:
    MARKS.append((name, time.time(), _cpu()))


def _timed(owner, attr: str, name: str | None, *, before: str | None = None) -> None:
    """Mark `name` when owner.attr returns, `before` when it is called."""
    original = getattr(owner, attr, None)
    if original is None:  # another revision of nbdist (--against) may lack it
        return

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if before:
            mark(before)
        try:
            return original(*args, **kwargs)
        finally:
            if name:
                mark(name)

    setattr(owner, attr, wrapper)


def _save() -> None:
    out = os.environ["NBDIST_STARTUP_MARKS"]
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump({"rank": int(rank), "marks": MARKS}, f)


def main() -> None:
    from nbdist.train.stopping import catch_stop_signals_early

    catch_stop_signals_early()  # as nbdist/__main__.py does for train
    import nbdist.cli

    mark("nbdist.cli imported")
    # import_module: the attribute nbdist.train is the function, not the package.
    runner = importlib.import_module("nbdist.roles.runner")
    context = importlib.import_module("nbdist.train.context")
    try:  # the set-up's checks; an older revision (--against) has them in train/context.py
        settle = importlib.import_module("nbdist.train.settle")
    except ModuleNotFoundError:
        settle = context
    definition = importlib.import_module("nbdist.train.definition")

    mark("roles imported, MPI up")
    # Wrapped in the modules that call them, in the order settle() calls them.
    _timed(definition, "load_model_file", "model file run (its imports)")
    _timed(settle, "check_data_size", None, before="data loaded")
    _timed(settle, "convert_for_sync", "model built")
    _timed(settle, "plan_learning_rates", None, before="optimizers checked")
    _timed(context, "settle", "settled (probes, checks)")
    _timed(runner, "prepare", "run prepared (run dir, store)")
    _timed(runner, "_train_in_role", "trained")
    real_main = nbdist.cli.main

    def main_and_save(argv=None):
        try:
            return real_main(argv)
        finally:
            mark("main() returned")
            _save()

    nbdist.cli.main = main_and_save
    nbdist.cli.run()  # exits


if __name__ == "__main__":
    main()
