"""ShmReader: another process's pool arena, copied and verified from this process."""

from __future__ import annotations

import multiprocessing as mp
import os

import numpy as np
import pytest
import torch

from kvstore.block import block_nbytes, encode_block
from kvstore.client.shm_reader import ShmReader
from kvstore.errors import BlockCorrupted, BlockMismatch
from kvstore.keys import BlockHasher, Namespace
from kvstore.node.block_pool import BlockLocation, BlockPool

NUM_BLOCKS = 4


def make_namespace(dtype: str = "float16") -> Namespace:
    return Namespace("test-model", dtype, block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)


def make_blocks(namespace: Namespace, seed: int = 0) -> list[tuple[bytes, list[int], bytearray]]:
    """(key, tokens, encoded block) for a short chain, deterministic in ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 1000, (NUM_BLOCKS * namespace.block_size,), generator=gen).tolist()
    keys = BlockHasher(namespace).block_keys(tokens)
    out = []
    parent = namespace.root
    for i, key in enumerate(keys):
        toks = tokens[i * namespace.block_size : (i + 1) * namespace.block_size]
        payload = torch.randn(namespace.payload_shape, generator=gen).to(namespace.torch_dtype)
        out.append((bytes(key), toks, encode_block(namespace, key, parent, toks, payload)))
        parent = key
    return out


def _own_pool(conn, dtype: str) -> None:
    """Child process: publish blocks, lease them, hand the locations over, wait, clean up."""
    namespace = make_namespace(dtype)
    pool = BlockPool(1 << 20)
    try:
        blocks = make_blocks(namespace)
        for key, _, raw in blocks:
            pool.put(key, raw)
        lease = pool.lease([key for key, _, _ in blocks], ttl_s=60)
        conn.send((pool.path, [(loc.key, loc.offset, loc.nbytes) for loc in lease.locations]))
        conn.recv()  # the reader is done
        pool.release(lease.lease_id)
    finally:
        pool.close()
    conn.send("closed")


@pytest.fixture(scope="module")
def remote_pool():
    """A pool owned by a spawned process; yields (path, locations)."""
    ctx = mp.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_own_pool, args=(child_conn, "float16"), daemon=True)
    proc.start()
    assert parent_conn.poll(60), "pool process did not start"
    path, locs = parent_conn.recv()
    yield path, [BlockLocation(k, o, n) for k, o, n in locs]
    parent_conn.send("done")
    assert parent_conn.poll(30) and parent_conn.recv() == "closed"
    proc.join(30)
    assert proc.exitcode == 0
    assert not os.path.exists(path), "the owner's close must unlink the arena"


def test_cross_process_copy_equals_the_bytes(remote_pool) -> None:
    path, locations = remote_pool
    namespace = make_namespace()
    expected = make_blocks(namespace)
    assert [loc.key for loc in locations] == [key for key, _, _ in expected]
    with ShmReader(path) as reader:
        for loc, (key, tokens, raw) in zip(locations, expected, strict=True):
            assert reader.read(loc) == raw
            dst = torch.empty(block_nbytes(namespace), dtype=torch.uint8)
            assert reader.copy_into(loc, dst) == len(raw)
            assert dst.numpy().tobytes() == bytes(raw)
            out = bytearray(len(raw) + 10)
            header = reader.copy_verified_into(loc, out, namespace, tokens)
            assert header.key == key and bytes(out[: len(raw)]) == raw


def test_copy_verified_rejects_wrong_tokens_and_key(remote_pool) -> None:
    path, locations = remote_pool
    namespace = make_namespace()
    with ShmReader(path) as reader:
        dst = np.empty(block_nbytes(namespace), dtype=np.uint8)
        with pytest.raises(BlockMismatch, match="other tokens"):
            reader.copy_verified_into(locations[0], dst, namespace, [0, 0, 0, 0])
        wrong = BlockLocation(locations[1].key, locations[0].offset, locations[0].nbytes)
        with pytest.raises(BlockMismatch, match="key"):
            reader.copy_verified_into(wrong, dst, namespace)


def test_copy_verified_detects_corruption_in_the_copy() -> None:
    namespace = make_namespace("bfloat16")
    key, tokens, raw = make_blocks(namespace, seed=3)[0]
    raw[-1] ^= 0xFF  # flip payload bits after the checksum was written
    with BlockPool(1 << 16) as pool:
        pool.put(key, raw)
        lease = pool.lease([key], ttl_s=10)
        with ShmReader(pool.path) as reader:
            dst = torch.empty(len(raw), dtype=torch.uint8)
            with pytest.raises(BlockCorrupted, match="checksum"):
                reader.copy_verified_into(lease.locations[0], dst, namespace, tokens)
            # a bf16 destination works too (viewed as bytes, no copy)
            half = torch.empty(len(raw) // 2, dtype=torch.bfloat16)
            assert reader.copy_into(lease.locations[0], half) == len(raw)
            assert half.view(torch.uint8).numpy().tobytes() == bytes(raw)
        pool.release(lease.lease_id)


def test_bad_locations_and_buffers_are_clear_errors(tmp_path) -> None:
    with BlockPool(4096) as pool:
        pool.put(b"k" * 32, b"x" * 100)
        with ShmReader(pool.path) as reader:
            with pytest.raises(ValueError, match="outside"):
                reader.copy_into(BlockLocation(b"k" * 32, 4000, 200), bytearray(200))
            loc = pool.lease([b"k" * 32], ttl_s=10).locations[0]
            with pytest.raises(ValueError, match="too small"):
                reader.copy_into(loc, bytearray(10))
            with pytest.raises(ValueError, match="writable"):
                reader.copy_into(loc, memoryview(bytes(200)))
    with pytest.raises(FileNotFoundError, match="store node"):
        ShmReader(str(tmp_path / "missing"))


def test_gather_copies_a_batch_and_refuses_what_copy_into_refuses(remote_pool) -> None:
    """``gather_into`` against ``copy_into`` one block at a time, and its refusals."""
    path, locs = remote_pool
    reader = ShmReader(path)
    try:
        size = locs[0].nbytes
        same = [loc for loc in locs if loc.nbytes == size]
        out = np.zeros((len(same), size), dtype=np.uint8)
        reader.gather_into(same, out)
        for row, loc in zip(out, same, strict=True):
            one = bytearray(size)
            reader.copy_into(loc, one)
            assert row.tobytes() == bytes(one)
        with pytest.raises(ValueError, match="lies outside"):
            reader.gather_into([BlockLocation(b"", reader.size - 8, size)], out[:1])
        with pytest.raises(ValueError, match="uint8"):
            reader.gather_into(same, out[:1])
    finally:
        reader.close()
