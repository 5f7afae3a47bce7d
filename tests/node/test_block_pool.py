"""BlockPool against a plain dict model: round trips, leases, pins, LRU, fullness, threads."""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator

import pytest

from kvstore.constants import ALIGN
from kvstore.errors import BlockNotFound, KVStoreError, PoolFull
from kvstore.node.arena import ExtentAllocator
from kvstore.node.block_pool import BlockPool


def make_key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8  # 32 bytes, like a real block key


def make_block(i: int, nbytes: int) -> bytes:
    return random.Random(i).randbytes(nbytes)


@pytest.fixture
def make_pool(tmp_path) -> Iterator:
    pools: list[BlockPool] = []

    def factory(capacity: int) -> BlockPool:
        pool = BlockPool(capacity, shm_dir="/dev/shm")
        pools.append(pool)
        return pool

    yield factory
    for pool in pools:
        pool.close()
        assert not os.path.exists(pool.path), "close must unlink the arena file"


def test_put_get_round_trip_is_bitwise(make_pool) -> None:
    pool = make_pool(1 << 20)
    blocks = {make_key(i): make_block(i, 1000 + 37 * i) for i in range(20)}
    for key, data in blocks.items():
        assert pool.put(key, data)
    for key, data in blocks.items():
        assert pool.get(key) == data
        assert pool.nbytes_of(key) == len(data)
        with pool.read(key) as view:
            assert view.readonly and bytes(view) == data
    assert sorted(pool.keys()) == sorted(blocks)
    assert pool.stats().num_blocks == 20


def test_put_accepts_bytearray_and_typed_memoryview(make_pool) -> None:
    pool = make_pool(1 << 16)
    import array

    arr = array.array("i", range(100))
    assert pool.put(make_key(1), memoryview(arr))
    assert pool.get(make_key(1)) == arr.tobytes()
    assert pool.put(make_key(2), bytearray(b"xyz"))
    assert pool.get(make_key(2)) == b"xyz"


def test_put_existing_key_returns_false_and_keeps_first(make_pool) -> None:
    pool = make_pool(1 << 16)
    assert pool.put(make_key(1), b"a" * 100)
    used = pool.stats().used_bytes
    assert not pool.put(make_key(1), b"b" * 100)
    assert pool.get(make_key(1)) == b"a" * 100
    assert pool.stats().used_bytes == used


def test_missing_key_is_block_not_found(make_pool) -> None:
    pool = make_pool(1 << 16)
    with pytest.raises(BlockNotFound, match="not in this pool"):
        pool.get(make_key(9))
    assert pool.nbytes_of(make_key(9)) is None and not pool.contains(make_key(9))
    assert pool.stats().misses == 1


def test_pool_full_raises_and_leaves_nothing_half_written(make_pool) -> None:
    pool = make_pool(10 * 1024)
    for i in range(10):
        pool.put(make_key(i), make_block(i, 1024))
    with pytest.raises(PoolFull, match=r"capacity 10240 B, used 10240 B"):
        pool.put(make_key(99), make_block(99, 1024))
    assert not pool.contains(make_key(99))
    assert pool.stats().num_blocks == 10
    with pytest.raises(PoolFull, match="larger than the whole pool"):
        pool.put(make_key(100), bytes(20 * 1024))
    for i in range(10):
        assert pool.get(make_key(i)) == make_block(i, 1024)


def test_reserved_key_is_invisible_until_commit(make_pool) -> None:
    pool = make_pool(1 << 16)
    res = pool.reserve(make_key(1), 256)
    res.view[:] = make_block(1, 256)
    assert not pool.contains(make_key(1))
    with pytest.raises(BlockNotFound):
        pool.get(make_key(1))
    assert pool.commit(res)
    assert pool.get(make_key(1)) == make_block(1, 256)
    with pytest.raises(ValueError, match="already committed"):
        pool.commit(res)


def test_abort_frees_space_and_concurrent_put_wins(make_pool) -> None:
    pool = make_pool(4096)
    res = pool.reserve(make_key(1), 4096)
    pool.abort(res)
    assert pool.stats().used_bytes == 0
    res = pool.reserve(make_key(2), 1024)
    assert pool.put(make_key(2), b"w" * 1024)
    assert not pool.commit(res)  # the concurrent put won; our space comes back
    assert pool.get(make_key(2)) == b"w" * 1024
    assert pool.stats().used_bytes == 1024


