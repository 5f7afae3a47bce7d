"""ClusterStore's write and lookup paths at rate: batched Puts stay visible under concurrency,
and a stale lookup promise becomes a Miss, never another block's bytes."""

# ruff: noqa: F811  (the cluster fixture is imported, then named as a test argument)
from __future__ import annotations

import threading
import time

import torch

from kvstore import reader_metrics
from kvstore.api import MISS_NOT_FOUND, FetchedBlock, Miss, NodeAddress
from kvstore.client.cluster_store import ClusterStore
from kvstore.config import ClientConfig, ServerConfig
from kvstore.index.base import IndexEntry
from kvstore.index.memory import InMemoryIndex
from kvstore.node.block_pool import BlockPool
from kvstore.node.store_server import StoreServer
from tests.client.test_cluster_store import cluster, make_puts  # noqa: F401  - fixture by name
from tests.node.test_store_server import make_namespace

LONG_VIEW = ClientConfig(timeout_s=5, retries=1, index_view_ttl_s=30.0)


def test_stale_promise_after_eviction_is_a_miss_never_other_bytes(cluster) -> None:
    index, nodes, directory = cluster
    ns = make_namespace()
    writer = ClusterStore("node-a", index, directory.__getitem__, LONG_VIEW)
    reader = ClusterStore("node-b", index, directory.__getitem__, LONG_VIEW)
    puts, tokens = make_puts(ns, 4, seed=1)
    keys = [p.key for p in puts]
    writer.batch_put(ns, puts)
    assert reader.lookup_prefix(ns, keys).num_blocks == 4  # the reader's view now holds them
    # Node a evicts blocks 2 and 3 and tells the index; their arena space goes to new blocks.
    server_a, pool_a = nodes["node-a"]
    assert pool_a.evict(keys[2:]) > 0
    index.remove(keys[2:], "node-a")
    others, _ = make_puts(ns, 4, seed=2)
    writer.batch_put(ns, others)
    # Within the staleness bound the view still promises all four blocks ...
    hit = reader.lookup_prefix(ns, keys)
    assert hit.num_blocks == 4 and index.lookup_prefix(keys).num_blocks == 2
    got = reader.batch_get(ns, keys, tokens)
    # ... but the evicted ones come back as misses, and the rest are the bytes written.
    for g, p in zip(got[:2], puts[:2], strict=True):
        assert isinstance(g, FetchedBlock)
        assert torch.equal(g.payload.view(torch.int16), p.payload.view(torch.int16))
    assert all(isinstance(g, Miss) and g.reason == MISS_NOT_FOUND for g in got[2:])
    # The miss dropped the stale promise: the next lookup asks the index.
    assert reader.lookup_prefix(ns, keys).num_blocks == 2
    writer.close()
    reader.close()


def test_stale_promise_retries_through_the_index_and_finds_the_new_holder(cluster) -> None:
    index, nodes, directory = cluster
    ns = make_namespace()
    writer = ClusterStore("node-a", index, directory.__getitem__, LONG_VIEW)
    other = ClusterStore("node-b", index, directory.__getitem__, LONG_VIEW)
    puts, tokens = make_puts(ns, 3, seed=3)
    keys = [p.key for p in puts]
    writer.batch_put(ns, puts)  # the writer's view: held by node-a
    other.batch_put(ns, puts)  # a second copy on node-b
    nodes["node-a"][1].evict(keys)  # node-a lets go; the writer's view does not know
    index.remove(keys, "node-a")
    got = writer.batch_get(ns, keys, tokens)
    assert [g.node_id for g in got if isinstance(g, FetchedBlock)] == ["node-b"] * 3
    for g, p in zip(got, puts, strict=True):
        assert isinstance(g, FetchedBlock)
        assert torch.equal(g.payload.view(torch.int16), p.payload.view(torch.int16))
    writer.close()
    other.close()


