"""Metric records, the per-run log written by each rank, and reading it back."""

from nbdist.metrics.curve import samples_to_reach, validation_curve
from nbdist.metrics.log import RunLog, read_log
from nbdist.metrics.record import Record
from nbdist.metrics.updates import UpdateSummary, staleness_by_rank, staleness_entries

__all__ = [
    "Record",
    "RunLog",
    "read_log",
    "validation_curve",
    "samples_to_reach",
    "UpdateSummary",
    "staleness_entries",
    "staleness_by_rank",
]
