"""A 2-node ``ray.cluster_utils.Cluster`` running kvstore, and the helpers its tests share.

The fixtures are module-scoped: a test module that imports them gets one cluster of its own.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import ray
import torch

from kvstore.api import BlockPut, FetchedBlock
from kvstore.block import block_nbytes
from kvstore.cluster import lifecycle
from kvstore.cluster.names import RAY_NAMESPACE, store_actor_name
from kvstore.config import KVStoreConfig
from kvstore.config_loader import load_config
from kvstore.keys import BlockHasher, Namespace
from tests.support.local_ray import init_local_ray, start_surviving_slow

NS = Namespace("test-cluster-model", "float32", 16, 2, 2, 64)
BLOCK = block_nbytes(NS)  # 33088 bytes: ~250 blocks fill an 8 MiB pool
CAPACITY = 8 << 20


def make_config(*, secure: bool = False, **index: str) -> KVStoreConfig:
    """Small pools and fast heartbeats. The data-path tests run the cluster plain on purpose
    (``security.insecure``: these Ray nodes bind a network address, where a start is secure by
    default); ``secure=True`` leaves the default on (tests/cluster/test_secure_start.py)."""
    return load_config(env={}, overrides={
        "pool": {"capacity_bytes": CAPACITY},
        "coordinator": {"heartbeat_interval_s": 0.2, "node_timeout_s": 2.0,
                        "high_watermark": 0.9, "low_watermark": 0.6, "lease_ttl_s": 2.0},
        "index": dict(index),
        "security": {} if secure else {"insecure": True},
    })


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[tuple[Any, list[str]]]:
    """A head and a second Ray node: the Cluster and their node ids (head first)."""
    from ray.cluster_utils import Cluster

    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # the same mode for every process we start
    # tests/conftest.py's session ``ray_local`` is single-node: set it aside for a multi-node
    # cluster and bring an equivalent one back afterwards for the modules that follow.
    had_ray_local = ray.is_initialized()
    if had_ray_local:
        ray.shutdown()
    c = start_surviving_slow(lambda: Cluster(initialize_head=True, head_node_args={"num_cpus": 2}),
                             what="the cluster's head")
    start_surviving_slow(lambda: c.add_node(num_cpus=1), what="the cluster's second node")
    c.wait_for_nodes()
    ray.init(address=c.address, namespace=RAY_NAMESPACE, log_to_driver=False)
    head = ray.get_runtime_context().get_node_id()
    ids = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    try:
        yield c, [head] + [i for i in ids if i != head]
    finally:
        ray.shutdown()
        c.shutdown()
        if had_ray_local:
            init_local_ray(num_cpus=2, include_dashboard=False, namespace="kvstore-tests")
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved


@pytest.fixture(scope="module")
def ray_nodes(ray_cluster: tuple[Any, list[str]]) -> list[str]:
    return ray_cluster[1]


@pytest.fixture(scope="module")
def kv(ray_nodes: list[str]) -> Iterator[KVStoreConfig]:
    config = make_config()
    lifecycle.start(config)
    try:
        yield config
    finally:
        lifecycle.stop(config)


def reader(config: KVStoreConfig, node_id: str):  # noqa: ANN201 - a ClusterStore
    """A ClusterStore that reads and writes as if it ran on Ray node ``node_id``."""
    cfg = load_config(env={}, overrides={"client": {"node_id": node_id}})
    cfg.coordinator, cfg.index, cfg.pool = config.coordinator, config.index, config.pool
    return lifecycle.connect(cfg)


@dataclass(slots=True)
class Chain:
    keys: list[bytes]
    tokens: list[list[int]]
    payloads: list[torch.Tensor]

    def puts(self, ns: Namespace = NS) -> list[BlockPut]:
        parents = [ns.root] + self.keys[:-1]
        return [BlockPut(k, p, t, x) for k, p, t, x in
                zip(self.keys, parents, self.tokens, self.payloads, strict=True)]


_chain_ids = iter(range(1, 1 << 30))


def make_chain(num_blocks: int) -> Chain:
    """A fresh token chain (never seen before in this module) with random KV."""
    return make_chain_in(NS, num_blocks)


def make_chain_in(ns: Namespace, num_blocks: int) -> Chain:
    """``make_chain`` in another namespace (another tenant's salt)."""
    cid = next(_chain_ids)
    g = torch.Generator().manual_seed(cid)
    tokens = [[cid * 100_000 + b * ns.block_size + t for t in range(ns.block_size)]
              for b in range(num_blocks)]
    keys = BlockHasher(ns).block_keys([t for blk in tokens for t in blk])
    payloads = [torch.randn(ns.payload_shape, generator=g) for _ in range(num_blocks)]
    return Chain(list(keys), tokens, payloads)


def wait_for(cond: Callable[[], bool], timeout_s: float = 15.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.1)


def store_actor(node_id: str):  # noqa: ANN201 - an actor handle
    return ray.get_actor(store_actor_name(node_id), namespace=RAY_NAMESPACE)


def pool_keys(node_id: str) -> set[bytes]:
    return set(ray.get(store_actor(node_id).keys.remote()))


def assert_round_trip(store, chain: Chain) -> None:  # noqa: ANN001
    hit = store.lookup_prefix(NS, chain.keys)
    assert hit.num_blocks == len(chain.keys)
    got = store.batch_get(NS, chain.keys, chain.tokens)
    for r, want in zip(got, chain.payloads, strict=True):
        assert isinstance(r, FetchedBlock), r
        assert torch.equal(r.payload.view(torch.int32), want.view(torch.int32))  # bitwise
