"""The cluster LRU across a node's two tiers, against a reference model: the arena's least
recently used are demoted, the disk's least recently used dropped, a chain never cut."""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict

import pytest

from kvstore.api import NodeAddress, PoolStats
from kvstore.config import CoordinatorConfig, KVStoreConfig
from kvstore.coordinator.core import CoordinatorCore
from kvstore.coordinator.lru import LRUTable
from kvstore.index.base import IndexEntry
from kvstore.index.memory import InMemoryIndex

ROOT = hashlib.sha256(b"tiers").digest()
BLOCK = 100


def make_key(i: int) -> bytes:
    return hashlib.sha256(b"k%d" % i).digest()


class ReferenceNode:
    """One node's two tiers as plain ordered dicts: the recency order is the cluster's."""

    def __init__(self) -> None:
        self.order: OrderedDict[bytes, None] = OrderedDict()  # every block, LRU first
        self.disk: set[bytes] = set()

    def lru(self, tier: str, nbytes: int) -> list[bytes]:
        want = [k for k in self.order if (k in self.disk) == (tier == "disk")]
        return want[: -(-nbytes // BLOCK)]


@pytest.mark.parametrize("seed", range(6))
def test_plans_over_both_tiers_match_a_reference_lru(seed: int) -> None:
    """Independent blocks (no chains): each tier's plan is exactly that tier's LRU."""
    rng = random.Random(seed)
    table, ref, node = LRUTable(), ReferenceNode(), 3
    other = 5  # a second holder: its tiers must not leak into node 3's plans
    next_key = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.3 or not ref.order:  # publish (a Put lands in the arena)
            key = make_key(next_key)
            next_key += 1
            table.add(node, [key], [ROOT], [BLOCK], [ROOT])
            ref.order[key] = None
            if rng.random() < 0.3:
                table.add(other, [key], [ROOT], [BLOCK], [ROOT])
                table.set_tier(other, [key], True)
        elif op < 0.55:  # reads: touch in order
            keys = rng.sample(list(ref.order), min(len(ref.order), rng.randint(1, 4)))
            table.touch(keys)
            for k in keys:
                ref.order.move_to_end(k)
        elif op < 0.75:  # the node demotes what the arena plan names
            keys = table.plan(node, rng.randint(1, 4) * BLOCK, tier="arena")
            assert keys == ref.lru("arena", len(keys) * BLOCK)
            table.set_tier(node, keys, True)
            ref.disk.update(keys)
        elif op < 0.85:  # a read promotes a disk block back
            if ref.disk:
                key = rng.choice(sorted(ref.disk))
                table.set_tier(node, [key], False)
                table.touch([key])
                ref.disk.discard(key)
                ref.order.move_to_end(key)
        else:  # the disk's LRU leaves the node
            keys = table.plan(node, rng.randint(1, 3) * BLOCK, tier="disk")
            assert keys == ref.lru("disk", len(keys) * BLOCK)
            table.remove(node, keys)
            for k in keys:
                ref.disk.discard(k)
                del ref.order[k]
        for tier in ("arena", "disk"):
            assert table.plan(node, 10**9, tier=tier) == ref.lru(tier, 10**9)
        assert table.num_disk_blocks_of(node) == len(ref.disk)


def test_arena_plan_may_demote_a_parent_but_disk_plan_never_cuts_a_chain() -> None:
    table, node = LRUTable(), 0
    chain, parent = [], ROOT
    for i in range(4):
        key = hashlib.sha256(parent + bytes([i])).digest()
        table.add(node, [key], [parent], [BLOCK], [ROOT])
        chain.append(key)
        parent = key
    # the child-most block goes first from the arena, as ever
    assert table.plan(node, BLOCK) == [chain[3]]
    table.set_tier(node, chain[:2], True)  # the chain's head is on disk, its tail in the arena
    assert table.plan(node, 10 * BLOCK) == [chain[3], chain[2]]
    # the disk plan waits for the arena children: dropping chain[1] would orphan them
    assert table.plan(node, 10 * BLOCK, tier="disk") == []
    table.set_tier(node, chain[2:], True)
    assert table.plan(node, 10 * BLOCK, tier="disk") == chain[::-1]


def make_core(external: bool) -> CoordinatorCore:
    config = KVStoreConfig(coordinator=CoordinatorConfig(high_watermark=0.9, low_watermark=0.8))
    return CoordinatorCore(config, index=InMemoryIndex() if external else None,
                           clock=lambda: 1000.0)


def stats(capacity: int, used: int, disk_capacity: int = 0, disk_used: int = 0) -> PoolStats:
    return PoolStats(capacity, used, 0, 0, 0, 0, 0, 0, disk_capacity, disk_used, 0, 0)


@pytest.mark.parametrize("external", [False, True])
def test_core_knows_tiers_from_registration_and_reports(external: bool) -> None:
    core = make_core(external)
    keys = [make_key(i) for i in range(10)]
    entries = [IndexEntry(k, "a", BLOCK, ROOT, ROOT) for k in keys]
    # a restarted node announces its disk tier: keys 0-5 on disk, 6-9 in the arena
    core.register_node("a", NodeAddress("a", "a:1"), 1000, entries, disk_keys=keys[:6])
    assert core.holders(keys) == [["a"]] * 10  # a disk block is found like any other
    # the arena plan names arena blocks only: the disk ones free no arena bytes
    assert core.request_eviction("a", 10_000) == keys[6:]
    core.report_tiers("a", keys[6:8], [])  # the node demoted two
    core.report_tiers("a", [], keys[:1])  # and a read promoted one
    core.heartbeat("a", stats(1000, 400), [], {})  # clears the orders of the last beat
    assert core.request_eviction("a", 10_000) == [keys[0], keys[8], keys[9]]
    # the disk tier past its high watermark: its least recently used are dropped
    core.heartbeat("a", stats(1000, 400), [], {})
    reply = core.heartbeat("a", stats(1000, 400, 1000, 950), [], {})
    assert reply.evict == keys[1:3]  # 950 -> 800: two blocks of 100, the oldest on disk
    assert reply.evict_causes == ["disk", "disk"]


@pytest.mark.parametrize("external", [False, True])
def test_a_block_promoted_since_its_order_is_planned_again_before_the_next_beat(
        external: bool) -> None:
    """Reads between two heartbeats promote what the last plans demoted: those blocks are in
    the arena again, and a full arena's next plan may name them (an order carried out or
    undone leaves ``ordered``); were they still excluded, the plan would be empty and the
    reader would miss blocks the node holds."""
    core = make_core(external)
    keys = [make_key(i) for i in range(4)]
    entries = [IndexEntry(k, "a", BLOCK, ROOT, ROOT) for k in keys]
    core.register_node("a", NodeAddress("a", "a:1"), 400, entries)
    assert core.request_eviction("a", 400, 400) == keys  # ordered out, all four
    core.report_tiers("a", keys, [])  # demoted
    core.report_tiers("a", [], keys)  # and promoted back by reads, before any heartbeat
    # 400 + 100 -> the low watermark (320): two blocks of 100, the least recently used
    assert core.request_eviction("a", 100, 400) == keys[:2]
