"""ClusterStore over two real store nodes and an in-memory index."""

from __future__ import annotations

import time

import pytest
import torch

from kvstore.api import (
    MISS_CORRUPTED,
    MISS_MISMATCH,
    MISS_NODE_UNAVAILABLE,
    MISS_NOT_FOUND,
    BlockPut,
    FetchedBlock,
    Miss,
    NodeAddress,
)
from kvstore.block import block_nbytes, payload_view
from kvstore.client.cluster_store import ClusterStore
from kvstore.config import ClientConfig, ServerConfig
from kvstore.index.memory import InMemoryIndex
from kvstore.node.block_pool import BlockPool
from kvstore.node.store_server import StoreServer
from tests.node.test_store_server import make_blocks, make_namespace
from tests.support.arena import corrupt_in_arena

FAST = ClientConfig(timeout_s=5, retries=1)


@pytest.fixture
def cluster():
    index = InMemoryIndex()
    nodes: dict[str, tuple[StoreServer, BlockPool]] = {}
    directory: dict[str, NodeAddress] = {}
    for node_id in ("node-a", "node-b"):
        pool = BlockPool(8 << 20)
        srv = StoreServer(pool, node_id, ServerConfig(), on_publish=index.publish)
        srv.start()
        grpc_addr, bulk_addr = srv.addresses
        nodes[node_id] = (srv, pool)
        directory[node_id] = NodeAddress(node_id, grpc_addr, bulk_addr, pool.path)
    yield index, nodes, directory
    for srv, pool in nodes.values():
        srv.stop(0)
        pool.close()


def make_puts(ns, num_blocks: int, seed: int = 0) -> tuple[list[BlockPut], list[list[int]]]:
    keys, tokens, blocks = make_blocks(ns, num_blocks, seed)
    parents = [ns.root, *keys[:-1]]
    puts = [BlockPut(k, p, t, payload_view(b, ns).clone())
            for k, p, t, b in zip(keys, parents, tokens, blocks, strict=True)]
    return puts, tokens


@pytest.mark.parametrize("reader", ["node-a", "node-b"])  # same node (shm) and remote (bulk)
def test_put_on_one_node_get_from_either(cluster, reader: str) -> None:
    index, _, directory = cluster
    ns = make_namespace()
    writer = ClusterStore("node-a", index, directory.__getitem__, FAST)
    puts, tokens = make_puts(ns, 4)
    writer.batch_put(ns, puts)
    keys = [p.key for p in puts]
    hit = writer.lookup_prefix(ns, keys)
    assert hit.num_blocks == 4 and hit.holders == [["node-a"]] * 4
    store = ClusterStore(reader, index, lambda: directory, FAST)  # both directory styles work
    got = store.batch_get(ns, keys, tokens)
    assert all(isinstance(g, FetchedBlock) and g.node_id == "node-a" for g in got)
    for g, p in zip(got, puts, strict=True):
        assert torch.equal(g.payload.view(torch.int16), p.payload.view(torch.int16))  # bitwise
    store.close()
    writer.close()


def test_every_failure_is_a_miss_with_a_reason(cluster) -> None:
    index, nodes, directory = cluster
    ns = make_namespace()
    store = ClusterStore("node-b", index, directory.__getitem__, FAST)
    writer = ClusterStore("node-a", index, directory.__getitem__, FAST)
    puts, tokens = make_puts(ns, 3)
    writer.batch_put(ns, puts)
    keys = [p.key for p in puts]
    # Corrupt block 0 inside node-a's arena (flip the last payload byte).
    corrupt_in_arena(nodes["node-a"][1], keys[0])
    wrong_tokens = [tokens[0], [t + 1 for t in tokens[1]], tokens[2]]
    unknown = b"\5" * 32
    got = store.batch_get(ns, [*keys, unknown], [*wrong_tokens, tokens[0]])
    assert isinstance(got[0], Miss) and got[0].reason == MISS_CORRUPTED
    assert isinstance(got[1], Miss) and got[1].reason == MISS_MISMATCH
    assert isinstance(got[2], FetchedBlock)
    assert isinstance(got[3], Miss) and got[3].reason == MISS_NOT_FOUND
    # The same corruption is caught on the same-node path too.
    same = ClusterStore("node-a", index, directory.__getitem__, FAST)
    assert same.batch_get(ns, keys[:1], tokens[:1])[0].reason == MISS_CORRUPTED  # type: ignore
    # A dead node: its blocks become misses, never an exception.
    nodes["node-a"][0].stop(0)
    got = store.batch_get(ns, keys[2:], tokens[2:])
    assert isinstance(got[0], Miss) and got[0].reason == MISS_NODE_UNAVAILABLE


