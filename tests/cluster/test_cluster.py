"""The cluster on a real multi-node Ray: placement, round trips, eviction, faults, a short soak.

One ``ray.cluster_utils.Cluster`` (a head and one more node, each a real raylet) per module;
kvstore is started on it with small pools (8 MiB) and fast heartbeats so faults show in seconds.
References are the payloads the test itself wrote, compared bitwise.
"""

# ruff: noqa: F811  (the cluster fixtures are imported, then named as test arguments)
from __future__ import annotations

import os
import random
import socket
import threading
import time
from typing import Any

import pytest
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvstore.api import FetchedBlock, Miss
from kvstore.client.node_client import StoreNodeClient
from kvstore.cluster import lifecycle, operations
from kvstore.cluster.names import ARENA_PREFIX, coordinator_handle
from kvstore.config import KVStoreConfig
from kvstore.config_loader import load_config
from kvstore.errors import KVStoreError, PoolFull
from tests.support.ray_cluster import (  # noqa: F401  - fixtures are found by name
    BLOCK,
    CAPACITY,
    NS,
    Chain,
    assert_round_trip,
    kv,
    make_chain,
    make_chain_in,
    make_config,
    pool_keys,
    ray_cluster,
    ray_nodes,
    reader,
    store_actor,
    wait_for,
)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]


# -- placement and the data path --------------------------------------------------------------

def test_one_store_node_per_ray_node(kv: KVStoreConfig, ray_nodes: list[str]) -> None:
    directory = ray.get(coordinator_handle().directory.remote())
    assert set(directory) == set(ray_nodes)
    for node_id in ray_nodes:
        addr = ray.get(store_actor(node_id).ping.remote())
        assert addr == directory[node_id]
    info = lifecycle.start(kv)  # idempotent: finds the running cluster
    assert set(info.nodes) == set(ray_nodes)


def test_put_on_one_node_read_bitwise_from_both(kv: KVStoreConfig, ray_nodes: list[str]) -> None:
    a, b = ray_nodes
    writer, remote, local = reader(kv, a), reader(kv, b), reader(kv, a)
    chain = make_chain(6)
    writer.batch_put(NS, chain.puts())
    hit = remote.lookup_prefix(NS, chain.keys + [make_chain(1).keys[0]])
    assert hit.num_blocks == 6 and hit.holders == [[a]] * 6
    assert_round_trip(remote, chain)  # other node: bulk/gRPC
    assert_round_trip(local, chain)  # same Ray node: shared memory
    wrong = [list(t) for t in chain.tokens]
    wrong[2][0] += 1
    got = remote.batch_get(NS, chain.keys, wrong)
    assert isinstance(got[2], Miss) and got[2].reason == "mismatch"
    for s in (writer, remote, local):
        s.close()


def test_eviction_to_low_watermark_lru_children_first_keeps_leased_and_pinned(
        kv: KVStoreConfig, ray_nodes: list[str]) -> None:
    node = ray_nodes[1]
    store, other = reader(kv, node), reader(kv, ray_nodes[0])
    coordinator = coordinator_handle()
    base = len(pool_keys(node))
    chains = [make_chain(18) for _ in range(13)]
    for ch in chains[:12]:  # 216 blocks: just under the high watermark
        store.batch_put(NS, ch.puts())
    assert (base + 216) * BLOCK < 0.9 * CAPACITY < (base + 234) * BLOCK
    pinned, leased = chains[0].keys[0], chains[3].keys[0]
    assert ray.get(coordinator.pin.remote([pinned], hard=True, ttl_s=None)) == (1, 1)
    addr = ray.get(coordinator.directory.remote())[node]
    client = StoreNodeClient(addr.grpc_address, config=kv.client)
    lease = client.lease([leased], ttl_s=120)
    assert_round_trip(other, chains[1])  # chain 1 becomes the most recently used of the twelve
    time.sleep(0.6)  # the touches travel with the next heartbeats
    store.batch_put(NS, chains[12].puts())  # crosses the high watermark

    def used() -> int:
        return ray.get(store_actor(node).stats.remote()).used_bytes

    wait_for(lambda: used() <= 0.9 * CAPACITY, what="eviction below the high watermark")
    time.sleep(1.0)  # let every order of this round be executed
    held = pool_keys(node)
    # Down to the low watermark, give or take the leased block the node refused to evict.
    assert 0.6 * CAPACITY - 20 * BLOCK <= used() <= 0.6 * CAPACITY + 2 * BLOCK
    assert pinned in held and leased in held
    assert all(k in held for k in chains[1].keys)  # recently used
    assert all(k in held for k in chains[-1].keys)  # newest
    assert not any(k in held for k in chains[2].keys)  # oldest unprotected chain went first
    assert held.isdisjoint(chains[0].keys[1:])  # the pinned head stays, its children do not
    for ch in chains:  # children before parents: what is left of a chain is a prefix of it
        present = [k in held for k in ch.keys]
        assert present == sorted(present, reverse=True), present
    client.release(lease.lease_id)
    client.close()
    ray.get(coordinator.unpin.remote([pinned]))
    store.close()
    other.close()


