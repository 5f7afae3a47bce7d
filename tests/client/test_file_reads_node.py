"""A same-node reader against a real store node with a disk tier: cold disk blocks come as
their files and are read straight into the reader's buffers, verified (no promotion); a block
read again is hot and promoted; a damaged file is a miss (the node, asked again without files,
drops it) and never wrong bytes; a remote reader's blocks are promoted as ever."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.block import read_header
from kvstore.client.node_client import StoreNodeClient
from kvstore.config import ClientConfig, ServerConfig
from kvstore.node.block_pool import BlockPool
from kvstore.node.disk_tier import DiskTier
from kvstore.node.store_server import StoreServer
from kvstore.node.tiered_pool import TieredPool
from tests.node.test_tiered_pool import make_blocks, make_namespace
from tests.support.damage import DAMAGES, damage_file

FAST = ClientConfig(timeout_s=5, retries=1)
NUM = 6


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[StoreServer, TieredPool, list, list, list, object]]:
    ns = make_namespace()
    keys, tokens, blocks = make_blocks(ns, NUM)
    pool = TieredPool(BlockPool(16 << 20), DiskTier(str(tmp_path / "disk"), 16 << 20),
                      queue_bytes=16 << 20)
    for k, b in zip(keys, blocks, strict=True):
        assert pool.put(k, b)
    pool.demote(keys)
    assert pool.flush()
    server = StoreServer(pool, "n1", ServerConfig())
    for k, b in zip(keys, blocks, strict=True):  # as the store node does for its disk tier
        header = read_header(memoryview(b))
        server.remember(k, header.parent_key, header.namespace_root)
    server.start()
    yield server, pool, keys, tokens, blocks, ns
    server.stop(0)
    pool.close()


def same_node(server: StoreServer, pool: TieredPool) -> StoreNodeClient:
    return StoreNodeClient(server.addresses[0], shm_path=pool.path, same_node=True, config=FAST)


def read(client: StoreNodeClient, ns, keys: list, tokens: list, nbytes: int  # noqa: ANN001
         ) -> tuple[list, list[bytearray]]:
    buffers = [bytearray(nbytes) for _ in keys]
    return client.get_verified_into(ns, keys, tokens, buffers), buffers


def test_cold_disk_blocks_are_read_from_their_files_then_promoted_when_hot(node) -> None:
    server, pool, keys, tokens, blocks, ns = node
    nb = len(blocks[0])
    client = same_node(server, pool)
    try:
        verdicts, buffers = read(client, ns, keys, tokens, nb)
        assert verdicts == [nb] * NUM and [bytes(b) for b in buffers] == blocks
        assert pool.counters.promotions == 0 and pool.counters.disk_hits == NUM
        assert pool.arena.held(keys) == [False] * NUM
        verdicts, buffers = read(client, ns, keys, tokens, nb)  # read again: hot
        assert verdicts == [nb] * NUM and [bytes(b) for b in buffers] == blocks
        assert pool.counters.promotions == NUM and pool.arena.held(keys) == [True] * NUM
    finally:
        client.close()


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_damaged_file_is_a_miss_and_dropped_never_wrong_bytes(node, damage: str) -> None:
    server, pool, keys, tokens, blocks, ns = node
    nb = len(blocks[0])
    path = Path(pool.disk.path_of(keys[2]))
    damage_file(path, damage, Path(pool.disk.path_of(keys[3])))
    client = same_node(server, pool)
    try:
        verdicts, buffers = read(client, ns, keys, tokens, nb)
    finally:
        client.close()
    assert verdicts[2] is None  # asked again without files: the node dropped it, a miss
    assert [bytes(b) for i, b in enumerate(buffers) if i != 2] == blocks[:2] + blocks[3:]
    assert verdicts[:2] + verdicts[3:] == [nb] * (NUM - 1)
    assert not path.exists() and pool.counters.drops == {"corrupted": 1}


def test_a_remote_reader_gets_promoted_blocks(node) -> None:
    server, pool, keys, tokens, blocks, ns = node
    grpc_addr, bulk_addr = server.addresses
    client = StoreNodeClient(grpc_addr, bulk_address=bulk_addr, config=FAST)
    try:
        verdicts, buffers = read(client, ns, keys, tokens, len(blocks[0]))
    finally:
        client.close()
    assert [bytes(b) for b in buffers] == blocks and pool.counters.promotions == NUM
