"""The disk tier under a real store node on a private local Ray: demotion when the arena is full,
reads that promote, damaged files that miss, a stop and start (and a kill) that keep the tier,
``purge`` that removes it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import torch

from kvstore.api import FetchedBlock, Miss
from kvstore.cluster import lifecycle
from kvstore.config import KVStoreConfig
from kvstore.config_loader import load_config
from tests.support.damage import damage_file
from tests.support.ray_cluster import BLOCK, NS, Chain, make_chain, reader, store_actor, wait_for

pytestmark = [pytest.mark.ray, pytest.mark.timeout(240)]

ARENA = 2 << 20  # ~60 blocks of 33 KiB: a few chains overflow it


def make_config(disk_dir: Path) -> KVStoreConfig:
    return load_config(env={}, overrides={
        "pool": {"capacity_bytes": ARENA, "disk_dir": str(disk_dir),
                 "disk_capacity_bytes": 64 << 20},
        "coordinator": {"heartbeat_interval_s": 0.2, "node_timeout_s": 2.0,
                        "high_watermark": 0.9, "low_watermark": 0.6, "lease_ttl_s": 5.0},
        "security": {"insecure": True},
    })


@pytest.fixture(scope="module")
def started(ray_local: None, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[tuple[KVStoreConfig, str, Path]]:
    disk_dir = tmp_path_factory.mktemp("tier") / "disk"
    config = make_config(disk_dir)
    lifecycle.start(config)
    node = ray.get_runtime_context().get_node_id()
    try:
        yield config, node, disk_dir
    finally:
        lifecycle.stop(config, purge=True)


def read_chain(config: KVStoreConfig, node: str, chain: Chain) -> list[FetchedBlock | Miss]:
    store = reader(config, node)
    try:
        return store.batch_get(NS, chain.keys, chain.tokens)
    finally:
        store.close()


def assert_bitwise(got: list[FetchedBlock | Miss], chain: Chain) -> None:
    for r, want in zip(got, chain.payloads, strict=True):
        assert isinstance(r, FetchedBlock), r
        assert torch.equal(r.payload.view(torch.int32), want.view(torch.int32))


def stats(node: str):  # noqa: ANN201 - PoolStats
    return ray.get(store_actor(node).stats.remote())


def fill(config: KVStoreConfig, node: str, num_chains: int = 4) -> list[Chain]:
    chains = [make_chain(30) for _ in range(num_chains)]  # ~4 MiB into a 2 MiB arena
    store = reader(config, node)
    for ch in chains:
        store.batch_put(NS, ch.puts())
    store.close()
    wait_for(lambda: stats(node).disk_blocks >= 40, what="demotions reaching the disk")
    return chains


def test_full_arena_demotes_reads_promote_bitwise(started) -> None:
    config, node, disk_dir = started
    chains = fill(config, node)
    st = stats(node)
    assert st.used_bytes <= ARENA and st.disk_used_bytes <= st.disk_capacity_bytes
    store = reader(config, node)
    for ch in chains:  # every block is still found: the disk tier is a holder like the arena
        hit = store.lookup_prefix(NS, ch.keys)
        assert hit.num_blocks == 30 and hit.holders == [[node]] * 30
    store.close()
    for ch in chains:  # the oldest chain is on disk: read straight back, verified, bitwise
        assert_bitwise(read_chain(config, node, ch), ch)
    assert stats(node).disk_hits > 0
    files = [p for p in (disk_dir / "blocks").rglob("*") if p.is_file()]
    assert len(files) == stats(node).disk_blocks


@pytest.mark.parametrize("damage", ["flip", "truncate", "swap"])
def test_a_damaged_file_is_a_miss_never_wrong_kv(started, damage: str) -> None:
    config, node, disk_dir = started
    chains = fill(config, node)
    victim = chains[0]  # the least recently used: on disk
    path = disk_dir / "blocks" / victim.keys[5].hex()[:2] / victim.keys[5].hex()
    wait_for(path.exists, what="the victim's file")
    damage_file(path, damage, disk_dir / "blocks" / victim.keys[6].hex()[:2] / victim.keys[6].hex())
    got = read_chain(config, node, victim)
    assert isinstance(got[5], Miss)  # a miss (then a recompute), not an error, never bytes
    for i, r in enumerate(got):
        if i != 5 and isinstance(r, FetchedBlock):
            assert torch.equal(r.payload.view(torch.int32), victim.payloads[i].view(torch.int32))
    assert not path.exists()


def test_stop_and_start_keep_the_disk_tier_and_announce_it(started) -> None:
    config, node, disk_dir = started
    chains = fill(config, node)
    on_disk = set(ray.get(store_actor(node).keys.remote()))
    lifecycle.stop(config)  # keeps the disk tier (queued demotions written first)
    assert (disk_dir / "blocks").is_dir()
    lifecycle.start(config)
    wait_for(lambda: stats(node).disk_blocks > 0, what="the restarted node's disk tier")
    recovered = set(ray.get(store_actor(node).keys.remote()))
    assert recovered and recovered <= on_disk
    hits = 0
    for ch in chains:
        store = reader(config, node)
        hit = store.lookup_prefix(NS, ch.keys)
        store.close()
        got = read_chain(config, node, ch)
        for i, (r, want) in enumerate(zip(got, ch.payloads, strict=True)):
            if ch.keys[i] in recovered:
                assert isinstance(r, FetchedBlock), r
                assert torch.equal(r.payload.view(torch.int32), want.view(torch.int32))
                hits += 1
        assert hit.num_blocks >= sum(k in recovered for k in ch.keys[:1])
    assert hits == len(recovered & {k for ch in chains for k in ch.keys})


def test_a_killed_node_restarts_with_only_whole_blocks(started) -> None:
    config, node, disk_dir = started
    chains = [make_chain(30) for _ in range(4)]
    store = reader(config, node)
    for ch in chains:
        store.batch_put(NS, ch.puts())
    store.close()
    ray.kill(store_actor(node), no_restart=True)  # mid-demotion, likely: SIGKILL, no cleanup
    wait_for(lambda: _alive(node), timeout_s=60, what="the watcher's new store node")
    recovered = set(ray.get(store_actor(node).keys.remote()))
    for ch in chains:
        for r, key, want in zip(read_chain(config, node, ch), ch.keys, ch.payloads,
                                strict=True):
            if isinstance(r, FetchedBlock):  # whatever is served is whole and right
                assert torch.equal(r.payload.view(torch.int32), want.view(torch.int32))
            else:
                assert key not in recovered or isinstance(r, Miss)
    files = [p for p in (disk_dir / "blocks").rglob("*") if p.is_file()]
    assert files and all(p.stat().st_size == BLOCK for p in files)  # no torn block exposed


def _alive(node: str) -> bool:
    try:
        ray.get(store_actor(node).ping.remote(), timeout=5)
        return True
    except Exception:
        return False


def test_stop_purge_removes_the_disk_tier(started) -> None:
    config, node, disk_dir = started
    fill(config, node, num_chains=3)
    lifecycle.stop(config, purge=True)
    assert not disk_dir.exists()
    lifecycle.start(config)  # the module's fixture stops it again
    assert stats(node).disk_blocks == 0
    assert os.path.isdir(disk_dir)
