"""What an operator does to a running cluster: look at it, pin, unpin, drain, invalidate.

Every verb goes through the coordinator, which keeps the one LRU view of the cluster and sends
the resulting orders to the store nodes in their heartbeats. The caller connects to Ray first
(``kvstore.cluster.lifecycle.ensure_ray``); each function raises ``NodeUnavailable`` when no
coordinator is running.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray

from kvstore.cluster.names import coordinator_handle


def status() -> dict[str, Any]:
    """The coordinator's json-able view of the cluster: nodes, totals, drift, top prefixes."""
    return ray.get(coordinator_handle().status.remote())


def pin(keys: Sequence[bytes], *, hard: bool = True, ttl_s: float | None = None) -> int:
    """Pin blocks (hard: never evicted; soft: evicted last, after ``ttl_s``); returns how many."""
    return int(ray.get(coordinator_handle().pin.remote(list(keys), hard=hard, ttl_s=ttl_s)))


def unpin(keys: Sequence[bytes]) -> int:
    """Remove pins; returns how many keys were pinned."""
    return int(ray.get(coordinator_handle().unpin.remote(list(keys))))


def drain(node_id: str) -> int:
    """Move a node's blocks elsewhere (or evict them) so it can leave; returns the block count."""
    return int(ray.get(coordinator_handle().drain.remote(node_id)))


def report_worker(worker_id: str, info: dict[str, Any]) -> None:
    """Tell the coordinator what a prefill or decode worker runs (shown by ``kvstore status``)."""
    ray.get(coordinator_handle().report_worker.remote(worker_id, info))


def forget_worker(worker_id: str) -> None:
    """Tell the coordinator a worker closed."""
    ray.get(coordinator_handle().forget_worker.remote(worker_id))


def invalidate(namespace_root: bytes) -> int:
    """Evict every block of one namespace on every node; returns how many were ordered out."""
    return int(ray.get(coordinator_handle().invalidate.remote(namespace_root)))
