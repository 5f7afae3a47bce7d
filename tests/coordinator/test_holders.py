"""Holder sets past 64 nodes: the table against a dict-of-sets model, slot reuse, a 200-node
core, and the memory budget at 200k blocks."""

from __future__ import annotations

import hashlib
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore.api import NodeAddress, PoolStats
from kvstore.config import CoordinatorConfig, KVStoreConfig
from kvstore.coordinator.core import CoordinatorCore
from kvstore.coordinator.holders import LANES, MAX_NODES
from kvstore.coordinator.lru import LRUTable
from kvstore.coordinator.table_index import TableIndex
from kvstore.errors import KVStoreError
from kvstore.index.base import IndexEntry
from tests.support.fake_clock import FakeClock

ROOT = hashlib.sha256(b"holders").digest()
BLOCK = 100


def make_key(i: int) -> bytes:
    return hashlib.sha256(b"k" + i.to_bytes(8, "little")).digest()


def make_entries(node_id: str, keys: list[bytes]) -> list[IndexEntry]:
    return [IndexEntry(k, node_id, BLOCK, ROOT, ROOT) for k in keys]


class Model:
    """The reference: key -> set of node slots."""

    def __init__(self) -> None:
        self.holders: dict[bytes, set[int]] = {}

    def add(self, node: int, keys: list[bytes]) -> int:
        new = {k for k in keys if node not in self.holders.get(k, ())}
        for k in keys:
            self.holders.setdefault(k, set()).add(node)
        return len(new)

    def remove(self, node: int, keys: list[bytes]) -> int:
        held = 0
        for k in set(keys):
            h = self.holders.get(k)
            if h is not None and node in h:
                held += 1
                h.discard(node)
                if not h:
                    del self.holders[k]
        return held

    def drop(self, node: int) -> int:
        return self.remove(node, [k for k, h in self.holders.items() if node in h])


def check_against(table: LRUTable, model: Model, universe: list[bytes], nodes: range) -> None:
    assert table.num_blocks == len(model.holders)
    masks = table.holder_masks(universe).tolist()
    for k, m in zip(universe, masks, strict=True):
        assert m == sum(1 << n for n in model.holders.get(k, ())), k.hex()
    for node in nodes:
        mine = sorted(k for k, h in model.holders.items() if node in h)
        assert sorted(table.keys_of(node)) == mine
        assert table.num_blocks_of(node) == len(mine)
    assert table.live_nodes() == sorted({n for h in model.holders.values() for n in h})


# Many nodes over few keys, so blocks reach far past the four inline lanes and back.
ops = st.lists(st.tuples(st.sampled_from(["add", "remove", "drop"]),
                         st.integers(0, 199),  # node slot
                         st.lists(st.integers(0, 39), min_size=1, max_size=12)),
               min_size=1, max_size=120)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_holder_sets_of_any_size_match_a_dict_model(steps: list[tuple[str, int, list[int]]]
                                                    ) -> None:
    table = LRUTable(initial_capacity=16)
    model = Model()
    universe = [make_key(i) for i in range(40)]
    for op, node, idx in steps:
        keys = [universe[i] for i in idx]
        if op == "add":
            assert table.add(node, keys, [None] * len(keys), [1] * len(keys)) == \
                model.add(node, keys)
        elif op == "remove":
            assert table.remove(node, keys) == model.remove(node, keys)
        else:
            assert table.drop_node(node) == model.drop(node)
    check_against(table, model, universe, range(200))


@pytest.mark.parametrize("seed", range(3))
def test_random_churn_with_200_nodes_matches_the_model(seed: int) -> None:
    rng = random.Random(seed)
    table = LRUTable(initial_capacity=16)  # growth, rehash, free-slot reuse and compaction
    model = Model()
    universe = [make_key(i) for i in range(2000)]
    hot = universe[:10]  # replicated everywhere: well past the inline lanes
    for _ in range(600):
        node = rng.randrange(200)
        r = rng.random()
        if r < 0.5:
            keys = rng.sample(universe, rng.randint(1, 50)) + rng.sample(hot, 2)
            table.add(node, keys, [None] * len(keys), [1] * len(keys))
            model.add(node, keys)
        elif r < 0.95:
            keys = rng.sample(universe, rng.randint(1, 80))
            assert table.remove(node, keys) == model.remove(node, keys)
        else:
            assert table.drop_node(node) == model.drop(node)
    assert max(map(len, model.holders.values())) > LANES
    check_against(table, model, universe, range(200))


