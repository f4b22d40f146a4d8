"""The wire format between workers and masters: a small header in front of a flat payload.

A worker's message is ONE float32 buffer, [header | payload | model state], sent with
one `Send`. The header is 9 float64 slots viewed over the first 18 floats (float64 holds
versions and sample counts exactly). Replies travel as a header message followed by
the payload array itself, so the master sends its centre without copying it. A
sub-master speaks the same format to the top master (topology/hierarchy.py).
"""

from __future__ import annotations

import numpy as np

HEADER_FLOATS = 18  # 9 float64 slots

# slots. CHECKPOINT: one label acknowledged (or, in a STOP reply, the stop label).
# EPOCHS_ACKED: every epoch checkpoint up to this epoch acknowledged (sub-masters, whose
# acks can complete several at once; 0 = none).
KIND, VERSION, EPOCH, SAMPLES, LOSS_SUM, METRIC_SUM, FLAGS, CHECKPOINT, EPOCHS_ACKED = range(9)

# worker -> master kinds
UPDATE, DONE, ERROR = 1.0, 2.0, 3.0
# master -> worker kinds
CONTINUE, STOP = 1.0, 2.0

# flags (bit field)
EPOCH_END = 1
STOP_REQUEST = 2

# tags
TAG_UPDATE, TAG_REPLY_HEADER, TAG_REPLY, TAG_ERROR_TEXT = 11, 12, 13, 14

NO_CHECKPOINT = -1.0


def label_code(label: str) -> float:
    """Checkpoint labels travel in a header slot: `epoch-K` as K >= 1, `stopped-V` (the
    centre version when the stop began) as -(V + 2), so the two never collide."""
    kind, _, number = label.partition("-")
    return float(int(number)) if kind == "epoch" else float(-int(number) - 2)


def label_of(code: float) -> str:
    value = int(code)
    return f"epoch-{value:04d}" if value >= 0 else f"stopped-{-value - 2:010d}"


class Message:
    """A contiguous float32 buffer with a float64 header view and payload/state views."""

    __slots__ = ("buffer", "header", "payload", "state")

    def __init__(self, n_payload: int, n_state: int = 0):
        self.buffer = np.zeros(HEADER_FLOATS + n_payload + n_state, dtype=np.float32)
        self.header = self.buffer[:HEADER_FLOATS].view(np.float64)
        self.payload = self.buffer[HEADER_FLOATS : HEADER_FLOATS + n_payload]
        self.state = self.buffer[HEADER_FLOATS + n_payload :]

    def has(self, flag: int) -> bool:
        return bool(int(self.header[FLAGS]) & flag)


def new_header() -> np.ndarray:
    return np.zeros(HEADER_FLOATS // 2, dtype=np.float64)
