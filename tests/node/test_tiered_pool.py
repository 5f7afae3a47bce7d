"""TieredPool and DiskTier with real block files: demotion, verified promotion, damaged files,
crash-safe writes, restart recovery, a bounded and a full disk."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvstore.block import encode_block, verify_block
from kvstore.errors import BlockNotFound
from kvstore.keys import BlockHasher, Namespace
from kvstore.node.block_pool import BlockPool
from kvstore.node.disk_tier import DiskTier, DiskTierInUse
from kvstore.node.tiered_pool import TieredPool
from tests.support.damage import DAMAGES, damage_file


def make_namespace(num_layers: int = 2, head_dim: int = 32) -> Namespace:
    return Namespace("tier-model", "float16", 16, num_layers, 2, head_dim)


def make_blocks(ns: Namespace, num_blocks: int, seed: int = 0
                ) -> tuple[list[bytes], list[list[int]], list[bytes]]:
    """Chained keys, their tokens and encoded blocks with random payloads."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 50_000, (num_blocks * ns.block_size,), generator=gen).tolist()
    keys = list(BlockHasher(ns).block_keys(tokens))
    per_block = [tokens[i * ns.block_size:(i + 1) * ns.block_size] for i in range(num_blocks)]
    parents = [ns.root, *keys[:-1]]
    blocks = [bytes(encode_block(ns, k, p, t, torch.randn(ns.payload_shape, generator=gen)
                                 .to(ns.torch_dtype)))
              for k, p, t in zip(keys, parents, per_block, strict=True)]
    return keys, per_block, blocks


@pytest.fixture
def make_tiered(tmp_path: Path) -> Iterator:
    pools: list[TieredPool] = []

    def factory(arena_blocks: int, disk_bytes: int, *, directory: Path | None = None,
                block_nbytes: int = 0, queue_bytes: int = 64 << 20) -> TieredPool:
        arena = BlockPool(max(4096, arena_blocks * (block_nbytes or 8192)))
        disk = DiskTier(str(directory or tmp_path / "disk"), disk_bytes)
        pool = TieredPool(arena, disk, queue_bytes=queue_bytes)
        pools.append(pool)
        return pool

    yield factory
    for pool in pools:
        with contextlib.suppress(Exception):
            pool.close()


def read_verified(pool: TieredPool, ns: Namespace, key: bytes, tokens: list[int]) -> bool:
    """A same-node reader's read: lease, copy, verify against its own namespace."""
    lease = pool.lease([key], 10.0)
    try:
        if not lease.locations:
            return False
        loc = lease.locations[0]
        data = bytes(pool.leased_bytes(loc.offset, loc.nbytes))
    finally:
        pool.release(lease.lease_id)
    verify_block(data, ns, key, tokens)
    return True


def test_demote_then_promote_round_trip_is_bitwise(make_tiered) -> None:
    ns = make_namespace()
    keys, tokens, blocks = make_blocks(ns, 6)
    nb = len(blocks[0])
    pool = make_tiered(arena_blocks=8, disk_bytes=1 << 20, block_nbytes=nb)
    for k, b in zip(keys, blocks, strict=True):
        assert pool.put(k, b)
    freed = pool.demote(keys[:4])
    assert freed == 4 * nb
    assert pool.flush()
    assert pool.arena.held(keys) == [False] * 4 + [True] * 2
    assert pool.held(keys) == [True] * 6  # the node still holds them, on disk
    assert sorted(pool.disk_only_keys()) == sorted(keys[:4])
    assert pool.counters.demotions == 4 and len(pool.disk) == 4
    # a Put of a demoted key is "exists", not a second copy
    assert not pool.put(keys[0], blocks[0])
    assert pool.reserve_many(keys[:2], nb) == [None, None]
    # a read brings it back, verified, bitwise
    assert read_verified(pool, ns, keys[1], tokens[1])
    assert pool.arena.contains(keys[1]) and pool.counters.promotions == 1
    with pool.read(keys[2]) as view:
        assert bytes(view) == blocks[2]
    lost, promoted = pool.take_changes()
    assert lost == [] and sorted(promoted) == sorted(keys[1:3])
    # the promoted block keeps its file: demoting it again writes nothing
    written = pool.disk.counters.bytes_written
    assert pool.demote([keys[1]]) == nb
    assert pool.flush() and pool.disk.counters.bytes_written == written
    st = pool.stats()
    assert st.disk_blocks == 4 and st.disk_hits == 2 and st.disk_capacity_bytes == 1 << 20