def test_delete_under_lease_defers_freeing(make_pool) -> None:
    pool = make_pool(2048)
    pool.put(make_key(1), make_block(1, 2048))
    lease = pool.lease([make_key(1), make_key(2)], ttl_s=60)
    assert [loc.key for loc in lease.locations] == [make_key(1)]  # absent keys are left out
    assert pool.delete(make_key(1))
    assert not pool.contains(make_key(1))
    assert pool.stats().used_bytes == 2048  # still leased: the bytes must stay
    with pytest.raises(PoolFull):
        pool.put(make_key(3), bytes(2048))
    loc = lease.locations[0]
    with open(pool.path, "rb") as f:
        f.seek(loc.offset)
        assert f.read(loc.nbytes) == make_block(1, 2048)
    pool.release(lease.lease_id)
    assert pool.stats().used_bytes == 0
    assert pool.put(make_key(3), bytes(2048))
    pool.release(lease.lease_id)  # idempotent


def test_delete_during_read_defers_freeing(make_pool) -> None:
    pool = make_pool(1024)
    pool.put(make_key(1), make_block(1, 1024))
    with pool.read(make_key(1)) as view:
        pool.delete(make_key(1))
        with pytest.raises(PoolFull):
            pool.put(make_key(2), bytes(1024))
        assert bytes(view) == make_block(1, 1024)
    assert pool.put(make_key(2), bytes(1024))


def test_lease_expiry_frees_deleted_block(make_pool) -> None:
    pool = make_pool(1024)
    pool.put(make_key(1), bytes(1024))
    lease = pool.lease([make_key(1)], ttl_s=0.05)
    assert pool.lru_candidates(10) == []  # leased: not evictable
    pool.delete(make_key(1))
    time.sleep(0.1)
    assert pool.put(make_key(2), bytes(1024))  # expiry reclaimed the space
    assert not pool.renew(lease.lease_id, 10)


def test_renew_keeps_lease_alive(make_pool) -> None:
    pool = make_pool(4096)
    pool.put(make_key(1), bytes(100))
    lease = pool.lease([make_key(1)], ttl_s=0.1)
    assert pool.renew(lease.lease_id, 60)
    time.sleep(0.15)
    assert pool.stats().num_leased == 1
    assert pool.lru_candidates(10) == []
    pool.release(lease.lease_id)
    assert pool.stats().num_leased == 0
    assert pool.lru_candidates(10) == [make_key(1)]
    with pytest.raises(ValueError, match="ttl_s"):
        pool.lease([make_key(1)], ttl_s=0)


def test_pin_prevents_eviction(make_pool) -> None:
    pool = make_pool(1 << 16)
    for i in range(3):
        pool.put(make_key(i), bytes(100))
    assert pool.pin(make_key(0)) and not pool.pin(make_key(9))
    assert pool.lru_candidates(10) == [make_key(1), make_key(2)]
    assert pool.evict([make_key(0), make_key(1)]) == 100
    assert pool.contains(make_key(0)) and not pool.contains(make_key(1))
    assert pool.stats().num_pinned == 1 and pool.stats().evictions == 1
    assert pool.unpin(make_key(0))
    assert pool.evict([make_key(0)]) == 100