def test_lease_of_a_dead_reader_expires(kv: KVStoreConfig, ray_nodes: list[str]) -> None:
    node = ray_nodes[0]
    store = reader(kv, node)
    chain = make_chain(2)
    store.batch_put(NS, chain.puts())
    addr = ray.get(coordinator_handle().directory.remote())[node]

    @ray.remote(max_retries=0, num_cpus=0)
    def lease_and_die(grpc_address: str, keys: list[bytes]) -> None:
        StoreNodeClient(grpc_address).lease(keys, ttl_s=2.0)
        os._exit(1)  # dies holding the lease, never releases it

    strategy = NodeAffinitySchedulingStrategy(node, soft=False)
    with pytest.raises(ray.exceptions.RayError):
        ray.get(lease_and_die.options(scheduling_strategy=strategy).remote(
            addr.grpc_address, chain.keys))
    client = StoreNodeClient(addr.grpc_address, config=kv.client)
    assert client.evict(chain.keys[:1]) == 0  # leased: the eviction order is skipped
    time.sleep(2.5)
    assert client.evict(chain.keys[:1]) > 0  # the lease expired by itself
    client.close()
    store.close()


def holder_sets(store, keys: list[bytes]) -> list[set[str]]:  # noqa: ANN001
    return [set(h) for h in store.index.holders(keys)]


def test_hot_block_read_from_another_node_is_replicated_there(
        kv: KVStoreConfig, ray_nodes: list[str]) -> None:
    a, b = ray_nodes
    writer, far = reader(kv, a), reader(kv, b)
    chain = make_chain(3)
    writer.batch_put(NS, chain.puts())
    for _ in range(kv.coordinator.hot_fetch_threshold):  # remote reads, named as node b's
        got = far.batch_get(NS, chain.keys, chain.tokens)
        assert all(isinstance(r, FetchedBlock) and r.node_id == a for r in got), got
    wait_for(lambda: holder_sets(far, chain.keys) == [{a, b}] * 3, 10,
             "the hot chain to be replicated to the reader's node")
    assert set(chain.keys) <= pool_keys(b)
    # Readers trust the holders the index told them for client.index_view_ttl_s (design.md
    # §4, the reader's index view): the new copy is theirs to prefer once that has passed.
    time.sleep(far.config.index_view_ttl_s + 0.1)
    for store, own in ((far, b), (writer, a)):  # each reader now prefers its own node's copy
        got = store.batch_get(NS, chain.keys, chain.tokens)
        assert [r.node_id for r in got if isinstance(r, FetchedBlock)] == [own] * 3, got
        assert_round_trip(store, chain)
    writer.close()
    far.close()


def test_soft_pinned_block_is_replicated_on_its_first_remote_read(
        kv: KVStoreConfig, ray_nodes: list[str]) -> None:
    a, b = ray_nodes
    writer, far = reader(kv, a), reader(kv, b)
    chain = make_chain(2)
    coordinator = coordinator_handle()
    ray.get(coordinator.pin.remote(chain.keys[:1], hard=False, ttl_s=60.0))
    writer.batch_put(NS, chain.puts())
    assert all(isinstance(r, FetchedBlock) for r in far.batch_get(NS, chain.keys, chain.tokens))
    wait_for(lambda: holder_sets(far, chain.keys[:1]) == [{a, b}], 10,
             "the soft-pinned block to be replicated to the reader's node")
    time.sleep(0.5)
    assert holder_sets(far, chain.keys[1:]) == [{a}]  # read once, not pinned: not hot yet
    ray.get(coordinator.unpin.remote(chain.keys[:1]))
    writer.close()
    far.close()