def test_put_keys_are_visible_to_other_readers_under_concurrent_puts() -> None:
    index = InMemoryIndex()

    def slow_publish(entries: list[IndexEntry]) -> None:
        time.sleep(0.005)  # an index call's latency: Puts pile up behind it and coalesce
        index.publish(entries)

    pool = BlockPool(32 << 20)
    server = StoreServer(pool, "node-a", ServerConfig(), on_publish=slow_publish)
    server.start()
    grpc_addr, bulk_addr = server.addresses
    directory = {"node-a": NodeAddress("node-a", grpc_addr, bulk_addr, pool.path)}
    ns = make_namespace(num_layers=1, head_dim=4)
    failures: list[str] = []

    def client(seed: int) -> None:
        writer = ClusterStore("node-a", index, directory.__getitem__, LONG_VIEW)
        observer = ClusterStore("node-b", index, directory.__getitem__, LONG_VIEW)
        for round_ in range(5):
            puts, _ = make_puts(ns, 12, seed=100 * seed + round_)
            keys = [p.key for p in puts]
            observer.lookup_prefix(ns, keys)  # a miss first: it must not be remembered
            writer.batch_put(ns, puts)
            hit = observer.lookup_prefix(ns, keys)
            if hit.num_blocks != len(keys) or index.lookup_prefix(keys).num_blocks != len(keys):
                failures.append(f"client {seed} round {round_}: {hit.num_blocks}/{len(keys)}")
        writer.close()
        observer.close()

    try:
        threads = [threading.Thread(target=client, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not failures
        assert server.publisher is not None
        assert server.publisher.num_entries == 4 * 5 * 12 == len(pool.keys())
    finally:
        server.stop(0)
        pool.close()


class CountingIndex:
    """An index that records the keys of every ``lookup_prefix`` asked of it."""

    def __init__(self, index: InMemoryIndex) -> None:
        self.index, self.asked = index, []

    def __getattr__(self, name: str) -> object:
        return getattr(self.index, name)

    def lookup_prefix(self, keys):  # noqa: ANN001, ANN201 - the Index signature
        self.asked.append(list(keys))
        return self.index.lookup_prefix(keys)


def split_over_two_nodes(cluster, seed: int):  # noqa: ANN001, ANN201
    """Four blocks: the first two put on node-a, the others on node-b."""
    index, _, directory = cluster
    ns = make_namespace()
    puts, _ = make_puts(ns, 4, seed=seed)
    ClusterStore("node-a", index, directory.__getitem__, LONG_VIEW).batch_put(ns, puts[:2])
    ClusterStore("node-b", index, directory.__getitem__, LONG_VIEW).batch_put(ns, puts[2:])
    return ns, [p.key for p in puts]


def test_a_lookup_asks_this_hosts_node_first_and_the_index_for_the_rest(cluster) -> None:
    """The reader's own store node answers for the leading blocks it holds (over its bulk
    channel); the index is asked only for the blocks after them, or not at all. A view that
    remembers nothing gets the same answer; a host whose node is gone asks the index."""
    index, nodes, directory = cluster
    ns, keys = split_over_two_nodes(cluster, seed=5)
    counted = CountingIndex(index)
    for config in (LONG_VIEW, ClientConfig(timeout_s=5, retries=1, index_view_ttl_s=0.0)):
        reader = ClusterStore("node-a", counted, directory.__getitem__, config)
        counted.asked.clear()
        hit = reader.lookup_prefix(ns, keys)
        assert hit.num_blocks == 4
        assert hit.holders == [["node-a"], ["node-a"], ["node-b"], ["node-b"]]
        assert counted.asked == [keys[2:]]  # node-a answered for its two
        counted.asked.clear()
        assert reader.lookup_prefix(ns, keys[:2]).holders == [["node-a"]] * 2
        assert counted.asked == []
        reader.close()
    nodes["node-a"][0].stop(0)  # this host's node is gone: the index answers, at once
    reader = ClusterStore("node-a", counted, directory.__getitem__, LONG_VIEW)
    counted.asked.clear()
    assert reader.lookup_prefix(ns, keys).num_blocks == 4
    assert counted.asked == [keys]
    reader.close()


def test_a_sole_node_answers_the_whole_lookup_and_a_second_node_brings_the_index_back(
        cluster) -> None:
    """With this host's node the directory's only one, the index can name no other holder:
    a lookup asks the node alone. Once the directory lists another node (at the next refresh)
    the index is asked for what the node lacks, and finds the other node's blocks."""
    index, nodes, directory = cluster
    ns, keys = split_over_two_nodes(cluster, seed=6)
    listed = {"node-a": directory["node-a"]}
    counted = CountingIndex(index)
    for config in (LONG_VIEW, ClientConfig(timeout_s=5, retries=1, index_view_ttl_s=0.0)):
        listed.pop("node-b", None)
        reader = ClusterStore("node-a", counted, lambda: dict(listed), config)
        reader.sole.refresh(if_older=False)
        assert reader.sole.alone()
        counted.asked.clear()
        hit = reader.lookup_prefix(ns, keys)
        assert (hit.num_blocks, hit.holders, counted.asked) == (2, [["node-a"]] * 2, [])
        listed["node-b"] = directory["node-b"]
        reader.sole.refresh(if_older=False)
        assert not reader.sole.alone()
        hit = reader.lookup_prefix(ns, keys)
        assert hit.num_blocks == 4 and counted.asked == [keys[2:]]
        reader.close()


def test_the_directory_is_asked_only_on_the_callers_thread(cluster) -> None:
    """Whether this node is alone is asked on a lookup's own thread, never by the metrics
    thread: a Ray call from a thread that outlives ``ray.shutdown()`` starts a Ray of its own."""
    index, _, directory = cluster
    threads: list[str] = []

    def listing() -> dict:
        threads.append(threading.current_thread().name)
        return {"node-a": directory["node-a"]}

    store = ClusterStore("node-a", index, listing, LONG_VIEW)
    time.sleep(2.5 * reader_metrics.FLUSH_INTERVAL_S)  # the metrics thread's turns come
    assert threads == []
    store.lookup_prefix(make_namespace(), [bytes(32)])
    assert threads and set(threads) == {threading.current_thread().name}
    store.close()
