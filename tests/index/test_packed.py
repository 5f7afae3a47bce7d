"""PackedEntries: unpickles to the list[IndexEntry] the plain list gives (and is smaller)."""

from __future__ import annotations

import pickle

import cloudpickle

from kvstore.index.base import IndexEntry
from kvstore.index.packed import PackedEntries


def make_entries(n: int) -> list[IndexEntry]:
    roots = [b"\1" * 32, b"\2" * 32]
    return [IndexEntry(bytes([i % 251, i // 251]) * 16, f"node-{i % 3}", 1000 + i,
                       bytes([7, i % 251]) * 16, roots[i % 2]) for i in range(n)]


def test_round_trip_equals_the_plain_list_and_is_smaller() -> None:
    entries = make_entries(300)
    for dumps in (pickle.dumps, cloudpickle.dumps):
        got = pickle.loads(dumps(PackedEntries(entries)))
        assert type(got) is list and got == entries
        assert len(dumps(PackedEntries(entries))) < len(dumps(entries))
    assert pickle.loads(pickle.dumps(PackedEntries([]))) == []
    packed = PackedEntries(entries)
    assert len(packed) == 300 and packed[5] == entries[5] and list(packed) == entries


def test_entries_that_are_not_fixed_width_travel_as_they_are() -> None:
    odd = [IndexEntry(b"short", "n", 1, b"\0" * 32, b"\1" * 32), *make_entries(2)]
    assert pickle.loads(pickle.dumps(PackedEntries(odd))) == odd
    negative = [IndexEntry(b"\3" * 32, "n", -1, b"\0" * 32, b"\1" * 32)]
    assert pickle.loads(pickle.dumps(PackedEntries(negative))) == negative
