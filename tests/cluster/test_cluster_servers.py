"""How a running cluster's servers serve and run: every kvstore endpoint serves /metrics, and a
cold + warm run moves them by exactly what it did; the servers on the data path undo Ray's
worker niceness.

A real 2-node Ray cluster, kvstore started with its default metrics settings (a free loopback
port per store node and for the coordinator, found through ``status``), the real client in the
driver, and a real HTTP scrape parsed by ``prometheus_client.parser``. The references are what
the run itself saw (its FetchedBlocks and Misses, the bytes it wrote) and what ``status`` and the
store nodes' ``stats()`` count. (One module, one cluster: a cluster's start is most of a
module's time.)
"""

# ruff: noqa: F811  (the cluster fixtures are imported, then named as test arguments)
from __future__ import annotations

import os
import urllib.request
from collections import Counter
from collections.abc import Iterator

import pytest
import ray
from prometheus_client.parser import text_string_to_metric_families

from kvstore import reader_metrics
from kvstore.api import MISS_NOT_FOUND, FetchedBlock, Miss
from kvstore.cluster import lifecycle
from kvstore.cluster.names import coordinator_handle
from kvstore.config import KVStoreConfig
from tests.support.ray_cluster import (  # noqa: F401  - fixtures are found by name
    BLOCK,
    NS,
    make_chain,
    make_config,
    ray_cluster,
    ray_nodes,
    reader,
    store_actor,
    wait_for,
)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

Samples = Counter[tuple[str, frozenset[tuple[str, str]]]]


@pytest.fixture(scope="module")
def kv(ray_nodes: list[str]) -> Iterator[KVStoreConfig]:
    config = make_config()
    assert config.server.metrics_port == 0 and config.server.metrics_host == "127.0.0.1"
    lifecycle.start(config)
    try:
        yield config
    finally:
        lifecycle.stop(config)