def test_drain_moves_blocks_to_the_other_node(kv: KVStoreConfig, ray_nodes: list[str]) -> None:
    a, b = ray_nodes
    writer, rdr = reader(kv, a), reader(kv, b)
    chain = make_chain(4)
    writer.batch_put(NS, chain.puts())
    coordinator = coordinator_handle()
    assert ray.get(coordinator.drain.remote(a)) >= 4
    try:
        wait_for(lambda: holder_sets(rdr, chain.keys) == [{b}] * 4, 15,
                 "the drained blocks to move to the other node")
        wait_for(lambda: not set(chain.keys) & pool_keys(a), 10, "the drained node to let go")
        for store in (rdr, writer):  # reads still verify, served by the new holder
            got = store.batch_get(NS, chain.keys, chain.tokens)
            assert [r.node_id for r in got if isinstance(r, FetchedBlock)] == [b] * 4, got
            assert_round_trip(store, chain)
    finally:
        ray.get(coordinator.remove_node.remote(a))  # a re-registers fresh (not draining)
        wait_for(lambda: a in ray.get(coordinator.directory.remote()), 15, "a to re-register")
    assert not any(n.draining for n in ray.get(coordinator.nodes.remote()) if n.alive)
    writer.close()
    rdr.close()


def test_invalidate_removes_one_namespace_everywhere_and_only_it(
        kv: KVStoreConfig, ray_nodes: list[str]) -> None:
    import dataclasses

    a, b = ray_nodes
    gone_ns = dataclasses.replace(NS, cache_salt="tenant-gone")
    kept_ns = dataclasses.replace(NS, cache_salt="tenant-kept")
    stores = {a: reader(kv, a), b: reader(kv, b)}
    chains: dict[tuple[str, str], Chain] = {}
    for node, store in stores.items():
        for ns in (gone_ns, kept_ns):
            ch = make_chain_in(ns, 3)
            store.batch_put(ns, ch.puts(ns))
            chains[(node, ns.cache_salt)] = ch
    coordinator = coordinator_handle()
    assert ray.get(coordinator.invalidate.remote(gone_ns.root)) == 6
    rdr = stores[a]
    gone = [k for (_, salt), ch in chains.items() if salt == "tenant-gone" for k in ch.keys]
    kept = [k for (_, salt), ch in chains.items() if salt == "tenant-kept" for k in ch.keys]
    assert holder_sets(rdr, gone) == [set()] * 6  # out of the index at once
    wait_for(lambda: not set(gone) & (pool_keys(a) | pool_keys(b)), 10,
             "the nodes to evict the invalidated namespace")
    assert set(kept) <= pool_keys(a) | pool_keys(b)
    for (node, salt), ch in chains.items():
        ns = kept_ns if salt == "tenant-kept" else gone_ns
        got = rdr.batch_get(ns, ch.keys, ch.tokens)
        if salt == "tenant-kept":  # the other tenant's blocks survive, bitwise
            assert [r.node_id for r in got if isinstance(r, FetchedBlock)] == [node] * 3
            for r, want in zip(got, ch.payloads, strict=True):
                assert torch.equal(r.payload.view(torch.int32), want.view(torch.int32))
        else:
            assert all(isinstance(r, Miss) for r in got)
    for store in stores.values():
        store.close()


