"""The coordinator as the real Ray actor: restarts, the reaper, Redis coming back empty.

The policies themselves are tested without Ray in ``tests/coordinator/test_core.py``.
"""

from __future__ import annotations

import time
import uuid

import pytest

from kvstore.api import NodeAddress
from kvstore.config import CoordinatorConfig, IndexConfig, KVStoreConfig
from tests.coordinator.test_core import make_chain, make_entries, make_stats, wait_for
from tests.support.redis_server import RedisProcess


def _start_actor(config: KVStoreConfig):
    import ray

    from kvstore.coordinator.actor import Coordinator

    return ray.remote(Coordinator).options(
        max_restarts=-1, max_task_retries=-1, num_cpus=0, max_concurrency=8).remote(config)


def _restart_keeps_reannounced_blocks(config: KVStoreConfig, persistent: bool) -> None:
    import ray

    from kvstore.coordinator.index_proxy import CoordinatorIndex

    handle = _start_actor(config)
    chain = make_chain(5, uuid.uuid4().hex)
    entries = make_entries("a", chain)
    address = NodeAddress("a", "a:1")
    epoch = ray.get(handle.register_node.remote("a", address, 1000, entries[:3]))
    ray.get(handle.publish.remote("a", entries[3:]))
    index = CoordinatorIndex(handle)
    assert index.lookup_prefix(chain).num_blocks == 5
    ray.kill(handle, no_restart=False)
    deadline = time.monotonic() + 60
    new_epoch = epoch
    while new_epoch == epoch and time.monotonic() < deadline:  # kill is asynchronous
        new_epoch = ray.get(handle.epoch.remote())  # retried until the restarted actor answers
        time.sleep(0.05)
    assert new_epoch != epoch
    assert index.lookup_prefix(chain).num_blocks == (5 if persistent else 0)
    reply = ray.get(handle.heartbeat.remote("a", make_stats(1000, 500), [], {}))
    assert reply.epoch == new_epoch and reply.reannounce
    ray.get(handle.register_node.remote("a", address, 1000, entries))  # the node re-announces
    assert index.lookup_prefix(chain).num_blocks == 5
    assert index.holders(chain[:1]) == [["a"]]
    drift = ray.get(handle.status.remote())["drift"]
    assert drift == {"added": 0 if persistent else 5, "removed": 0}
    ray.kill(handle, no_restart=True)


@pytest.mark.ray
def test_actor_reaps_a_silent_node_with_no_heartbeats_at_all(ray_local: None) -> None:
    import ray

    from kvstore.coordinator.index_proxy import CoordinatorIndex

    config = KVStoreConfig(coordinator=CoordinatorConfig(heartbeat_interval_s=0.1,
                                                         node_timeout_s=0.5))
    handle = _start_actor(config)
    chain = make_chain(3, uuid.uuid4().hex)
    ray.get(handle.register_node.remote("lone", NodeAddress("lone", "lone:1"), 1000,
                                        make_entries("lone", chain)))
    index = CoordinatorIndex(handle)  # lookups do not sweep: only the reaper can drop it
    assert index.lookup_prefix(chain).num_blocks == 3
    assert wait_for(lambda: index.lookup_prefix(chain).num_blocks == 0, 10.0)
    text = ray.get(handle.metrics_text.remote())
    assert "kvstore_coordinator_nodes_alive 0.0" in text
    assert "kvstore_coordinator_nodes_dead_total 1.0" in text
    ray.kill(handle, no_restart=True)


@pytest.mark.ray
def test_actor_restart_in_memory_index(ray_local: None) -> None:
    _restart_keeps_reannounced_blocks(KVStoreConfig(), persistent=False)


@pytest.mark.ray
@pytest.mark.redis
def test_actor_restart_redis_index(ray_local: None, redis_server) -> None:
    config = KVStoreConfig(index=IndexConfig(backend="redis", redis_url=redis_server.url,
                                             key_prefix=f"t-{uuid.uuid4().hex[:8]}:"))
    _restart_keeps_reannounced_blocks(config, persistent=True)


@pytest.mark.ray
@pytest.mark.redis
def test_actor_notices_redis_restarted_empty_and_nodes_reannounce(
        ray_local: None, fresh_redis: RedisProcess) -> None:
    """The reaper tick finds the epoch marker gone; the next heartbeat carries a new epoch."""
    import ray

    from kvstore.index.redis import RedisIndex

    config = KVStoreConfig(
        index=IndexConfig(backend="redis", redis_url=fresh_redis.url, key_prefix="a:"),
        coordinator=CoordinatorConfig(heartbeat_interval_s=0.1, node_timeout_s=30))
    handle = _start_actor(config)
    chain = make_chain(3, uuid.uuid4().hex)
    entries = make_entries("a", chain)
    epoch = ray.get(handle.register_node.remote("a", NodeAddress("a", "a:1"), 1000, entries))
    fresh_redis.restart()
    assert wait_for(lambda: ray.get(handle.heartbeat.remote(
        "a", make_stats(1000, 300), [], {})).epoch != epoch, 10.0)
    index = RedisIndex(fresh_redis.url, key_prefix="a:")
    assert index.lookup_prefix(chain).num_blocks == 0
    ray.get(handle.register_node.remote("a", NodeAddress("a", "a:1"), 1000, entries))
    assert index.lookup_prefix(chain).num_blocks == 3
    assert ray.get(handle.status.remote())["metrics"]["index_resets"] == 1
    index.close()
    ray.kill(handle, no_restart=True)
