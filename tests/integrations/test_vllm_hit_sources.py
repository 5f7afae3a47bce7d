"""Where the tokens a request loads from kvstore lie, for vLLM's cached-tokens-by-source
metric: the scheduler side over a real cluster of two store nodes (the reader's own, with a
disk tier, and another) splits a load into this host's memory, its disk tier and the other
node; the connector hands that split to vLLM as its ``CacheHitSource`` members."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvstore.api import NodeAddress
from kvstore.client.cluster_store import ClusterStore
from kvstore.config import ClientConfig, ServerConfig
from kvstore.index.memory import InMemoryIndex
from kvstore.integrations.vllm.scheduler_side import SchedulerSide
from kvstore.node.block_pool import BlockPool
from kvstore.node.disk_tier import DiskTier
from kvstore.node.store_server import StoreServer
from kvstore.node.tiered_pool import TieredPool
from tests.client.test_cluster_store import make_puts
from tests.node.test_store_server import make_namespace

FAST = ClientConfig(timeout_s=5, retries=1)


@pytest.fixture
def two_nodes(tmp_path: Path) -> Iterator[tuple[InMemoryIndex, dict, dict]]:
    """node-a (a disk tier under its arena) and node-b, both publishing to one index."""
    index = InMemoryIndex()
    pools = {"node-a": TieredPool(BlockPool(8 << 20), DiskTier(str(tmp_path / "disk"), 8 << 20),
                                  queue_bytes=8 << 20),
             "node-b": BlockPool(8 << 20)}
    servers, directory = [], {}
    for node_id, pool in pools.items():
        server = StoreServer(pool, node_id, ServerConfig(), on_publish=index.publish)
        server.start()
        servers.append(server)
        grpc_addr, bulk_addr = server.addresses
        directory[node_id] = NodeAddress(node_id, grpc_addr, bulk_addr, pool.path)
    yield index, pools, directory
    for server in servers:
        server.stop(0)
    for pool in pools.values():
        pool.close()


def test_a_load_is_split_into_this_hosts_memory_its_disk_and_another_node(two_nodes) -> None:
    index, pools, directory = two_nodes
    ns = make_namespace()
    puts, tokens = make_puts(ns, 6)
    for node_id, part in (("node-a", puts[:4]), ("node-b", puts[4:])):
        writer = ClusterStore(node_id, index, directory.__getitem__, FAST)
        writer.batch_put(ns, part)
        writer.close()
    pools["node-a"].demote([p.key for p in puts[2:4]])  # blocks 2 and 3: on node-a's disk
    assert pools["node-a"].flush()
    reader = ClusterStore("node-a", index, directory.__getitem__, FAST)
    side = SchedulerSide(reader, lambda salt, weights="": ns, ns.block_size)
    prompt = [t for block in tokens for t in block] + [7]
    request = SimpleNamespace(request_id="r", prompt_token_ids=prompt, cache_salt=None)
    try:
        assert side.matched_tokens(request, 0) == (6 * ns.block_size, False)
        side.allocated(request, list(range(7)), 6 * ns.block_size)
        assert side.hit_sources("r") == {"host": 2 * ns.block_size, "disk": 2 * ns.block_size,
                                         "p2p": 2 * ns.block_size}
        # vLLM's own hit covers the first two blocks: only the rest is counted. Asked for a
        # second time, node-a took its disk blocks into memory (hot): they are this host's now.
        again = SimpleNamespace(request_id="s", prompt_token_ids=prompt, cache_salt=None)
        side.matched_tokens(again, 2 * ns.block_size)
        side.allocated(again, list(range(7)), 4 * ns.block_size)
        assert side.hit_sources("s") == {"host": 2 * ns.block_size, "p2p": 2 * ns.block_size}
        assert side.hit_sources("unknown") == {}
    finally:
        side.finished("r")
        side.finished("s")
        reader.close()


def test_the_connector_hands_vllm_its_sources_and_defers_to_vllms_count() -> None:
    if os.environ.get("KVSTORE_REQUIRE_VLLM") != "1":
        pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from kvstore.integrations.vllm.connector import cache_hit_sources

    assert cache_hit_sources({"host": 32, "disk": 16, "p2p": 0}, 48) == {
        CacheHitSource.HOST: 32, CacheHitSource.DISK: 16}
    assert cache_hit_sources({"p2p": 32}, 32) == {CacheHitSource.P2P: 32}
    assert cache_hit_sources({"host": 32}, 48) == {CacheHitSource.EXTERNAL_UNSPECIFIED: 48}
    assert cache_hit_sources({}, 0) == {}