def test_full_pool_evicts_and_retries_or_refuses_when_all_pinned(
        kv: KVStoreConfig, ray_nodes: list[str]) -> None:
    # A cluster whose heartbeats never evict (high watermark 1.0), so only the full-pool path
    # (PoolFull -> request_eviction -> evict -> retry) can make room.
    small = load_config(env={}, overrides={
        "pool": {"capacity_bytes": 31 * BLOCK + BLOCK // 2},  # 31 blocks fit
        "coordinator": {"heartbeat_interval_s": 0.2, "node_timeout_s": 2.0,
                        "high_watermark": 1.0, "low_watermark": 0.5, "lease_ttl_s": 2.0},
        "security": {"insecure": True},  # as make_config: the data path, plain
    })
    node = ray_nodes[1]
    lifecycle.stop(kv)
    lifecycle.start(small)
    try:
        store = reader(small, node)
        coordinator = coordinator_handle()
        pinned, loose, fresh = make_chain(20), make_chain(8), make_chain(6)
        ray.get(coordinator.pin.remote(pinned.keys, hard=True, ttl_s=None))
        store.batch_put(NS, pinned.puts())
        store.batch_put(NS, loose.puts())  # 28 of 31 blocks used
        store.batch_put(NS, fresh.puts())  # the 4th block does not fit: evict, retry
        held = pool_keys(node)
        assert set(pinned.keys) <= held and set(fresh.keys) <= held
        left = [k in held for k in loose.keys]  # only these were evictable: tail first
        assert not all(left) and left == sorted(left, reverse=True), left
        assert ray.get(coordinator.status.remote())["metrics"]["eviction_requests"] >= 1
        assert_round_trip(store, fresh)
        ray.get(coordinator.pin.remote(fresh.keys, hard=True, ttl_s=None))
        with pytest.raises(PoolFull, match="RESOURCE_EXHAUSTED.*nothing evictable"):
            store.batch_put(NS, make_chain(6).puts())  # 26 pinned + 6 > 31
        assert set(pinned.keys) | set(fresh.keys) <= pool_keys(node)  # pins held
        store.close()
    finally:
        lifecycle.stop(small)
        lifecycle.start(kv)


# -- faults -----------------------------------------------------------------------------------

def test_killed_store_node_leaves_index_readers_miss(kv: KVStoreConfig,
                                                     ray_nodes: list[str]) -> None:
    a, b = ray_nodes
    writer, rdr = reader(kv, b), reader(kv, a)
    chain = make_chain(4)
    writer.batch_put(NS, chain.puts())
    assert rdr.lookup_prefix(NS, chain.keys).num_blocks == 4
    coordinator = coordinator_handle()
    old_address = ray.get(coordinator.directory.remote())[b]
    ray.kill(store_actor(b), no_restart=True)
    # Ray calls the actor dead before its process is gone; once its port refuses, every read
    # of its blocks misses (and this reader's breaker skips the node from then on).
    wait_for(lambda: refuses(old_address.grpc_address), 30, "the killed node's port to close")
    got = rdr.batch_get(NS, chain.keys, chain.tokens)  # never raises: misses, then recompute
    assert all(isinstance(r, Miss) for r in got), got
    # Ask the coordinator, not the reader: a reader whose read found the node gone stops
    # counting its blocks at once (kvstore.client.unreachable), long before the coordinator
    # drops the node and its old address, and the next test must not start before that.
    wait_for(lambda: ray.get(coordinator.lookup_prefix.remote(chain.keys)).num_blocks == 0, 10,
             "the dead node's keys to leave the index")
    assert all(isinstance(r, Miss) for r in rdr.batch_get(NS, chain.keys, chain.tokens))
    # The watcher gives node b a fresh store node; it registers empty, at a new address.
    wait_for(lambda: ray.get(coordinator.directory.remote()).get(b) not in (None, old_address),
             30, "a new store node on the Ray node")
    writer.close()
    rdr.close()


def refuses(address: str) -> bool:
    """Whether nothing listens at ``address`` (host:port) any more."""
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=1.0).close()
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
    return False


def _restart_coordinator_keeps_blocks(config: KVStoreConfig, ray_nodes: list[str]) -> None:
    a, b = ray_nodes
    chains = {a: make_chain(3), b: make_chain(3)}
    for node, ch in chains.items():
        s = reader(config, node)
        s.batch_put(NS, ch.puts())
        s.close()
    coordinator = coordinator_handle()
    epoch = ray.get(coordinator.epoch.remote())
    ray.kill(coordinator, no_restart=False)  # Ray restarts it: a new epoch, an empty LRU
    wait_for(lambda: ray.get(coordinator_handle().epoch.remote()) != epoch, 30,
             "the coordinator to restart")
    rdr = reader(config, a)

    def all_visible() -> bool:
        # With Redis the keys never left the index; the directory refills as nodes re-announce.
        directory = ray.get(coordinator_handle().directory.remote())
        return set(chains) <= set(directory) and all(
            rdr.lookup_prefix(NS, ch.keys).num_blocks == 3 for ch in chains.values())

    wait_for(all_visible, 15, "store nodes to re-announce after the restart")
    for node, ch in chains.items():
        assert set(ch.keys) <= pool_keys(node)  # nothing lost on a live node
        assert_round_trip(rdr, ch)
    rdr.close()


def test_coordinator_restart_in_memory_index(kv: KVStoreConfig, ray_nodes: list[str]) -> None:
    _restart_coordinator_keeps_blocks(kv, ray_nodes)


@pytest.mark.redis
def test_coordinator_restart_redis_index(kv: KVStoreConfig, ray_nodes: list[str],
                                         request: pytest.FixtureRequest) -> None:
    server = request.getfixturevalue("redis_server")
    lifecycle.stop(kv)
    config = make_config(backend="redis", redis_url=server.url, key_prefix="test-cluster:")
    lifecycle.start(config)
    try:
        _restart_coordinator_keeps_blocks(config, ray_nodes)
    finally:
        lifecycle.stop(config)
        lifecycle.start(kv)  # leave the module's cluster as the fixture made it


# -- soak ------------------------------------------------------------------------------------

