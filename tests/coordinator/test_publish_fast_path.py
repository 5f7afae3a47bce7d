"""The publish fast paths (columns checked in C loops, scalar probe tails, one root id per
distinct root) behave exactly like the per-entry code they replace."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest

from kvstore.coordinator.lru import LRUTable
from kvstore.coordinator.slot_table import EMPTY, TOMB, SlotHash
from kvstore.coordinator.table_index import TableIndex
from kvstore.errors import KVStoreError
from kvstore.index.base import IndexEntry
from kvstore.index.checks import entry_columns, owned_by

NODE = "node-a"


def batch(n: int = 50, root: bytes | None = None) -> list[IndexEntry]:
    ks = [os.urandom(32) for _ in range(n + 1)]
    root = root or os.urandom(32)
    return [IndexEntry(ks[i + 1], NODE, 100 + i, ks[i], root) for i in range(n)]


@pytest.mark.parametrize(("field", "value", "error"), [
    ("key", b"x" * 31, KVStoreError), ("parent_key", b"x" * 33, KVStoreError),
    ("namespace_root", b"r" * 8, KVStoreError), ("key", "k" * 32, TypeError),
    ("key", b"", TypeError), ("nbytes", -1, ValueError), ("node_id", "", ValueError),
])
def test_one_bad_entry_among_good_ones_raises_and_writes_nothing(field, value, error) -> None:
    index = TableIndex()
    index.publish(batch(5))
    before = index.num_keys()
    entries = batch(40)
    setattr(entries[17], field, value)
    with pytest.raises(error) as fast:
        index.publish(entries)
    assert index.num_keys() == before
    # the same message as the per-entry checks give for that entry alone
    with pytest.raises(error) as alone:
        TableIndex().publish([entries[17]])
    assert str(fast.value) == str(alone.value)


def test_columns_and_owner_fast_paths() -> None:
    entries = batch(10)
    cols = entry_columns(entries, 32)
    assert cols is not None and cols[0] == tuple(e.key for e in entries)
    assert entry_columns(entries[:1] + [IndexEntry(b"k" * 31, NODE, 1, b"p" * 32, b"r" * 32)],
                         32) is None
    assert entry_columns([]) is None
    assert owned_by(NODE, entries) and not owned_by("other", entries)
    entries[3].node_id = "other"
    assert not owned_by(NODE, entries)
    assert not owned_by(NODE, [*entries[:3], object()])


def test_roots_get_ids_in_order_of_first_appearance() -> None:
    index = TableIndex()
    r1, r2, r3 = (os.urandom(32) for _ in range(3))
    es = batch(6, r2)
    for e, r in zip(es, [r2, r1, r2, r3, r1, r2], strict=True):
        e.namespace_root = r
    index.publish(es)
    assert index.table.roots[1:] == [r2, r1, r3]
    assert [i.namespace_root for i in index.info([e.key for e in es])] == \
        [r2, r1, r2, r3, r1, r2]


def reference_place(h: SlotHash, packed: np.ndarray, slots: np.ndarray) -> None:
    """``place`` as it was: every round vectorised, conflicts settled by np.unique."""
    mask = len(h.table) - 1
    pos = (packed[:, 0] & np.uint64(mask)).astype(np.int64)
    active = np.arange(len(packed))
    while active.size:
        p = pos[active]
        free = h.table[p] < 0
        cand, pc = active[free], p[free]
        won_pos, first = np.unique(pc, return_index=True)
        h.num_tombs -= int((h.table[won_pos] == TOMB).sum())
        h.table[won_pos] = slots[cand[first]]
        keep = np.ones(active.size, dtype=bool)
        keep[np.flatnonzero(free)[first]] = False
        active = active[keep]
        pos[active] = (pos[active] + 1) & mask


@pytest.mark.parametrize("seed", range(20))
def test_place_and_find_match_the_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    size = 256
    rows = rng.integers(0, 2**63, size=(400, 4), dtype=np.uint64)
    rows[:, 0] &= np.uint64(31)  # crowd the home positions: long runs, conflicts
    a, b = SlotHash(size), SlotHash(size)
    start = rng.choice(400, size=60, replace=False)
    for h in (a, b):
        reference_place(h, rows[start], start)
        h.forget(np.flatnonzero(h.table >= 0)[::3])  # some tombstones to reuse
    live = np.flatnonzero(a.table >= 0)
    rest = np.setdiff1d(np.arange(400), start)[: 120 - live.size]
    a.place(rows[rest], rest)
    reference_place(b, rows[rest], rest)
    assert np.array_equal(a.table, b.table) and a.num_tombs == b.num_tombs
    probe = rng.permutation(400)
    slots, pos = a.find(rows, rows[probe])
    for i, s in zip(probe.tolist(), slots.tolist(), strict=True):
        assert s == (i if i in set(a.table.tolist()) else -1)
    assert (a.table[pos[slots >= 0]] == slots[slots >= 0]).all()
    assert (a.table[pos[slots < 0]] == EMPTY).all()


def test_table_add_with_and_without_duplicates_matches() -> None:
    rnd = random.Random(1)
    keys = [rnd.randbytes(32) for _ in range(30)]
    t1, t2 = LRUTable(), LRUTable()
    t1.add(0, keys + keys[:5], [b"p" * 32] * 35, list(range(35)), [b"r" * 32] * 35)
    t2.add(0, keys, [b"p" * 32] * 30, list(range(30)), [b"r" * 32] * 30)
    s1, s2 = t1.lookup(keys), t2.lookup(keys)
    assert t1.num_blocks == t2.num_blocks == 30
    assert np.array_equal(t1.nbytes[s1], t2.nbytes[s2])
    assert np.array_equal(t1.last_use[s1], t2.last_use[s2])
