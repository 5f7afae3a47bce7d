"""What the coordinator and the store nodes exchange: heartbeat replies and the orders in them,
and a node's status in the json-able form ``kvstore status --json`` prints.

Orders travel in heartbeat replies, never as calls into the nodes, so a slow node cannot stall
the coordinator and a restarted coordinator needs no handles to the nodes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvstore.coordinator.liveness import NodeStatus
from kvstore.records import NodeAddress


@dataclass(slots=True)
class ReplicateOrder:
    """Fetch ``keys`` from ``source`` and put them locally, then publish."""

    keys: list[bytes]
    source: NodeAddress


@dataclass(slots=True)
class HeartbeatReply:
    """What a node must do: evict these, replicate those; re-register if the epoch changed.

    ``reannounce`` is set when the coordinator had declared the node dead (its keys left the
    index) and it came back: it must re-register with everything it holds. ``evict_causes``
    says why each of ``evict`` goes (``kvstore.metrics.EVICTION_CAUSES``), for the node's
    eviction counter; missing entries mean ``watermark``.
    """

    epoch: int
    evict: list[bytes] = field(default_factory=list)
    replicate: list[ReplicateOrder] = field(default_factory=list)
    reannounce: bool = False
    evict_causes: list[str] = field(default_factory=list)


def node_json(n: NodeStatus) -> dict[str, Any]:
    """One node of ``status()['nodes']``."""
    return {"node_id": n.node_id, "address": n.address.grpc_address if n.address else None,
            "metrics_address": n.address.metrics_address if n.address else None,
            "capacity_bytes": n.capacity_bytes, "used_bytes": n.used_bytes, "blocks": n.blocks,
            "hits": n.hits, "misses": n.misses, "evictions": n.evictions, "alive": n.alive,
            "draining": n.draining, "last_heartbeat": n.last_heartbeat,
            # each tier: the arena (hits: leases that found the block there) and the disk
            # tier under it (capacity 0: the node has none; hits: blocks read from disk)
            "tiers": {
                "arena": {"used_bytes": n.used_bytes, "capacity_bytes": n.capacity_bytes,
                          "blocks": n.blocks, "hits": n.hits},
                "disk": {"used_bytes": n.disk_used_bytes,
                         "capacity_bytes": n.disk_capacity_bytes, "blocks": n.disk_blocks,
                         "hits": n.disk_hits}}}
