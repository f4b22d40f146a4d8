"""A scaling study in the run store: a run of kind "scale" whose records are the
calibration (the model's inputs), each measured point with its prediction, the predicted
curves and the summary. The dashboard streams them like any run's records; the inputs
come back as the same Calibration (`load_calibration`), so a study's predictions can be
made again from the store."""

from __future__ import annotations

import time
from typing import Any

from nbdist.scaling.inputs import Calibration, CalibrationError
from nbdist.store import RunStore

__all__ = ["SCALE_KIND", "ScaleRecorder", "load_calibration", "scale_records", "KINDS"]

SCALE_KIND = "scale"
# The record kinds of a scaling study, in the order a study writes them.
KINDS = ("calibration", "measured", "predicted", "saturation", "goodput", "summary")


class ScaleRecorder:
    """Rank 0's writer of one study into the store (one connection, its own records)."""

    def __init__(self, store: str, run_id: str, run_dir: str, options: dict[str, Any]):
        self.store = RunStore(store)
        self.run_id, self.seq = run_id, 0
        self.store.begin_run(run_id, run_dir=run_dir, options=options, layout={}, kind=SCALE_KIND)

    def add(self, kind: str, values: dict[str, Any] | list[dict[str, Any]]) -> None:
        """One record of `kind` per value, written at once (the dashboard polls for them)."""
        batch = values if isinstance(values, list) else [values]
        now = time.time()
        records = []
        for value in batch:
            records.append(
                {
                    "run": self.run_id,
                    "trial": None,
                    "rank": 0,
                    "role": "coordinator",
                    "kind": kind,
                    "step": self.seq,
                    "epoch": 0,
                    "time": now,
                    "values": value,
                    "seq": self.seq,
                }
            )
            self.seq += 1
        self.store.add_records(records)
        self.store.heartbeat(self.run_id)

    def finish(self, status: str, reason: str, final: dict[str, Any] | None = None) -> None:
        self.store.end_run(self.run_id, status, reason, final)
        self.store.close()


def scale_records(store: RunStore, run_id: str) -> dict[str, list[dict[str, Any]]]:
    """A study's records by kind, in the order they were written."""
    out: dict[str, list[dict[str, Any]]] = {kind: [] for kind in KINDS}
    records, _ = store.records(run_id, kinds=KINDS)
    for record in records:
        out[record["kind"]].append(record["values"])
    return out


def load_calibration(store: RunStore, run_id: str) -> Calibration:
    """The inputs the study `run_id` measured, as it measured them."""
    found = scale_records(store, run_id)["calibration"]
    if not found:
        raise CalibrationError(f"the run {run_id!r} in {store.label} holds no calibration (is it a scaling study?)")
    return Calibration.from_dict(found[-1])