def test_falls_back_to_another_holder(cluster) -> None:
    index, nodes, directory = cluster
    ns = make_namespace()
    puts, tokens = make_puts(ns, 2)
    for node_id in ("node-a", "node-b"):
        ClusterStore(node_id, index, directory.__getitem__, FAST).batch_put(ns, puts)
    keys = [p.key for p in puts]
    assert index.holders(keys) == [["node-a", "node-b"]] * 2
    nodes["node-a"][0].stop(0)  # the reader's own node dies
    store = ClusterStore("node-a", index, directory.__getitem__, FAST)
    got = store.batch_get(ns, keys, tokens)
    assert [g.node_id for g in got if isinstance(g, FetchedBlock)] == ["node-b", "node-b"]


@pytest.mark.parametrize("reader", ["node-a", "node-b"])  # same node (shm) and remote (bulk)
def test_batch_get_into_reuses_the_callers_rows(cluster, reader: str) -> None:
    index, nodes, directory = cluster
    ns = make_namespace()
    puts, tokens = make_puts(ns, 3)
    ClusterStore("node-a", index, directory.__getitem__, FAST).batch_put(ns, puts)
    keys = [p.key for p in puts]
    store = ClusterStore(reader, index, directory.__getitem__, FAST)
    out = torch.full((4, block_nbytes(ns)), 0xAB, dtype=torch.uint8)  # one spare row
    for order in ([0, 1, 2], [2, 0, 1]):  # the same buffer, refilled in another order
        wrong = [[t + 1 for t in tokens[i]] if i == 1 else tokens[i] for i in order]
        got = store.batch_get_into(ns, [keys[i] for i in order], wrong, out)
        for row, (i, g) in enumerate(zip(order, got, strict=True)):
            if i == 1:  # wrong tokens: rejected on both paths, same node included
                assert isinstance(g, Miss) and g.reason == MISS_MISMATCH
                continue
            assert isinstance(g, FetchedBlock)
            assert torch.equal(g.payload.view(torch.int16), puts[i].payload.view(torch.int16))
            base, end = out[row].data_ptr(), out[row].data_ptr() + block_nbytes(ns)
            assert base <= g.payload.data_ptr() < end  # a view into the caller's row
    assert torch.all(out[3] == 0xAB)  # rows past the batch are left alone
    # The lease of a same-node read is released without the reader waiting for the reply.
    deadline = time.monotonic() + 5
    while nodes["node-a"][1].stats().num_leased and time.monotonic() < deadline:
        time.sleep(0.01)
    assert nodes["node-a"][1].stats().num_leased == 0
    store.close()


def test_batch_get_into_rejects_unusable_buffers(cluster) -> None:
    index, _, directory = cluster
    ns = make_namespace()
    store = ClusterStore("node-a", index, directory.__getitem__, FAST)
    keys, tokens = [b"\1" * 32, b"\2" * 32], [[0] * ns.block_size] * 2
    nbytes = block_nbytes(ns)
    for bad in (torch.empty((1, nbytes), dtype=torch.uint8),       # too few rows
                torch.empty((2, nbytes - 1), dtype=torch.uint8),   # rows too short
                torch.empty((2, nbytes), dtype=torch.float16),     # not bytes
                torch.empty((nbytes, 2), dtype=torch.uint8).t()):  # not contiguous
        with pytest.raises(ValueError, match="out"):
            store.batch_get_into(ns, keys, tokens, bad)
    store.close()
