"""EvictingPool without Ray: a real BlockPool, make-room as a plain function, racing threads."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kvstore.cluster.store_node import EvictingPool
from kvstore.coordinator.index_service import FastPath
from kvstore.errors import PoolFull
from kvstore.node.block_pool import BlockPool

BLOCK = 4096
NUM_BLOCKS = 16


def make_key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


@pytest.fixture
def full_pool(tmp_path) -> Iterator[BlockPool]:
    """A pool holding NUM_BLOCKS committed blocks and no free byte."""
    pool = BlockPool(NUM_BLOCKS * BLOCK, shm_dir=str(tmp_path))
    for i in range(NUM_BLOCKS):
        assert pool.put(make_key(i), bytes(BLOCK))
    with pytest.raises(PoolFull):
        pool.reserve(make_key(10_000), BLOCK)
    yield pool
    pool.close()


def make_room_evicting(pool: BlockPool, num_blocks: int, calls: list[int]
                       ) -> Callable[[int], bool]:
    """A coordinator stand-in: each call evicts ``num_blocks`` least recently used blocks."""
    def make_room(nbytes: int) -> bool:
        calls.append(nbytes)
        return pool.evict(pool.lru_candidates(num_blocks)) > 0
    return make_room


def reserve_all(pool: EvictingPool, keys: list[bytes]) -> list[BaseException | None]:
    """Reserve one block per key, each from its own thread, all released at once."""
    start = threading.Barrier(len(keys))
    errors: list[BaseException | None] = [None] * len(keys)

    def one(i: int) -> None:
        start.wait()
        try:
            pool.commit(pool.reserve(keys[i], BLOCK))
        except PoolFull as exc:
            errors[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(keys))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_concurrent_reservations_share_the_room_one_call_makes(full_pool: BlockPool) -> None:
    calls: list[int] = []
    pool = EvictingPool(full_pool, make_room_evicting(full_pool, 4, calls))
    keys = [make_key(100 + i) for i in range(8)]
    assert reserve_all(pool, keys) == [None] * 8
    assert all(full_pool.contains(k) for k in keys)
    # 8 blocks at 4 per call: 2 calls, give or take one lost race; never one call per Put
    assert 2 <= len(calls) <= 3, calls


def test_room_taken_by_others_is_retried_a_bounded_number_of_times(
        full_pool: BlockPool) -> None:
    calls: list[int] = []

    def make_room_that_loses_the_race(nbytes: int) -> bool:
        calls.append(nbytes)
        return True  # freed something, which another Put took before the retry

    pool = EvictingPool(full_pool, make_room_that_loses_the_race, max_attempts=5)
    with pytest.raises(PoolFull, match="concurrent Puts took the room of 5 evictions"):
        pool.reserve(make_key(200), BLOCK)
    assert calls == [BLOCK] * 5


def test_nothing_evictable_fails_at_once_with_the_reason(full_pool: BlockPool) -> None:
    calls: list[int] = []

    def nothing(nbytes: int) -> bool:
        calls.append(nbytes)
        return False

    pool = EvictingPool(full_pool, nothing)
    with pytest.raises(PoolFull, match="nothing evictable"):
        pool.reserve(make_key(300), BLOCK)
    assert calls == [BLOCK]


def test_a_block_larger_than_the_pool_evicts_nothing(full_pool: BlockPool) -> None:
    calls: list[int] = []
    pool = EvictingPool(full_pool, make_room_evicting(full_pool, 4, calls))
    with pytest.raises(PoolFull, match="larger than the whole pool"):
        pool.reserve(make_key(400), (NUM_BLOCKS + 1) * BLOCK)
    assert calls == [] and len(full_pool.keys()) == NUM_BLOCKS


def test_reserve_many_makes_room_and_reserves_the_whole_batch(full_pool) -> None:
    calls: list[int] = []
    pool = EvictingPool(full_pool, make_room_evicting(full_pool, 4, calls))
    keys = [make_key(100 + i) for i in range(6)]
    got = pool.reserve_many(keys, BLOCK)
    assert [r.key for r in got] == keys
    assert len(calls) == 2  # 4 blocks of room per call, asked only when the pool stops short
    assert pool.commit_many(got) == [True] * 6


def test_reserve_many_returns_what_fit_then_says_why(full_pool) -> None:
    """Room for part of a batch: the part comes back (the caller stores it), and asking again
    for the rest raises the PoolFull that names the cause."""
    budget = [1]

    def make_room_once(nbytes: int) -> bool:
        if not budget[0]:
            return False
        budget[0] -= 1
        return full_pool.evict(full_pool.lru_candidates(2)) > 0

    pool = EvictingPool(full_pool, make_room_once)
    keys = [make_key(200 + i) for i in range(5)]
    got = pool.reserve_many(keys, BLOCK)
    assert [r.key for r in got] == keys[:2]
    with pytest.raises(PoolFull, match="found nothing evictable"):
        pool.reserve_many(keys[2:], BLOCK)
    assert pool.commit_many(got) == [True, True]


class _FakeServer:
    def __init__(self) -> None:
        self.forgotten: list[bytes] = []

    def forget(self, key: bytes) -> None:
        self.forgotten.append(key)


def _bare_node(pool: BlockPool, plans: list[list[bytes]]):
    """A StoreNode without Ray: just what ``_make_room`` and ``_evict`` use."""
    from kvstore.cluster.store_node import StoreNode

    node = object.__new__(StoreNode)
    node.pool = pool
    node.tiered = None  # no disk tier (tests/cluster/test_disk_tier_node.py has one)
    node.node_id = "n" * 56
    node.server = _FakeServer()
    node._redis = None
    node.calls = []

    def call(method: str, *args, **kwargs):
        node.calls.append((method, args))
        return plans.pop(0) if method == "request_eviction" else None

    node._call = call
    return node


def test_make_room_sends_the_use_and_evict_reports_only_what_went(full_pool) -> None:
    from kvstore import metrics

    full_pool.pin(make_key(1))
    lease = full_pool.lease([make_key(2)], ttl_s=60)
    plan = [make_key(0), make_key(1), make_key(2), make_key(3), make_key(999), make_key(0)]
    node = _bare_node(full_pool, [plan])
    before = metrics.EVICTIONS.labels(node_id=node.node_id, cause="capacity")._value.get()
    used = full_pool.used_bytes()
    assert used == full_pool.stats().used_bytes == NUM_BLOCKS * BLOCK
    assert node._make_room(BLOCK)
    request, removed = node.calls
    assert request == ("request_eviction", (node.node_id, BLOCK, used))
    gone = [make_key(0), make_key(3), make_key(999), make_key(0)]  # as given, absent ones too
    assert removed == ("removed", (node.node_id, gone))
    assert node.server.forgotten == gone
    assert full_pool.held(plan) == [False, True, True, False, False, False]
    after = metrics.EVICTIONS.labels(node_id=node.node_id, cause="capacity")._value.get()
    # blocks that were there and went, one per key given (key 0 is given twice)
    assert after - before == 3
    full_pool.release(lease.lease_id)


def test_a_put_past_the_fill_mark_evicts_ahead_off_the_put_path(full_pool) -> None:
    """A publish that leaves the pool past ``_EVICT_AHEAD_FILL`` wakes the evictor thread,
    which asks for the plan down to the low watermark (``nbytes_needed`` 0, the use now) and
    evicts it, counted as ``watermark``; below the mark nothing is asked. A reserve waiting
    on the same lock then finds room made and asks no plan of its own."""
    from kvstore import metrics

    plan = [make_key(i) for i in range(4)]
    node = _bare_node(full_pool, [plan])
    node._evicting = EvictingPool(full_pool, node._make_room)
    node._ahead_bytes = NUM_BLOCKS * BLOCK - 1  # full_pool is past it
    node._evict_ahead = threading.Event()
    node._stop = threading.Event()
    node._index_fast = FastPath(lambda: None)  # no index service: publishes go to the actor
    before = metrics.EVICTIONS.labels(node_id=node.node_id, cause="watermark")._value.get()
    evictor = threading.Thread(target=node._evictor_loop, daemon=True)
    evictor.start()
    try:
        node._on_publish([])  # the Put's publish: nothing to publish, but the fill is checked
        deadline = time.monotonic() + 10
        while full_pool.used_bytes() > (NUM_BLOCKS - 4) * BLOCK and time.monotonic() < deadline:
            time.sleep(0.01)
        assert full_pool.held(plan) == [False] * 4
        asks = [c for c in node.calls if c[0] == "request_eviction"]
        assert asks == [("request_eviction", (node.node_id, 0, NUM_BLOCKS * BLOCK))]
        after = metrics.EVICTIONS.labels(node_id=node.node_id, cause="watermark")._value.get()
        assert after - before == 4
        node._on_publish([])  # below the mark now: no round
        time.sleep(0.1)
        assert node._evicting.reserve(make_key(500), BLOCK) is not None  # room is there
        assert [c for c in node.calls if c[0] == "request_eviction"] == asks
    finally:
        node._stop.set()
        node._evict_ahead.set()
        evictor.join(timeout=5)
