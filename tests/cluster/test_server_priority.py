"""The servers a cluster runs on Ray undo Ray's worker niceness: on a real 2-node cluster, every
thread of the coordinator (its index service answers lookups and publishes) and of each store
node runs at 0, beside a plain actor that Ray started at 15."""

# ruff: noqa: F811  (the cluster fixtures are imported, then named as test arguments)
from __future__ import annotations

import os

import pytest
import ray

from kvstore.cluster.names import coordinator_handle
from kvstore.config import KVStoreConfig
from tests.support.ray_cluster import (  # noqa: F401  - fixtures are found by name
    kv,
    ray_cluster,
    ray_nodes,
    store_actor,
)

pytestmark = [pytest.mark.ray, pytest.mark.timeout(180)]


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
