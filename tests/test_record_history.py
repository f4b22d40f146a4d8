"""The notebook's record history stays bounded on a long job, and readers that follow it
with a cursor see every record once."""

from __future__ import annotations

from nbdist.metrics.collect import RecordHistory


def _records(kinds: list[str], start: int) -> list[dict]:
    return [{"kind": kind, "seq": start + i} for i, kind in enumerate(kinds)]


def test_interval_records_are_bounded_while_epochs_are_all_kept():
    history = RecordHistory(keep_recent=100)
    for batch in range(60):  # 60 polls of 20 throughput records and one epoch record
        history.add(_records(["train"] * 20 + ["epoch"], batch * 21))
    assert history.received == 60 * 21
    kinds = [r["kind"] for r in history.records]
    assert kinds.count("epoch") == 60
    assert kinds.count("train") <= 2 * 100
    # The newest interval records are the ones kept, in order.
    seqs = [r["seq"] for r in history.records]
    assert seqs == sorted(seqs) and seqs[-1] == 60 * 21 - 1
    last_train = [r["seq"] for r in history.records if r["kind"] == "train"]
    assert last_train[-1] == 60 * 21 - 2 and len(last_train) >= 100


def test_a_reader_that_keeps_up_sees_every_record_once_across_thinning():
    history = RecordHistory(keep_recent=50)
    seen, cursor = [], 0
    for batch in range(40):
        history.add(_records(["train"] * 9 + ["val"], batch * 10))
        new, cursor = history.since(cursor)
        seen += [r["seq"] for r in new]
    assert seen == list(range(400))
    assert history.since(cursor) == ([], 400)