def test_soak_publishers_and_readers_at_twice_capacity(kv: KVStoreConfig,
                                                       ray_nodes: list[str]) -> None:
    published: dict[bytes, Chain] = {}
    lock = threading.Lock()
    errors: list[BaseException] = []
    stats = {"fetched": 0, "missed": 0, "pool_full": 0}
    per_node_blocks = 2 * CAPACITY // BLOCK // 2  # two publishers per node: 2x capacity
    done = threading.Event()

    def publish(node: str) -> None:
        s = reader(kv, node)
        try:
            for _ in range(per_node_blocks // 8):
                ch = make_chain(8)
                try:
                    s.batch_put(NS, ch.puts())
                except PoolFull:
                    stats["pool_full"] += 1  # back-pressure is allowed, a crash is not
                    continue
                with lock:
                    published[ch.keys[0]] = ch
        except BaseException as exc:
            errors.append(exc)
        finally:
            s.close()

    def read(node: str) -> None:
        s = reader(kv, node)
        rng = random.Random(node)
        try:
            while not done.is_set():
                with lock:
                    chains = list(published.values())
                if not chains:
                    time.sleep(0.05)
                    continue
                ch = rng.choice(chains)
                for r, want in zip(s.batch_get(NS, ch.keys, ch.tokens), ch.payloads,
                                   strict=True):
                    if isinstance(r, Miss):
                        stats["missed"] += 1
                        continue
                    assert torch.equal(r.payload.view(torch.int32), want.view(torch.int32))
                    stats["fetched"] += 1
        except BaseException as exc:
            errors.append(exc)
        finally:
            s.close()

    writers = [threading.Thread(target=publish, args=(n,)) for n in ray_nodes for _ in (0, 1)]
    readers = [threading.Thread(target=read, args=(n,)) for n in ray_nodes]
    for t in writers + readers:
        t.start()
    for t in writers:
        t.join(timeout=120)
    done.set()
    for t in readers:
        t.join(timeout=30)
    assert not errors, errors[0]
    assert stats["fetched"] > 0, stats

    def within_bounds() -> bool:
        return all(ray.get(store_actor(n).stats.remote()).used_bytes <= 0.9 * CAPACITY
                   for n in ray_nodes)

    wait_for(within_bounds, 10, "every pool under the high watermark")
    status = operations.status()
    assert all(n["used_bytes"] <= CAPACITY for n in status["nodes"])


def test_joining_ray_node_gets_a_store_node_and_leaving_one_is_dropped(
        kv: KVStoreConfig, ray_cluster: tuple[Any, list[str]]) -> None:
    c, ids = ray_cluster
    coordinator = coordinator_handle()
    extra = c.add_node(num_cpus=0)
    new_id = extra.node_id
    wait_for(lambda: new_id in ray.get(coordinator.directory.remote()), 60,
             "the watcher to start a store node on the new Ray node")
    c.remove_node(extra)
    wait_for(lambda: new_id not in ray.get(coordinator.directory.remote()), 20,
             "the departed node to be declared dead")
    assert set(ray.get(coordinator.directory.remote())) == set(ids)


def test_stop_removes_actors_and_arenas(kv: KVStoreConfig, ray_nodes: list[str]) -> None:
    assert lifecycle.stop(kv) >= 3
    names = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
    assert not any(n.startswith("kvstore-") for n in names)
    left = [f for f in os.listdir(kv.pool.shm_dir)
            if any(f.startswith(f"{ARENA_PREFIX}{n[:16]}") for n in ray_nodes)]
    assert not left
    with pytest.raises(KVStoreError):
        coordinator_handle()


def test_sweep_removes_only_dead_store_nodes_arenas(tmp_path):
    """A SIGKILLed store node's arena (RAM on tmpfs) is removed by its successor, nothing else."""
    import subprocess
    import sys

    from kvstore.cluster.names import arena_name
    from kvstore.node.arena_files import ProcessIdentity, owned_name, sweep_leftovers, this_process

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    me = this_process()
    node = "ab" * 20
    stale = tmp_path / owned_name(node[:16], ProcessIdentity(dead.pid, 1, me.pid_namespace))
    live = tmp_path / arena_name(node)  # this process: alive
    other = tmp_path / f"kvstore-arena-{'cd' * 8}-{dead.pid}"  # no owner recorded: not judged
    for f in (stale, live, other):
        f.write_bytes(b"x")
    assert sweep_leftovers(str(tmp_path)).num_freed == 1
    assert not stale.exists() and live.exists() and other.exists()
