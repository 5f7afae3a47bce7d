"""The LRU table against a plain-dict model, and the planner against a brute-force reference."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest

from kvstore.coordinator.lru import PIN_HARD, PIN_NONE, PIN_SOFT, LRUTable
from kvstore.errors import KVStoreError

ROOT = hashlib.sha256(b"namespace").digest()


def make_key(i: int, salt: bytes = b"") -> bytes:
    return hashlib.sha256(salt + i.to_bytes(8, "little")).digest()


def make_chain(n: int, root: bytes = ROOT, salt: bytes = b"") -> list[bytes]:
    keys, parent = [], root
    for i in range(n):
        parent = hashlib.sha256(parent + salt + i.to_bytes(8, "little")).digest()
        keys.append(parent)
    return keys


def add_chain(table: LRUTable, node: int, chain: list[bytes], root: bytes = ROOT,
              nbytes: int = 100) -> None:
    table.add(node, chain, [root, *chain[:-1]], [nbytes] * len(chain))


def reference_plan(blocks: dict[bytes, dict], node: int, need: int,
                   exclude: frozenset[bytes] = frozenset()) -> list[bytes]:
    """Brute force of the spec: repeatedly take the smallest (soft, last_use) block that is
    neither hard-pinned nor excluded and has no child still cached on the node (pinned,
    excluded or not: evicting it would orphan that child)."""
    cached = {k: b for k, b in blocks.items() if node in b["holders"]}
    chosen: list[bytes] = []
    freed = 0
    while freed < need:
        eligible = [k for k, b in cached.items()
                    if b["pin"] != PIN_HARD and k not in exclude
                    and not any(c["parent"] == k for c in cached.values())]
        if not eligible:
            break
        k = min(eligible, key=lambda k: (cached[k]["pin"] == PIN_SOFT, cached[k]["last_use"]))
        chosen.append(k)
        freed += cached.pop(k)["nbytes"]
    return chosen


def test_random_ops_match_a_dict_model() -> None:
    rng = random.Random(0)
    table = LRUTable(initial_capacity=16)  # small, so growth, rehash and tombstones all happen
    model: dict[bytes, set[int]] = {}
    universe = [make_key(i) for i in range(3000)]
    for _ in range(300):
        op = rng.random()
        node = rng.randrange(3)
        batch = rng.sample(universe, rng.randint(1, 60))
        if op < 0.55:
            table.add(node, batch, [None] * len(batch), [1] * len(batch))
            for k in batch:
                model.setdefault(k, set()).add(node)
        elif op < 0.9:
            held = sum(node in model.get(k, ()) for k in set(batch))
            assert table.remove(node, batch) == held
            for k in batch:
                if k in model:
                    model[k].discard(node)
                    if not model[k]:
                        del model[k]
        else:
            table.drop_node(node)
            for k in list(model):
                model[k].discard(node)
                if not model[k]:
                    del model[k]
    assert table.num_blocks == len(model)
    masks = table.holder_masks(universe).tolist()
    for k, m in zip(universe, masks, strict=True):
        assert m == sum(1 << n for n in model.get(k, ())), k.hex()
    assert (table.lookup(universe) >= 0).sum() == len(model)
    for node in range(3):
        assert sorted(table.keys_of(node)) == sorted(k for k, h in model.items() if node in h)


def test_duplicate_keys_in_one_batch_are_one_block() -> None:
    table = LRUTable()
    k = make_key(1)
    assert table.add(0, [k, k, k], [None] * 3, [10] * 3) == 1
    assert table.num_blocks == 1
    assert table.node_bytes(0) == 10


def test_bad_key_length_is_a_typed_error() -> None:
    with pytest.raises(KVStoreError, match="32 bytes"):
        LRUTable().add(0, [b"short"], [None], [1])


@pytest.mark.parametrize("seed", range(5))
def test_plan_matches_brute_force_reference(seed: int) -> None:
    rng = random.Random(seed)
    table = LRUTable()
    blocks: dict[bytes, dict] = {}
    for c in range(8):  # several chains, some shared between two nodes
        chain = make_chain(rng.randint(1, 6), salt=bytes([seed, c]))
        parents = [ROOT, *chain[:-1]]
        for node in rng.sample([0, 1], rng.randint(1, 2)):
            sizes = [rng.randint(1, 50) for _ in chain]
            table.add(node, chain, parents, sizes)
            for k, p, s in zip(chain, parents, sizes, strict=True):
                blocks.setdefault(k, {"holders": set(), "parent": p, "pin": PIN_NONE})
                blocks[k].update(nbytes=s)
                blocks[k]["holders"].add(node)
    keys = list(blocks)
    rng.shuffle(keys)
    table.touch(keys)  # touch order defines recency
    for i, k in enumerate(keys):
        blocks[k]["last_use"] = i
    for k in rng.sample(keys, 3):
        level = rng.choice([PIN_SOFT, PIN_HARD])
        table.set_pin([k], level)
        blocks[k]["pin"] = level
    for need in (1, 100, 300, 10_000):
        assert table.plan(0, need) == reference_plan(blocks, 0, need)
    skip = rng.sample(keys, 2)
    assert table.plan(0, 10_000, exclude=skip) == reference_plan(blocks, 0, 10_000,
                                                                 frozenset(skip))


def test_hard_pinned_child_keeps_its_ancestors() -> None:
    table = LRUTable()
    chain = make_chain(4)
    add_chain(table, 0, chain)
    table.set_pin([chain[2]], PIN_HARD)
    # only the tail below the pin may go: chain[0..1] would orphan the pinned block
    assert table.plan(0, 10_000) == [chain[3]]
    assert table.plan(0, 10_000, exclude=[chain[3]]) == []  # ordered, not yet gone: still there


def test_plan_evicts_children_before_parents_then_lru() -> None:
    table = LRUTable()
    old, new = make_chain(4, salt=b"old"), make_chain(2, salt=b"new")
    add_chain(table, 0, old)
    add_chain(table, 0, new)
    table.touch([old[0]])  # a touched parent stays behind its children anyway
    plan = table.plan(0, 10_000)
    assert plan.index(old[3]) < plan.index(old[2]) < plan.index(old[1]) < plan.index(old[0])
    assert plan.index(new[1]) < plan.index(new[0])
    assert plan[:4] == [old[3], old[2], old[1], new[1]]  # LRU among the leaves
    assert table.plan(0, 250) == [old[3], old[2], old[1]]  # stops once enough is freed


def test_child_on_another_node_does_not_hold_the_parent() -> None:
    table = LRUTable()
    chain = make_chain(2)
    add_chain(table, 0, chain[:1])
    add_chain(table, 1, chain)
    assert table.plan(0, 100) == [chain[0]]


def test_pins_hard_never_soft_last() -> None:
    table = LRUTable()
    keys = [make_key(i) for i in range(4)]
    table.add(0, keys, [None] * 4, [100] * 4)
    table.set_pin([keys[0]], PIN_HARD)
    table.set_pin([keys[1]], PIN_SOFT)
    assert table.plan(0, 200) == [keys[2], keys[3]]
    assert table.plan(0, 10_000) == [keys[2], keys[3], keys[1]]
    assert table.plan(0, 10_000, exclude=[keys[2]]) == [keys[3], keys[1]]


def test_namespace_keys_follow_the_chain_root() -> None:
    table = LRUTable()
    other_root = hashlib.sha256(b"other").digest()
    a, b = make_chain(3), make_chain(2, root=other_root)
    table.add(0, a[:1], [ROOT], [1])  # first block alone: its parent is the root
    table.add(0, a[1:], a[:2], [1, 1])  # inherited from the parent already in the table
    add_chain(table, 1, b, root=other_root)
    c = make_chain(2, salt=b"c")
    table.add(1, c, [b"\x01" * 32, c[0]], [1, 1], roots=[ROOT, ROOT])  # given explicitly
    assert sorted(table.namespace_keys(ROOT)) == sorted(a + c)
    assert sorted(table.namespace_keys(other_root)) == sorted(b)


def test_top_counts_touches() -> None:
    table = LRUTable()
    keys = [make_key(i) for i in range(5)]
    table.add(0, keys, [None] * 5, [1] * 5)
    table.touch([keys[3]] * 3 + [keys[1]] * 2 + [keys[4]])
    assert table.top(2) == [(keys[3], 3), (keys[1], 2)]


def test_memory_per_block_within_budget() -> None:
    table = LRUTable()
    n = 50_000
    keys = np.random.default_rng(0).bytes(32 * n)
    batch = [keys[i * 32:(i + 1) * 32] for i in range(n)]
    table.add(0, batch, [None] * n, [1] * n)
    assert table.num_blocks == n
    assert table.nbytes_used() / n <= 200
