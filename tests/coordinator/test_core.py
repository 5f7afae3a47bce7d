"""The coordinator: the pure core with fake nodes and a fake clock, then the real Ray actor.

Every core test runs in both index modes: ``table`` (embedded: the index is the LRU table
itself, the default for ``index.backend == "memory"``) and ``dict`` (an external index the LRU
table mirrors, as with Redis; ``InMemoryIndex`` stands in for it).
"""

from __future__ import annotations

import hashlib
import json
import time
import tracemalloc
import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from kvstore.api import NodeAddress, PoolStats
from kvstore.config import CoordinatorConfig, KVStoreConfig
from kvstore.coordinator.core import CoordinatorCore
from kvstore.coordinator.table_index import TableIndex
from kvstore.index.base import Index, IndexEntry
from kvstore.index.memory import InMemoryIndex
from tests.support.fake_clock import FakeClock
from tests.support.redis_server import RedisProcess

ROOT = hashlib.sha256(b"ns-a").digest()
ROOT_B = hashlib.sha256(b"ns-b").digest()
BLOCK = 100


_KIND = {"index": "table"}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Core tests run in both modes; the actor tests (slow, Ray) in the default one."""
    if "index_kind" in metafunc.fixturenames and not metafunc.function.__name__.startswith(
            "test_actor"):
        metafunc.parametrize("index_kind", ["table", "dict"], indirect=True)


@pytest.fixture(autouse=True)
def index_kind(request: pytest.FixtureRequest) -> Iterator[str]:
    """Which index mode ``make_core`` and ``make_shared_index`` build."""
    _KIND["index"] = getattr(request, "param", "table")
    yield _KIND["index"]
    _KIND["index"] = "table"


def make_shared_index() -> Index:
    """An index that outlives a core (as Redis does), in the current mode."""
    return TableIndex() if _KIND["index"] == "table" else InMemoryIndex()



def make_chain(n: int, salt: str, root: bytes = ROOT) -> list[bytes]:
    keys, parent = [], root
    for i in range(n):
        parent = hashlib.sha256(parent + f"{salt}{i}".encode()).digest()
        keys.append(parent)
    return keys


def make_entries(node_id: str, chain: list[bytes], root: bytes = ROOT) -> list[IndexEntry]:
    parents = [root, *chain[:-1]]
    return [IndexEntry(k, node_id, BLOCK, p, root) for k, p in zip(chain, parents, strict=True)]


def make_stats(capacity: int, used: int) -> PoolStats:
    return PoolStats(capacity, used, used // BLOCK, 0, 0, 0, 0, 0)


def make_core(index: Index | None = None, clock: FakeClock | None = None,
              **coordinator: float) -> CoordinatorCore:
    """A core in the current mode; ``table`` builds its own index as the actor does.

    Watermarks are 0.90/0.80 unless given: the tests' figures (room, eviction targets) are
    worked out for those, whatever the defaults are."""
    coordinator = {"high_watermark": 0.9, "low_watermark": 0.8, **coordinator}
    config = KVStoreConfig(coordinator=CoordinatorConfig(**coordinator))
    if index is None and _KIND["index"] == "dict":
        index = InMemoryIndex()
    return CoordinatorCore(config, index=index, clock=clock or FakeClock())


def register(core: CoordinatorCore, node_id: str, chains: list[list[bytes]],
             capacity: int = 1000) -> None:
    entries = [e for c in chains for e in make_entries(node_id, c)]
    core.register_node(node_id, NodeAddress(node_id, f"{node_id}:1"), capacity, entries)


def test_over_high_watermark_evicts_lru_down_to_low() -> None:
    core = make_core()
    singles = [make_chain(1, f"s{i}") for i in range(10)]
    register(core, "a", singles)
    order = [c[0] for c in singles]
    touched = order[5:] + order[:5]  # s5..s9 then s0..s4: s5 is now the least recent
    core.heartbeat("a", make_stats(1000, 850), touched, {})
    assert core.heartbeat("a", make_stats(1000, 850), [], {}).evict == []  # below high
    reply = core.heartbeat("a", make_stats(1000, 1000), [], {})
    assert reply.evict == [order[5], order[6]]  # 1000 -> 800 (low) = two blocks of 100


def test_children_go_before_parents() -> None:
    core = make_core()
    chain = make_chain(10, "c")
    register(core, "a", [chain])
    core.heartbeat("a", make_stats(1000, 1000), list(chain), {})  # the leaf is the most recent
    reply = core.heartbeat("a", make_stats(1000, 1000), [], {})
    assert reply.evict == [chain[9], chain[8]]


def test_pins_hard_kept_soft_last_then_expire() -> None:
    clock = FakeClock()
    core = make_core(clock=clock, soft_pin_ttl_s=60.0, node_timeout_s=1000.0)
    keys = [make_chain(1, f"p{i}")[0] for i in range(4)]
    register(core, "a", [[k] for k in keys], capacity=400)
    core.pin([keys[0]], hard=True, ttl_s=None)
    core.pin([keys[1]], hard=False, ttl_s=None)  # soft, default TTL
    assert core.request_eviction("a", 10_000) == [keys[2], keys[3], keys[1]]
    core.removed("a", [keys[2], keys[3]])
    clock.now += 61  # the soft pin expired: keys[1] is a plain block again
    core.heartbeat("a", make_stats(400, 200), [], {})
    assert core.pins.counts() == {"hard": 1, "soft": 0}
    assert core.unpin([keys[0]]) == 1
    assert core.request_eviction("a", 200) == [keys[0], keys[1]]


def test_pin_before_publish_applies_when_the_key_appears() -> None:
    core = make_core()
    chain = make_chain(2, "early")
    core.pin(chain, hard=True, ttl_s=None)
    register(core, "a", [chain])
    assert core.request_eviction("a", 10_000) == []


def test_ordered_keys_are_not_planned_twice_before_the_next_heartbeat() -> None:
    core = make_core()
    keys = [make_chain(1, f"l{i}")[0] for i in range(3)]
    register(core, "a", [[k] for k in keys])
    first = core.request_eviction("a", 100)
    second = core.request_eviction("a", 100)  # the node skipped `first` (leased): next one
    assert first == [keys[0]] and second == [keys[1]]
    core.heartbeat("a", make_stats(1000, 300), [], {})  # still held after the beat: may return
    assert core.request_eviction("a", 100) == [keys[0]]


def test_make_room_plans_from_the_reported_use_each_caller_new_keys_then_refuses() -> None:
    core = make_core()  # low watermark 0.80 of 1000
    keys = [make_chain(1, f"m{i}")[0] for i in range(8)]
    register(core, "a", [[k] for k in keys])
    core.heartbeat("a", make_stats(1000, 500), [], {})  # a second old by the time it fills up
    # The stale 500 would plan one block (what one Put needs); the node's own 1000 plans down
    # to the low watermark: 1000 + 100 - 800 = 300 bytes, three blocks, LRU first.
    assert core.request_eviction("a", 100, used_bytes=1000) == keys[:3]
    # A concurrent Put, before the node reported the first plan done: the ordered keys are
    # not planned (or counted) again, so it gets room of its own.
    assert core.request_eviction("a", 100, used_bytes=1000) == keys[3:6]
    core.removed("a", keys[:6])  # the node evicted both plans
    core.pin(keys[6:7], hard=True, ttl_s=None)
    assert core.request_eviction("a", 100, used_bytes=1000) == keys[7:]
    # Everything left is pinned or ordered out: nothing to plan, and the Put is refused.
    assert core.request_eviction("a", 100, used_bytes=1000) == []
    assert core.request_eviction("a", 100) == []  # without a reported use: at least what it needs


def test_default_watermarks_keep_the_pool_nearly_full() -> None:
    cfg = CoordinatorConfig()
    # every point below full costs hit rate; eviction still leaves room for a burst of Puts
    assert 0.9 <= cfg.low_watermark < cfg.high_watermark < 1.0


def test_dead_node_leaves_the_index_and_must_reannounce() -> None:
    clock = FakeClock()
    core = make_core(clock=clock, node_timeout_s=5.0)
    a, b = make_chain(3, "a"), make_chain(3, "b")
    register(core, "a", [a])
    register(core, "b", [b])
    assert core.lookup_prefix(a).num_blocks == 3
    clock.now += 4
    core.heartbeat("b", make_stats(1000, 300), [], {})
    clock.now += 4  # a: 8 s silent, b: 4 s
    assert core.check_liveness() == ["a"]
    assert core.lookup_prefix(a).num_blocks == 0
    assert core.lookup_prefix(b).num_blocks == 3
    assert set(core.directory()) == {"b"}
    assert {n.node_id: n.alive for n in core.nodes_status()} == {"a": False, "b": True}
    assert core.heartbeat("a", make_stats(1000, 300), [], {}).reannounce
    register(core, "a", [a])
    assert core.lookup_prefix(a).num_blocks == 3
    assert not core.heartbeat("a", make_stats(1000, 300), [], {}).reannounce


def test_restart_reconciles_with_what_nodes_hold_and_counts_drift() -> None:
    index = make_shared_index()  # survives the "restart", as Redis does
    chain = make_chain(6, "r")
    first = make_core(index=index)
    register(first, "a", [chain])
    second = make_core(index=index)
    assert second.epoch != first.epoch
    assert second.metrics["reloaded_blocks"] == 6
    assert second.lookup_prefix(chain).num_blocks == 6
    # while the coordinator was down the node evicted the last two and stored a new block
    extra = make_chain(1, "new")
    register(second, "a", [chain[:4], extra])
    assert second.lookup_prefix(chain).num_blocks == 4
    assert second.holders(extra) == [["a"]]
    assert second.status()["drift"] == {"added": 1, "removed": 2}
    assert sorted(second.lru.keys_of(second.nodes.get("a").slot)) == sorted(chain[:4] + extra)


def test_restart_with_a_fresh_index_recovers_from_reannounce() -> None:
    chain = make_chain(4, "m")
    register(make_core(), "a", [chain])
    fresh = make_core()  # in-memory index: nothing survives but the nodes' own blocks
    assert fresh.lookup_prefix(chain).num_blocks == 0
    assert fresh.heartbeat("a", make_stats(1000, 400), [], {}).reannounce
    register(fresh, "a", [chain])
    assert fresh.lookup_prefix(chain).num_blocks == 4
    assert fresh.status()["drift"]["added"] == 4


def test_invalidate_a_namespace_everywhere() -> None:
    core = make_core()
    a1, a2 = make_chain(3, "x"), make_chain(2, "y")
    b = make_chain(3, "z", root=ROOT_B)
    core.register_node("n1", NodeAddress("n1", "n1:1"), 1000,
                       make_entries("n1", a1) + make_entries("n1", b, root=ROOT_B))
    register(core, "n2", [a1, a2])
    assert core.invalidate(ROOT) == 5
    assert core.lookup_prefix(a1).num_blocks == 0 and core.lookup_prefix(a2).num_blocks == 0
    assert core.lookup_prefix(b).num_blocks == 3
    assert sorted(core.heartbeat("n1", make_stats(1000, 600), [], {}).evict) == sorted(a1)
    assert sorted(core.heartbeat("n2", make_stats(1000, 500), [], {}).evict) == sorted(a1 + a2)


def test_drain_replicates_where_there_is_room_then_evicts() -> None:
    core = make_core()
    chain = make_chain(4, "d")
    register(core, "a", [chain])
    register(core, "b", [], capacity=1000)
    register(core, "c", [chain[:1]], capacity=1000)
    core.heartbeat("b", make_stats(1000, 700), [], {})  # b has room for 2 blocks (< 900)
    core.heartbeat("c", make_stats(1000, 900), [], {})  # c has none
    assert core.drain("a") == 4
    first = core.heartbeat("a", make_stats(1000, 400), [], {}).evict
    assert sorted(first) == sorted([chain[0], chain[3]])  # c has chain[0]; no room for chain[3]
    orders = core.heartbeat("b", make_stats(1000, 700), [], {}).replicate
    assert len(orders) == 1 and orders[0].source.node_id == "a"
    assert orders[0].keys == chain[1:3]
    core.publish("b", make_entries("b", chain)[1:3])  # b executed the order
    reply = core.heartbeat("a", make_stats(1000, 200), [], {})
    assert sorted(reply.evict) == sorted(chain[1:3])  # copies elsewhere now: a lets go


def test_hot_keys_and_soft_pins_replicate_to_the_reader_node() -> None:
    core = make_core(hot_fetch_threshold=3)
    hot, sys_prompt = make_chain(2, "hot"), make_chain(1, "sys")
    register(core, "a", [hot, sys_prompt])
    register(core, "r", [])
    core.pin(sys_prompt, hard=False, ttl_s=30.0)
    core.heartbeat("a", make_stats(1000, 300), [], {"r": hot + sys_prompt})
    core.heartbeat("a", make_stats(1000, 300), [], {"r": hot})
    first = core.heartbeat("r", make_stats(1000, 0), [], {}).replicate
    assert [(o.keys, o.source.node_id) for o in first] == [(sys_prompt, "a")]
    core.heartbeat("a", make_stats(1000, 300), [], {"r": hot})  # third remote read
    second = core.heartbeat("r", make_stats(1000, 0), [], {}).replicate
    assert [(o.keys, o.source.node_id) for o in second] == [(hot, "a")]
    core.publish("r", make_entries("r", hot))
    assert core.holders(hot) == [["a", "r"], ["a", "r"]]


def wait_for(cond, timeout_s: float = 10.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_reaper_drops_the_only_node_without_any_heartbeat() -> None:
    from kvstore.coordinator.liveness import Reaper

    clock = FakeClock()
    core = make_core(clock=clock, node_timeout_s=5.0, heartbeat_interval_s=1.0)
    chain = make_chain(3, "lone")
    register(core, "lone", [chain])
    reaper = Reaper(core.check_liveness, 0.01)
    try:
        time.sleep(0.05)
        assert core.holders(chain) == [["lone"]] * 3  # not silent long enough yet
        clock.now += 6  # nobody calls the core: only the reaper can notice
        assert wait_for(lambda: core.holders(chain) == [[], [], []])
        assert core.metrics["nodes_dead"] == 1
    finally:
        reaper.stop()


def _sample(name: str, **labels: str) -> float:
    from kvstore.metrics import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_prometheus_metrics_follow_drift_evictions_nodes_and_pins() -> None:
    clock = FakeClock()
    index = make_shared_index()
    chain = make_chain(4, uuid.uuid4().hex)
    drift = "kvstore_coordinator_drift_blocks_total"
    added, removed = _sample(drift, kind="added"), _sample(drift, kind="removed")
    evicts = _sample("kvstore_coordinator_evict_orders_total")
    dead = _sample("kvstore_coordinator_nodes_dead_total")
    first = make_core(index=index, clock=clock, node_timeout_s=100.0)
    register(first, "a", [chain])
    core = make_core(index=index, clock=clock, node_timeout_s=100.0)  # a restart: reconcile
    register(core, "a", [chain[:3]])  # a lost chain[3] meanwhile
    register(core, "b", [make_chain(2, "other")])
    # first start: 4 missing from the index; restart: 1 the node no longer has; b: 2 new
    assert _sample(drift, kind="added") == added + 6
    assert _sample(drift, kind="removed") == removed + 1
    assert _sample("kvstore_coordinator_nodes_alive") == 2
    core.pin(chain[:1], hard=True, ttl_s=None)
    core.pin(chain[1:3], hard=False, ttl_s=60.0)
    assert _sample("kvstore_coordinator_pins", kind="hard") == 1
    assert _sample("kvstore_coordinator_pins", kind="soft") == 2
    core.heartbeat("a", make_stats(300, 290), [], {})  # over the high watermark
    clock.now += 61  # soft pins expire
    core.heartbeat("b", make_stats(1000, 0), [], {})
    assert _sample("kvstore_coordinator_pins", kind="soft") == 0
    clock.now += 200
    assert core.check_liveness() == ["a", "b"]
    assert _sample("kvstore_coordinator_nodes_alive") == 0
    assert _sample("kvstore_coordinator_nodes_dead_total") == dead + 2
    assert _sample("kvstore_coordinator_evict_orders_total") > evicts


def test_bad_input_is_rejected_with_a_message() -> None:
    core = make_core()
    chain = make_chain(1, "bad")
    with pytest.raises(ValueError, match="names node 'a'"):
        core.publish("b", make_entries("a", chain))
    with pytest.raises(ValueError, match="capacity_bytes"):
        core.register_node("a", NodeAddress("a", "a:1"), 0, [])
    with pytest.raises(TypeError):
        core.holders([b""])
    with pytest.raises(ValueError, match="not registered"):
        core.drain("nobody")
    with pytest.raises(ValueError, match="ttl_s"):
        core.pin(chain, hard=False, ttl_s=-1)


def test_status_is_json_and_shows_hashes_not_tokens() -> None:
    core = make_core()
    chain = make_chain(3, "st")
    register(core, "a", [chain])
    core.heartbeat("a", PoolStats(1000, 300, 3, 0, 0, 8, 2, 0), [chain[0]] * 3, {})
    status = json.loads(json.dumps(core.status()))
    assert status["totals"]["hit_rate"] == pytest.approx(0.8)
    assert status["top_prefixes"][0] == {"key": chain[0].hex(), "touches": 3}
    assert status["nodes"][0]["blocks"] == 3


def test_embedded_index_is_the_lru_table_and_stores_each_block_once() -> None:
    core = CoordinatorCore(KVStoreConfig(), clock=FakeClock())  # index.backend == "memory"
    assert isinstance(core.index, TableIndex) and core.lru is core.index.table
    n = 20_000
    raw = np.random.default_rng(0).bytes(32 * n)
    keys = [raw[i * 32:(i + 1) * 32] for i in range(n)]
    parents = [ROOT, *keys[:-1]]
    core.register_node("a", NodeAddress("a", "a:1"), 1 << 40, [])
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(0, n, 1000):
        core.publish("a", [IndexEntry(bytes(bytearray(k)), "a", BLOCK, p, ROOT)
                           for k, p in zip(keys[i:i + 1000], parents[i:i + 1000], strict=True)])
    per_block = (tracemalloc.get_traced_memory()[0] - before) / n
    tracemalloc.stop()
    assert per_block <= 200, f"{per_block:.0f} B per block: something keeps a per-block object"
    # one structure answers the readers' view and the LRU: a removal shows in both at once
    info = core.index.info(keys[1:2])[0]
    assert info is not None and (info.parent_key, info.namespace_root) == (keys[0], ROOT)
    core.removed("a", keys[5:6])
    assert core.lookup_prefix(keys[:10]).num_blocks == 5
    assert core.lru.num_blocks == core.index.num_keys() == n - 1


def test_embedded_node_slot_is_its_index_bit() -> None:
    core = make_core(index=TableIndex())
    register(core, "a", [make_chain(2, "x")])
    register(core, "b", [make_chain(2, "y")])
    for node_id in ("a", "b"):
        assert core.nodes.get(node_id).slot == core.index.claim_node(node_id)
    core.remove_node("a")
    register(core, "c", [])  # holds nothing yet: its bit must still be its own
    c_bit = core.nodes.get("c").slot
    core.publish("c", make_entries("c", make_chain(1, "z")))
    assert core.index.claim_node("c") == c_bit
    assert core.lru.node_bytes(c_bit) == BLOCK


@pytest.mark.redis
def test_redis_restarted_empty_bumps_the_epoch_and_nodes_rebuild_it(
        fresh_redis: RedisProcess) -> None:
    from kvstore.index.redis import RedisIndex

    index = RedisIndex(fresh_redis.url, key_prefix="t:")
    core = make_core(index=index)
    chain = make_chain(4, "lost")
    register(core, "a", [chain])
    epoch = core.epoch
    assert not core.check_index()  # the marker is there: nothing to do
    fresh_redis.restart()  # no persistence: it comes back empty
    assert index.lookup_prefix(chain).num_blocks == 0
    assert core.check_index()
    assert core.epoch != epoch
    assert core.metrics["index_resets"] == 1 and core.metrics["index_lost_blocks"] == 4
    assert not core.check_index()  # noticed once, not on every tick
    reply = core.heartbeat("a", make_stats(1000, 400), [], {})
    assert reply.epoch == core.epoch  # the node sees a new epoch and re-announces
    register(core, "a", [chain])
    assert index.lookup_prefix(chain).num_blocks == 4
    assert index.holders(chain) == [["a"]] * 4
    index.close()
