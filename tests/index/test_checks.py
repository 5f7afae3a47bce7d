"""The argument checks' fast path (C loops) accepts exactly what the per-entry checks accept."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvstore.index.base import IndexEntry
from kvstore.index.checks import check_entries, check_keys, check_node_id

GOOD: dict[str, Any] = {"key": b"k" * 32, "node_id": "node-a", "nbytes": 1024,
                        "parent_key": b"p" * 32, "namespace_root": b"r" * 32}
BAD: dict[str, list[Any]] = {"key": [b"", "k", bytearray(b"k")], "node_id": ["", b"node", None],
                             "nbytes": [-1, 1.0, "1"], "parent_key": [b"", "p"],
                             "namespace_root": [b"", None]}


class BytesKey(bytes):
    """A bytes subclass: not an exact type, so only the slow path may accept it (and does)."""


def slow_check(entries: list[Any]) -> None:
    """The reference: every entry checked one by one, without the fast path."""
    for e in entries:
        if not isinstance(e, IndexEntry):
            raise TypeError("not an entry")
        check_keys([e.key, e.parent_key, e.namespace_root])
        check_node_id(e.node_id)
        if not isinstance(e.nbytes, int) or e.nbytes < 0:
            raise ValueError("nbytes")


def raises(fn: Any, entries: list[Any]) -> type[BaseException] | None:
    try:
        fn(entries)
    except (TypeError, ValueError) as exc:
        return type(exc)
    return None


@pytest.mark.parametrize("seed", range(30))
def test_check_entries_agrees_with_the_per_entry_checks(seed: int) -> None:
    rng = random.Random(seed)
    entries: list[Any] = []
    for _ in range(rng.randrange(0, 20)):
        fields = dict(GOOD)
        if rng.random() < 0.1:
            name = rng.choice(list(BAD))
            fields[name] = rng.choice(BAD[name])
        if rng.random() < 0.1:
            fields["key"] = BytesKey(b"s" * 32)
        if rng.random() < 0.05:
            fields["nbytes"] = True  # a bool is an int to isinstance: accepted before, still
        entries.append(IndexEntry(**fields) if rng.random() > 0.03 else ("not", "an", "entry"))
    assert raises(check_entries, entries) == raises(slow_check, entries)
