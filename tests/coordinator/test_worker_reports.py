"""The coordinator's table of worker reports: what ``kvstore status`` lists under workers."""

from __future__ import annotations

import pytest

from kvstore.coordinator.worker_reports import MAX_REPORT_BYTES, WorkerTable


def test_reports_replace_and_are_forgotten_on_close():
    table = WorkerTable()
    table.report("prefill-0-11", {"reuse": {"resume": "chunk"}})
    table.report("decode-0-12", {"reuse": {"resume": "block"}})
    table.report("prefill-0-11", {"reuse": {"resume": "block"}})  # the latest report wins
    listed = table.as_list()
    assert [w["worker_id"] for w in listed] == ["decode-0-12", "prefill-0-11"]
    assert listed[1]["reuse"] == {"resume": "block"} and listed[1]["reported_at"] > 0
    assert table.forget("prefill-0-11") and not table.forget("prefill-0-11")
    assert [w["worker_id"] for w in table.as_list()] == ["decode-0-12"]


@pytest.mark.parametrize("worker_id, info, error", [
    ("", {}, ValueError), (7, {}, ValueError), ("w", ["not", "a", "dict"], TypeError),
    ("w", {"blob": "x" * MAX_REPORT_BYTES}, ValueError),
])
def test_bad_reports_are_refused_and_change_nothing(worker_id, info, error):
    table = WorkerTable()
    with pytest.raises(error):
        table.report(worker_id, info)
    assert table.as_list() == []