def test_a_block_held_by_every_node_lists_them_all() -> None:
    index = TableIndex()
    key = [make_key(0)]
    names = [f"n{i:03d}" for i in range(300)]
    for name in names:
        index.publish(make_entries(name, key))
    assert index.holders(key) == [names]
    assert index.lookup_prefix(key).holders == [names]
    for name in names[:298]:  # leave from the front: lanes are refilled from the spill
        index.remove(key, name)
    assert index.holders(key) == [names[298:]]
    assert index.info(key)[0].holders == names[298:]  # type: ignore[union-attr]
    index.remove(key, names[298])
    index.remove(key, names[299])
    assert index.holders(key) == [[]] and index.num_keys() == 0


def test_a_dropped_nodes_slot_is_reused_and_starts_empty() -> None:
    index = TableIndex()
    keys = [make_key(i) for i in range(4)]
    slots = {f"n{i}": index.claim_node(f"n{i}") for i in range(100)}
    assert sorted(slots.values()) == list(range(100))
    index.publish(make_entries("n7", keys) + make_entries("n8", keys[:1]))
    assert index.drop_node("n7") == 4
    assert index.claim_node("newcomer") == slots["n7"]  # the lowest free slot
    assert index.keys_of_node("newcomer") == []
    assert index.holders(keys) == [["n8"], [], [], []]
    assert index.table.num_blocks == 1


def test_slot_limits_are_typed_errors() -> None:
    with pytest.raises(KVStoreError, match="node slot"):
        LRUTable().add(MAX_NODES, [make_key(0)], [None], [1])
    index = TableIndex(max_nodes=3)
    for i in range(3):
        index.claim_node(f"n{i}")
    with pytest.raises(KVStoreError, match="at most 3"):
        index.claim_node("n3")



def test_core_with_200_nodes_publishes_evicts_and_drops_dead_ones() -> None:
    clock = FakeClock()
    core = CoordinatorCore(KVStoreConfig(coordinator=CoordinatorConfig(
        node_timeout_s=10.0, high_watermark=0.9, low_watermark=0.8)),  # 11 blocks -> 8
                           clock=clock)
    names = [f"node-{i:03d}" for i in range(200)]
    own = {n: [make_key(1000 + 10 * i + j) for j in range(10)] for i, n in enumerate(names)}
    shared = [make_key(0)]
    for n in names:
        core.register_node(n, NodeAddress(n, f"{n}:1"), 10 * BLOCK,
                           make_entries(n, own[n] + shared))
    assert core.holders(shared) == [names]
    assert core.holders(own[names[150]][:1]) == [[names[150]]]
    # node 150 is full: the planner orders its own least recent blocks, nobody else's
    touched = own[names[150]][::-1]  # the first key is now the most recent
    reply = core.heartbeat(names[150], PoolStats(10 * BLOCK, 11 * BLOCK, 11, 0, 0, 0, 0, 0),
                           touched + shared, {})
    assert len(reply.evict) == 3 and set(reply.evict) <= set(own[names[150]])
    assert reply.evict == own[names[150]][-1:-4:-1]
    core.removed(names[150], reply.evict)
    node_150 = core.nodes.get(names[150])
    assert node_150 is not None and core.lru.num_blocks_of(node_150.slot) == 11 - 3
    # half the nodes go silent and are declared dead: their blocks and slots go
    clock.now += 5
    for n in names[::2]:
        core.heartbeat(n, PoolStats(10 * BLOCK, 0, 0, 0, 0, 0, 0, 0), [], {})
    clock.now += 6
    assert core.check_liveness() == sorted(names[1::2])
    assert core.holders(shared) == [names[::2]]
    assert core.holders(own[names[1]]) == [[]] * 10
    assert core.lru.num_blocks == 100 * 10 + 1 - 3
    # newcomers take the freed slots: never a dead node's holdings
    core.register_node("late", NodeAddress("late", "late:1"), 10 * BLOCK, [])
    late = core.nodes.get("late")
    assert late is not None and late.slot in {1, 3}  # a freed slot, the lowest free
    assert core.lru.num_blocks_of(late.slot) == 0


def test_memory_per_block_within_budget_at_200k_blocks() -> None:
    """The table's own accounting (arrays, holder sets, hash table) at 200k blocks, held as in
    a cluster: every block on one node, one in ten on a second, one in a thousand on six."""
    n, num_nodes = 200_000, 64
    raw = np.random.default_rng(0).bytes(32 * n)
    keys = [raw[i * 32:(i + 1) * 32] for i in range(n)]
    table = LRUTable()
    step = n // num_nodes + 1
    for node in range(num_nodes):
        part = keys[node * step:(node + 1) * step]
        table.add(node, part, [None] * len(part), [1] * len(part))
    replicas = keys[::10]
    table.add(num_nodes, replicas, [None] * len(replicas), [1] * len(replicas))
    for node in range(num_nodes + 1, num_nodes + 6):
        table.add(node, keys[::1000], [None] * len(keys[::1000]), [1] * len(keys[::1000]))
    assert table.num_blocks == n
    assert table.nbytes_used() / n <= 200