def test_demotion_skips_leased_and_pinned_blocks(make_tiered) -> None:
    ns = make_namespace()
    keys, _, blocks = make_blocks(ns, 3)
    pool = make_tiered(arena_blocks=4, disk_bytes=1 << 20, block_nbytes=len(blocks[0]))
    for k, b in zip(keys, blocks, strict=True):
        pool.put(k, b)
    lease = pool.lease([keys[0]], 10.0)
    pool.pin(keys[1])
    assert pool.demote(keys) == len(blocks[0])
    assert pool.arena.held(keys) == [True, True, False]
    pool.release(lease.lease_id)


def test_a_lease_bigger_than_the_free_arena_makes_room_and_keeps_what_it_promoted(
        make_tiered) -> None:
    """A read of 6 disk blocks into an arena with room for 4: the pool asks ``make_room``
    (the node's eviction), whose demotion cannot take the blocks this lease promoted in its
    first round (they joined the lease as they were committed); every block is served."""
    ns = make_namespace()
    keys, tokens, blocks = make_blocks(ns, 10)
    nb = len(blocks[0])
    pool = make_tiered(arena_blocks=8, disk_bytes=1 << 20, block_nbytes=nb)
    for k, b in zip(keys[:6], blocks[:6], strict=True):
        assert pool.put(k, b)
    assert pool.demote(keys[:6]) == 6 * nb and pool.flush()
    for k, b in zip(keys[6:], blocks[6:], strict=True):  # 4 of 8 arena slots in use
        assert pool.put(k, b)
    asked: list[int] = []

    def make_room(nbytes: int) -> bool:  # the coordinator's plan: the arena's LRU first
        asked.append(nbytes)
        return pool.demote(pool.arena.keys()) > 0

    lease = pool.lease(keys[:6], 10.0, make_room=make_room)
    try:
        got = {loc.key: loc for loc in lease.locations}
        assert sorted(got) == sorted(keys[:6]) and asked == [2 * nb]
        for k, t in zip(keys[:6], tokens[:6], strict=True):
            verify_block(bytes(pool.leased_bytes(got[k].offset, got[k].nbytes)), ns, k, t)
    finally:
        pool.release(lease.lease_id)
    assert pool.counters.promotions == 6

    without = pool.lease(keys[6:], 10.0)  # demoted by make_room; no room offered: a miss
    assert len(without.locations) <= 2
    pool.release(without.lease_id)


def test_invalidation_deletes_from_both_tiers(make_tiered) -> None:
    ns = make_namespace()
    keys, _, blocks = make_blocks(ns, 3)
    pool = make_tiered(arena_blocks=4, disk_bytes=1 << 20, block_nbytes=len(blocks[0]))
    for k, b in zip(keys, blocks, strict=True):
        pool.put(k, b)
    pool.demote(keys[:2])
    pool.flush()
    pool.evict(keys[:1])  # invalidate / drain: really gone
    assert pool.delete(keys[1])  # admin delete: really gone
    assert pool.held(keys) == [False, False, True]
    assert not os.path.exists(pool.disk.path_of(keys[0]))
    assert not os.path.exists(pool.disk.path_of(keys[1]))


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_file_is_a_miss_with_a_reason_never_wrong_bytes(make_tiered, damage) -> None:
    ns = make_namespace()
    keys, tokens, blocks = make_blocks(ns, 3)
    pool = make_tiered(arena_blocks=4, disk_bytes=1 << 20, block_nbytes=len(blocks[0]))
    for k, b in zip(keys, blocks, strict=True):
        pool.put(k, b)
    pool.demote(keys)
    pool.flush()
    damage_file(Path(pool.disk.path_of(keys[1])), damage, Path(pool.disk.path_of(keys[2])))
    assert not read_verified(pool, ns, keys[1], tokens[1])  # a miss: never served
    assert not pool.contains(keys[1])  # the file is gone
    assert pool.counters.drops == {"corrupted": 1}
    lost, _ = pool.take_changes()
    assert lost == [keys[1]]  # the node tells the coordinator
    assert read_verified(pool, ns, keys[0], tokens[0])  # its neighbours still serve
    assert read_verified(pool, ns, keys[2], tokens[2])