def test_lru_order_follows_touch_get_and_lease(make_pool) -> None:
    pool = make_pool(1 << 16)
    for i in range(5):
        pool.put(make_key(i), bytes(64))
    pool.touch([make_key(0)])
    pool.get(make_key(1))
    pool.release(pool.lease([make_key(2)], ttl_s=10).lease_id)
    assert pool.lru_candidates(10) == [make_key(i) for i in (3, 4, 0, 1, 2)]
    assert pool.lru_candidates(2) == [make_key(3), make_key(4)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixed_sizes_only_ever_raise_pool_full(make_pool, seed: int) -> None:
    rng = random.Random(seed)
    pool = make_pool(64 * 1024)
    model: dict[bytes, bytes] = {}
    for step in range(1500):
        key = make_key(rng.randrange(300))
        if rng.random() < 0.6:
            data = rng.randbytes(rng.choice([64, 100, 1000, 3000, 4096, 9000]))
            try:
                if pool.put(key, data):
                    model[key] = data
            except PoolFull:
                assert key not in model
        else:
            assert pool.delete(key) == (key in model)
            model.pop(key, None)
        if step % 100 == 0:
            assert {k: pool.get(k) for k in pool.keys()} == model
    stats = pool.stats()
    assert stats.used_bytes == sum((len(v) + ALIGN - 1) // ALIGN * ALIGN for v in model.values())
    for key in list(model):
        pool.delete(key)
    assert pool.stats().used_bytes == 0
    pool.put(make_key(0), bytes(64 * 1024))  # fully coalesced again


def test_allocator_coalesces_and_reuses_exact_slots() -> None:
    alloc = ExtentAllocator(640)
    offsets = [alloc.alloc(64) for _ in range(10)]
    assert offsets == [i * 64 for i in range(10)] and alloc.alloc(1) is None
    for off in offsets[::2]:
        alloc.free(off, 64)
    assert alloc.alloc(128) is None  # fragmented: no two adjacent free slots
    for off in offsets[1::2]:
        alloc.free(off, 64)
    assert alloc.num_free_extents == 1 and alloc.alloc(640) == 0


def test_concurrent_writers_and_readers_lose_nothing(make_pool) -> None:
    pool = make_pool(4 << 20)
    errors: list[BaseException] = []
    written: dict[bytes, bytes] = {}
    written_lock = threading.Lock()

    def writer(tid: int) -> None:
        rng = random.Random(tid)
        for i in range(150):
            key = make_key(tid * 1000 + i)
            data = rng.randbytes(rng.choice([512, 2048, 8192]))
            assert pool.put(key, data)
            with written_lock:
                written[key] = data

    def reader(tid: int) -> None:
        rng = random.Random(100 + tid)
        for _ in range(400):
            with written_lock:
                if not written:
                    continue
                key, data = rng.choice(list(written.items()))
            if rng.random() < 0.5:
                assert pool.get(key) == data
            else:
                lease = pool.lease([key], ttl_s=5)
                loc = lease.locations[0]
                with pool.read(key) as view:
                    assert len(view) == loc.nbytes and bytes(view) == data
                pool.release(lease.lease_id)

    def run(fn, tid: int) -> None:
        try:
            fn(tid)
        except BaseException as exc:  # surfaced by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(writer, t)) for t in range(3)]
    threads += [threading.Thread(target=run, args=(reader, t)) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert {k: pool.get(k) for k in pool.keys()} == written
    assert pool.stats().num_leased == 0


def test_close_unlinks_and_rejects_use(tmp_path) -> None:
    pool = BlockPool(4096, name=f"kvstore-test-{os.getpid()}-close")
    assert os.path.exists(pool.path) and os.path.getsize(pool.path) == 4096
    pool.put(make_key(1), b"x")
    pool.close()
    assert not os.path.exists(pool.path)
    with pytest.raises(KVStoreError, match="closed"):
        pool.put(make_key(2), b"y")
    pool.close()  # idempotent


def test_bad_shm_dir_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="not a directory"):
        BlockPool(4096, shm_dir=str(tmp_path / "nope"))


def test_reserve_many_and_commit_many_match_one_at_a_time(make_pool) -> None:
    """The batch calls against ``reserve``/``commit`` block by block: held keys are skipped
    (None), the run stops at the first block there is no room for, and a key another writer
    committed in between is refused at commit with its space freed."""
    size = 4096
    pool = make_pool(5 * size)
    assert pool.put(make_key(1), make_block(1, size))
    keys = [make_key(i) for i in range(8)]
    got = pool.reserve_many(keys, size)
    assert [r is None for r in got] == [False, True, False, False, False]  # 4 fit beside key 1
    assert [r.key for r in got if r is not None] == [keys[0], keys[2], keys[3], keys[4]]
    for r in got:
        if r is not None:
            r.view[:] = make_block(int.from_bytes(r.key[:4], "little"), size)
    assert not pool.contains(keys[0])  # invisible until committed
    racer = got[2]
    pool.abort(racer)  # another writer takes key 2's place and commits first
    assert pool.put(keys[2], make_block(2, size))
    with pytest.raises(PoolFull):
        pool.reserve_many(keys[5:], size)
    assert pool.commit_many([r for r in got if r is not None and r is not racer]) \
        == [True, True, True]
    for i in (0, 1, 2, 3, 4):
        assert pool.get(keys[i]) == make_block(i, size)
    assert pool.stats().used_bytes == 5 * size
    with pytest.raises(ValueError, match="already committed or aborted"):
        pool.commit_many([got[0]])


def test_commit_many_refuses_a_key_committed_since_its_reservation(make_pool) -> None:
    size = 4096
    pool = make_pool(4 * size)
    first = pool.reserve_many([make_key(1), make_key(2)], size)
    assert pool.put(make_key(2), make_block(2, size))  # the racer
    assert pool.commit_many([r for r in first if r is not None]) == [True, False]
    assert pool.stats().used_bytes == 2 * size  # the loser's space came back


def test_held_and_used_bytes_match_contains_and_stats(tmp_path) -> None:
    pool = BlockPool(64 * 4096, shm_dir=str(tmp_path))
    try:
        for i in range(20):
            assert pool.put(make_key(i), bytes(1000 + i))
        pool.delete(make_key(3))
        keys = [make_key(i) for i in (0, 3, 19, 99, 0)]
        assert pool.held(keys) == [pool.contains(k) for k in keys] == [True, False, True,
                                                                       False, True]
        assert pool.held([]) == []
        assert pool.used_bytes() == pool.stats().used_bytes > 0
        # a deleted block under an expired lease frees its bytes: both figures see it
        pool.lease([make_key(5)], ttl_s=0.05)
        pool.delete(make_key(5))
        held_up = pool.used_bytes()
        time.sleep(0.1)
        assert pool.used_bytes() < held_up
        assert pool.used_bytes() == pool.stats().used_bytes
    finally:
        pool.close()