def scrape(address: str) -> Samples:
    """One endpoint's samples by (name, labels)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: Samples = Counter()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] += s.value
    return out


def endpoints() -> tuple[str, dict[str, str]]:
    """The coordinator's and each store node's metrics address, as `kvstore status` shows."""
    status = ray.get(coordinator_handle().status.remote())
    return status["metrics_address"], {n["node_id"]: n["metrics_address"]
                                       for n in status["nodes"] if n["alive"]}


def moved(after: Samples, before: Samples, name: str, **labels: str) -> float:
    key = (name, frozenset(labels.items()))
    return after[key] - before[key]


def total(samples: dict[str, Samples]) -> Samples:
    out: Samples = Counter()
    for s in samples.values():
        out.update(s)
    return out


def test_every_endpoint_serves_on_loopback(kv: KVStoreConfig, ray_nodes: list[str]) -> None:
    coord, nodes = endpoints()
    assert set(nodes) == set(ray_nodes)
    for address in [coord, *nodes.values()]:
        assert address is not None and address.startswith("127.0.0.1:")
        assert scrape(address)  # answers, with samples
    assert len({coord, *nodes.values()}) == 1 + len(nodes)  # one port each


def test_a_cold_then_warm_run_moves_the_counters_by_what_it_did(
        kv: KVStoreConfig, ray_nodes: list[str]) -> None:
    a, b = ray_nodes
    coord, nodes = endpoints()
    ray.get([store_actor(n).heartbeat_now.remote() for n in ray_nodes])
    reader_metrics.take_pending()  # earlier tests' unpushed tallies: not this test's
    before = {n: scrape(addr) for n, addr in nodes.items()}
    status0 = ray.get(coordinator_handle().status.remote())["totals"]
    writer, local, remote = reader(kv, a), reader(kv, a), reader(kv, b)
    chain = make_chain(8)
    cold = remote.batch_get(NS, chain.keys, chain.tokens)  # nothing cached yet
    writer.batch_put(NS, chain.puts())
    warm = [*local.batch_get(NS, chain.keys, chain.tokens),  # same node: shm
            *remote.batch_get(NS, chain.keys, chain.tokens)]  # other node: bulk
    for store in (writer, local, remote):
        store.close()  # pushes the readers' tallies
    ray.get([store_actor(n).heartbeat_now.remote() for n in ray_nodes])
    hits = sum(isinstance(r, FetchedBlock) for r in cold + warm)
    misses = Counter(r.reason for r in cold + warm if isinstance(r, Miss))
    assert hits == 16 and misses == {MISS_NOT_FOUND: 8}

    after = {n: scrape(addr) for n, addr in nodes.items()}
    status1 = ray.get(coordinator_handle().status.remote())["totals"]
    t0, t1 = total(before), total(after)
    assert moved(t1, t0, "kvstore_hits_total") == hits
    assert moved(t1, t0, "kvstore_misses_total", reason=MISS_NOT_FOUND) == 8
    for path in ("shm", "bulk"):
        assert moved(t1, t0, "kvstore_fetched_blocks_total", path=path) == 8
        assert moved(t1, t0, "kvstore_fetched_bytes_total", path=path) == 8 * BLOCK
        assert moved(t1, t0, "kvstore_fetch_latency_seconds_count", path=path) == 1
        # the holder served them, and status counts the same reads
        assert moved(after[a], before[a], "kvstore_served_blocks_total", path=path) == 8
    assert moved(t1, t0, "kvstore_fetched_blocks_total", path="grpc") == 0
    assert moved(after[a], before[a], "kvstore_stored_blocks_total", source="put") == 8
    assert moved(after[a], before[a], "kvstore_stored_bytes_total", source="put") == 8 * BLOCK
    assert moved(after[a], before[a], "kvstore_put_latency_seconds_count") == 1
    assert status1["hits"] - status0["hits"] == sum(
        moved(t1, t0, "kvstore_served_blocks_total", path=p) for p in ("shm", "bulk", "grpc"))
    for node_id, address in nodes.items():  # pool gauges are the node's pool, now
        stats = ray.get(store_actor(node_id).stats.remote())
        now = scrape(address)
        assert now[("kvstore_pool_blocks", frozenset({("node_id", node_id)}))] == stats.num_blocks
        assert now[("kvstore_pool_used_bytes", frozenset({("node_id", node_id)}))] == \
            stats.used_bytes
        assert now[("kvstore_pool_capacity_bytes", frozenset({("node_id", node_id)}))] == \
            kv.pool.capacity_bytes
    coord_now = scrape(coord)
    assert coord_now[("kvstore_coordinator_blocks", frozenset())] == status1["blocks"]
    assert coord_now[("kvstore_coordinator_nodes_alive", frozenset())] == 2


def test_an_invalidation_is_counted_as_evictions_by_cause(
        kv: KVStoreConfig, ray_nodes: list[str]) -> None:
    a = ray_nodes[0]
    _, nodes = endpoints()
    writer = reader(kv, a)
    writer.batch_put(NS, make_chain(5).puts())
    writer.close()
    before = scrape(nodes[a])
    held = ray.get(store_actor(a).stats.remote()).num_blocks
    evictions0 = ray.get(store_actor(a).stats.remote()).evictions
    num = ray.get(coordinator_handle().invalidate.remote(NS.root))
    # the order travels in a heartbeat reply: wait until the node has carried it out
    wait_for(lambda: ray.get(store_actor(a).stats.remote()).num_blocks == 0, 15.0,
             "the node to evict the invalidated namespace")
    after = scrape(nodes[a])
    evicted = ray.get(store_actor(a).stats.remote()).evictions - evictions0
    assert num >= 5 and evicted == held  # every block of the namespace, nothing leased
    assert moved(after, before, "kvstore_evictions_total", node_id=a, cause="invalidate") == \
        evicted
    assert moved(after, before, "kvstore_evictions_total", node_id=a, cause="watermark") == 0


# -- the servers' priority -----------------------------------------------------------------------

def _thread_niceness(_: object) -> set[int]:
    """Every thread's niceness in the calling actor's process."""
    return {os.getpriority(os.PRIO_PROCESS, int(tid)) for tid in os.listdir("/proc/self/task")}


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or os.geteuid() != 0,
                    reason="raising a priority needs root (or CAP_SYS_NICE) on Linux")
def test_the_servers_on_the_data_path_run_at_normal_priority(
        kv: KVStoreConfig, ray_nodes: list[str]) -> None:
    """Ray starts its workers at nice 15; the store nodes and the coordinator (whose index
    service answers lookups and publishes) undo it in every thread, while a plain actor of
    the same cluster stays as Ray started it (so the test sees Ray's niceness at all: on the
    threads of Python's, the ones that run the actor's methods; Ray's own threads of C++,
    started before it lowers the priority, keep 0)."""
    plain = ray.remote(num_cpus=0)(type("Plain", (), {})).remote()
    try:
        assert 15 in ray.get(plain.__ray_call__.remote(_thread_niceness))
    finally:
        ray.kill(plain)
    assert ray.get(coordinator_handle().__ray_call__.remote(_thread_niceness)) == {0}
    for node_id in ray_nodes:
        assert ray.get(store_actor(node_id).__ray_call__.remote(_thread_niceness)) == {0}