@pytest.mark.parametrize("read_path", ["direct", "buffered"])
def test_a_batch_lease_promotes_around_a_damaged_file(tmp_path: Path, read_path: str) -> None:
    """One lease of many disk blocks is read pipelined: every whole file is promoted bitwise,
    the damaged one in the middle is a miss, dropped and counted, and nothing is left
    reserved."""
    ns = make_namespace()
    keys, tokens, blocks = make_blocks(ns, 8)
    nb = len(blocks[0])
    pool = TieredPool(BlockPool(10 * 8192 + 10 * nb),
                      DiskTier(str(tmp_path / "disk"), 1 << 22, read_path=read_path),
                      queue_bytes=64 << 20)
    try:
        for k, b in zip(keys, blocks, strict=True):
            pool.put(k, b)
        pool.demote(keys)
        pool.flush()
        assert pool.arena.held(keys) == [False] * 8
        path = Path(pool.disk.path_of(keys[3]))
        raw = bytearray(path.read_bytes())
        raw[-5] ^= 0x04
        path.write_bytes(raw)
        lease = pool.lease(keys, 10.0)
        try:
            assert [loc.key for loc in lease.locations] == keys[:3] + keys[4:]
            for loc in lease.locations:
                i = keys.index(loc.key)
                verify_block(bytes(pool.leased_bytes(loc.offset, loc.nbytes)), ns, loc.key,
                             tokens[i])
                assert bytes(pool.leased_bytes(loc.offset, loc.nbytes)) == blocks[i]
        finally:
            pool.release(lease.lease_id)
        assert pool.counters.promotions == 7 and pool.counters.drops == {"corrupted": 1}
        assert pool.arena.reserved_bytes() == 0
        assert pool.disk.read_path == read_path
    finally:
        pool.close()


