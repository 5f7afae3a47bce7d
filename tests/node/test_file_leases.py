"""Same-node reads of disk-tier blocks from their files: ``TieredPool.lease(files=True)`` (a
cold disk block leased as its file, a hot one promoted) and ``kvstore.client.file_reads`` (read
into the reader's buffer and verified; anything it cannot read or verify is handed back to be
asked for again, never a wrong byte)."""

from __future__ import annotations

import pickle
import threading
from pathlib import Path

import numpy as np
import pytest

from kvstore.block import verify_block
from kvstore.client.file_reads import read_files_into
from kvstore.node.pool_contract import BlockLocation
from tests.node.test_tiered_pool import make_blocks, make_namespace, make_tiered  # noqa: F401


def demoted_pool(make_tiered, num_blocks: int = 6, on_disk: int = 4):  # noqa: ANN001, ANN201, F811
    ns = make_namespace()
    keys, tokens, blocks = make_blocks(ns, num_blocks)
    pool = make_tiered(arena_blocks=num_blocks + 2, disk_bytes=1 << 20,
                       block_nbytes=len(blocks[0]))
    for k, b in zip(keys, blocks, strict=True):
        assert pool.put(k, b)
    pool.demote(keys[:on_disk])
    assert pool.flush()
    return pool, ns, keys, tokens, blocks


def test_a_cold_disk_block_is_leased_as_its_file_and_a_hot_one_promoted(make_tiered) -> None:  # noqa: F811
    pool, _, keys, _, blocks = demoted_pool(make_tiered)
    lease = pool.lease(keys, 10.0, files=True)
    where = {loc.key: loc for loc in lease.locations}
    assert set(where) == set(keys)
    for k, b in zip(keys[:4], blocks[:4], strict=True):  # cold, on disk: the file itself
        loc = where[k]
        assert loc.path == pool.disk.path_of(k) and loc.offset == 0 and loc.nbytes == len(b)
        assert Path(loc.path).read_bytes() == b
    for k, b in zip(keys[4:], blocks[4:], strict=True):  # in the arena: as ever
        assert not where[k].path
        assert bytes(pool.leased_bytes(where[k].offset, where[k].nbytes)) == b
    # A lease crosses processes pickled (vLLM's plans): every field of each kind survives.
    assert pickle.loads(pickle.dumps(lease.locations)) == lease.locations
    pool.release(lease.lease_id)
    assert pool.counters.promotions == 0 and pool.counters.disk_hits == 4
    assert pool.arena.held(keys[:4]) == [False] * 4  # a cold read leaves the arena alone
    # Read again while remembered: hot, promoted into the arena and leased there.
    again = pool.lease(keys[:2], 10.0, files=True)
    assert [bool(loc.path) for loc in again.locations] == [False, False]
    assert pool.counters.promotions == 2 and pool.arena.held(keys[:2]) == [True, True]
    pool.release(again.lease_id)
    # Without files (a remote reader's bulk channel, a device read) nothing comes as a file.
    plain = pool.lease(keys[2:4], 10.0)
    assert not any(loc.path for loc in plain.locations)
    pool.release(plain.lease_id)


def test_a_block_still_queued_for_the_disk_is_promoted_not_leased_as_a_file(
        make_tiered, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: F811
    pool, _, keys, _, blocks = demoted_pool(make_tiered, on_disk=0)
    gate = threading.Event()
    write = pool.disk.write

    def held_back(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        gate.wait(30)
        return write(*args, **kwargs)

    monkeypatch.setattr(pool.disk, "write", held_back)
    pool.demote(keys[:1])
    try:
        lease = pool.lease(keys[:1], 10.0, files=True)
        assert [loc.path for loc in lease.locations] == [""]
        loc = lease.locations[0]
        assert bytes(pool.leased_bytes(loc.offset, loc.nbytes)) == blocks[0]
        pool.release(lease.lease_id)
    finally:
        gate.set()
    assert pool.flush()


def read(files: dict[bytes, BlockLocation], keys: list[bytes], tokens, ns, nbytes: int
         ) -> tuple[list, list[int], list[np.ndarray]]:  # noqa: ANN001
    buffers = [np.zeros(nbytes, np.uint8) for _ in keys]
    out: list = [None] * len(keys)
    again = read_files_into(files, keys, buffers, ns, tokens, out)
    return out, again, buffers


def test_file_reads_land_verified_and_hand_back_what_they_cannot_serve(
        make_tiered, tmp_path: Path) -> None:  # noqa: F811
    pool, ns, keys, tokens, blocks = demoted_pool(make_tiered)
    nb = len(blocks[0])
    files = {k: BlockLocation(k, 0, nb, pool.disk.path_of(k)) for k in keys[:4]}
    out, again, buffers = read(files, keys, tokens, ns, nb)
    assert again == [] and out == [nb] * 4 + [None, None]  # the arena blocks are not its own
    for buf, b, k, t in zip(buffers[:4], blocks[:4], keys[:4], tokens[:4], strict=True):
        assert buf.tobytes() == b
        verify_block(buf, ns, k, t)
    # Gone, truncated, a flipped bit, another block's bytes, the wrong tokens: handed back.
    Path(files[keys[0]].path).unlink()
    truncated = Path(files[keys[1]].path)
    truncated.write_bytes(truncated.read_bytes()[:4096])
    flipped = Path(files[keys[2]].path)
    raw = bytearray(flipped.read_bytes())
    raw[-3] ^= 1
    flipped.write_bytes(raw)
    swapped = tmp_path / "swapped"
    swapped.write_bytes(blocks[4])
    files[keys[3]] = BlockLocation(keys[3], 0, nb, str(swapped))
    out, again, _ = read(files, keys, tokens, ns, nb)
    assert again == [0, 1, 2, 3] and out == [None] * 6
    good = {keys[5]: BlockLocation(keys[5], 0, nb, str(tmp_path / "good"))}
    Path(good[keys[5]].path).write_bytes(blocks[5])
    wrong_tokens = [list(t) for t in tokens]
    wrong_tokens[5][0] += 1
    out, again, _ = read(good, keys, wrong_tokens, ns, nb)
    assert again == [5] and out[5] is None


def test_a_buffer_too_small_for_the_file_is_a_clear_error(make_tiered) -> None:  # noqa: F811
    pool, ns, keys, tokens, blocks = demoted_pool(make_tiered)
    nb = len(blocks[0])
    files = {keys[0]: BlockLocation(keys[0], 0, nb, pool.disk.path_of(keys[0]))}
    with pytest.raises(ValueError, match="too small"):
        read_files_into(files, keys[:1], [np.zeros(nb - 1, np.uint8)], ns, tokens[:1], [None])
