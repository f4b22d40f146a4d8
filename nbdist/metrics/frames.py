"""A run's metric records as pandas tables: what a notebook's `job.history`,
`job.staleness` and `job.epochs` show. pandas is imported only when a table is asked for."""

from __future__ import annotations

from typing import Any

from nbdist.metrics.updates import staleness_by_rank

__all__ = ["epochs_frame", "history_frame", "staleness_frame"]


def history_frame(records: list[dict[str, Any]]) -> Any:
    """Every record, one row each, its values flattened into columns, in time order."""
    import pandas as pd

    rows = [{**{k: v for k, v in r.items() if k != "values"}, **r["values"]} for r in records]
    frame = pd.DataFrame(rows)
    if not frame.empty:
        frame = frame.sort_values("time", kind="stable").reset_index(drop=True)
    return frame


def staleness_frame(records: list[dict[str, Any]]) -> Any:
    """The staleness of the updates the master applied, per worker rank: rank, updates,
    mean, min, max (empty for allreduce, which has no master)."""
    import pandas as pd

    return pd.DataFrame(staleness_by_rank(records), columns=["rank", "updates", "mean", "min", "max"])


def epochs_frame(records: list[dict[str, Any]]) -> Any:
    """One row per epoch of the run; the epochs trained again after a restart (from the
    last checkpoint) replace the ones first reported."""
    import pandas as pd

    latest: dict[tuple[str, int], dict[str, Any]] = {}
    for r in records:
        if r["kind"] == "epoch":
            latest[(r["run"], r["values"].get("epoch", r["epoch"]))] = r["values"]
    return pd.DataFrame(list(latest.values()))