def test_the_disk_tier_never_exceeds_its_capacity_and_drops_lru_first(make_tiered) -> None:
    ns = make_namespace()
    keys, _, blocks = make_blocks(ns, 12)
    nb = len(blocks[0])
    per_file = -(-nb // 4096) * 4096
    pool = make_tiered(arena_blocks=12, disk_bytes=5 * per_file, block_nbytes=nb)
    for k, b in zip(keys, blocks, strict=True):
        pool.put(k, b)
    for k in keys[:8]:  # one at a time: the demotion order is the disk's recency order
        pool.demote([k])
        pool.flush()
        assert pool.disk.used_bytes <= pool.disk.capacity_bytes
    pool.disk.touch([keys[3]])  # read since: no longer the oldest
    pool.demote(keys[8:9])
    pool.flush()
    assert sorted(pool.disk.keys()) == sorted([keys[3], *keys[5:9]])
    assert pool.counters.drops["lru"] == 4
    lost, _ = pool.take_changes()
    assert sorted(lost) == sorted([keys[0], keys[1], keys[2], keys[4]])
    files = list(Path(pool.disk.directory, "blocks").rglob("*"))
    assert sum(f.stat().st_size for f in files if f.is_file()) <= 5 * per_file


def test_a_full_queue_drops_and_counts(make_tiered) -> None:
    ns = make_namespace()
    keys, _, blocks = make_blocks(ns, 4)
    nb = len(blocks[0])
    pool = make_tiered(arena_blocks=4, disk_bytes=1 << 20, block_nbytes=nb, queue_bytes=nb)
    for k, b in zip(keys, blocks, strict=True):
        pool.put(k, b)
    stalled = threading.Event()
    real_write = pool.disk.write

    def stalled_write(*args, **kwargs):  # a disk that hangs: the queue fills and stays full
        stalled.wait(30)
        return real_write(*args, **kwargs)

    pool.disk.write = stalled_write
    assert pool.demote(keys) == 4 * nb  # the arena's room is made either way
    stalled.set()  # (before asserting: the fixture's close waits for the writer)
    assert pool.counters.drops["queue_full"] == 3  # the queue holds one block's bytes
    assert len(pool.take_changes()[0]) == 3
    assert pool.flush() and len(pool.disk) == 1


def test_restart_recovers_whole_files_and_discards_the_rest(tmp_path: Path) -> None:
    ns = make_namespace()
    keys, tokens, blocks = make_blocks(ns, 5)
    nb = len(blocks[0])
    directory = tmp_path / "disk"
    pool = TieredPool(BlockPool(8 * nb), DiskTier(str(directory), 1 << 20), queue_bytes=1 << 20)
    for k, b in zip(keys, blocks, strict=True):
        pool.put(k, b)
    pool.demote(keys)
    pool.close()  # kvstore stop: the disk tier stays
    # what a crash leaves: a half-written temp file, a torn block, a stray file
    Path(directory, "tmp", "junk.tmp").write_bytes(b"x" * 100)
    torn = directory / "blocks" / keys[4].hex()[:2] / keys[4].hex()
    torn.write_bytes(torn.read_bytes()[:1000])
    Path(directory, "blocks", "zz").mkdir()
    Path(directory, "blocks", "zz", "not-a-key").write_bytes(b"hello")
    disk = DiskTier(str(directory), 1 << 20)
    assert sorted(disk.keys()) == sorted(keys[:4])
    assert disk.counters.recovered == 4 and disk.counters.discarded == 2
    assert os.listdir(directory / "tmp") == []
    pool = TieredPool(BlockPool(8 * nb), disk, queue_bytes=1 << 20)
    try:
        for k, t in zip(keys[:4], tokens[:4], strict=True):
            assert read_verified(pool, ns, k, t)
        entry = disk.entry(keys[2])
        assert entry is not None and entry.parent_key == keys[1] and entry.namespace_root == ns.root
    finally:
        pool.close(purge=True)
    assert not directory.exists()  # kvstore stop --purge


def test_another_data_key_empties_the_directory(tmp_path: Path) -> None:
    ns = make_namespace()
    keys, _, blocks = make_blocks(ns, 2)
    disk = DiskTier(str(tmp_path / "d"), 1 << 20, data_key=b"a" * 32)
    disk.write(keys[0], blocks[0], ns.root, ns.root)
    disk.close()
    for data_key, expected in ((b"a" * 32, 1), (b"b" * 32, 0), (b"a" * 32, 0)):
        disk = DiskTier(str(tmp_path / "d"), 1 << 20, data_key=data_key)
        assert len(disk) == expected
        disk.close()


def test_one_directory_one_node(tmp_path: Path) -> None:
    disk = DiskTier(str(tmp_path / "d"), 1 << 20)
    with pytest.raises(DiskTierInUse):
        DiskTier(str(tmp_path / "d"), 1 << 20)
    disk.close()
    DiskTier(str(tmp_path / "d"), 1 << 20).close()


_WRITER = """
import sys, torch
sys.path.insert(0, {root!r})
from tests.node.test_tiered_pool import make_namespace, make_blocks
from kvstore.node.disk_tier import DiskTier
ns = make_namespace(num_layers=8, head_dim=128)
keys, _, blocks = make_blocks(ns, 64)
disk = DiskTier({directory!r}, 1 << 30)
print("ready", flush=True)
while True:
    for k, b in zip(keys, blocks):
        disk.delete(k)
        disk.write(k, b, ns.root, ns.root)
"""


@pytest.mark.parametrize("delay_s", [0.05, 0.2, 0.4])
def test_sigkill_mid_write_exposes_no_torn_block(tmp_path: Path, delay_s: float) -> None:
    directory = tmp_path / "disk"
    root = str(Path(__file__).resolve().parents[2])
    proc = subprocess.Popen([sys.executable, "-c", _WRITER.format(root=root,
                                                                  directory=str(directory))],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        import time

        time.sleep(delay_s)
    finally:
        proc.kill()
        proc.wait()
    ns = make_namespace(num_layers=8, head_dim=128)
    keys, tokens, blocks = make_blocks(ns, 64)
    disk = DiskTier(str(directory), 1 << 30)
    by_key = dict(zip(keys, blocks, strict=True))
    for key in disk.keys():  # every block the restart exposes is whole and verifies
        entry = disk.entry(key)
        assert entry is not None
        buf = bytearray(entry.nbytes)
        disk.read_into(key, memoryview(buf))
        assert bytes(buf) == by_key[key]
    disk.close()


def test_reads_of_absent_keys_are_not_found(make_tiered) -> None:
    pool = make_tiered(arena_blocks=2, disk_bytes=1 << 20)
    with pytest.raises(BlockNotFound), pool.read(b"\1" * 32):
        pass
    assert pool.lease([b"\1" * 32], 1.0).locations == []


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs: a disk that fills long before the tier's capacity."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs",
                                            str(mnt)], capture_output=True).returncode:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_tiny_filesystem_fills_up_cleanly(make_tiered, tiny_fs: Path) -> None:
    ns = make_namespace()
    keys, tokens, blocks = make_blocks(ns, 40)
    nb = len(blocks[0])
    # the tier believes it has 10 MiB; the filesystem has 256 KiB
    pool = make_tiered(arena_blocks=40, disk_bytes=10 << 20, directory=tiny_fs / "disk",
                       block_nbytes=nb)
    for k, b in zip(keys, blocks, strict=True):
        pool.put(k, b)
    assert pool.demote(keys) == 40 * nb  # never fails: the arena's room is made
    assert pool.flush()
    held = pool.disk.keys()
    assert 0 < len(held) < 40
    assert pool.counters.drops.get("no_space", 0) + pool.counters.drops.get("lru", 0) \
        == 40 - len(held)
    for k, t in zip(keys, tokens, strict=True):  # what it holds reads back verified
        if k in held:
            assert read_verified(pool, ns, k, t)
    # and it keeps working: new blocks take the oldest one's room
    more_keys, _, more = make_blocks(ns, 3, seed=7)
    for k, b in zip(more_keys, more, strict=True):
        pool.put(k, b)
    pool.demote(more_keys)
    pool.flush()
    assert all(pool.disk.held(more_keys))
