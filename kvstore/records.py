"""What the control plane exchanges about nodes and prefixes: where a store node listens, its
pool's snapshot, a prefix lookup's answer, and the reasons a block can miss.

Plain data with no torch: the CLI, the coordinator and the cluster lifecycle import these
without loading torch, whose import is most of a short command's start-up.
``kvstore.api`` re-exports them for workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

#: Why a requested block did not come back. Metrics count misses by these.
MissReason = Literal["not_found", "corrupted", "mismatch", "node_unavailable", "lease_expired"]
MISS_REASONS: tuple[MissReason, ...] = get_args(MissReason)
MISS_NOT_FOUND: MissReason = "not_found"
MISS_CORRUPTED: MissReason = "corrupted"
MISS_MISMATCH: MissReason = "mismatch"
MISS_NODE_UNAVAILABLE: MissReason = "node_unavailable"
MISS_LEASE_EXPIRED: MissReason = "lease_expired"


@dataclass(slots=True)
class PrefixHit:
    """The longest cached prefix of a key chain and, per block, the nodes holding it."""

    num_blocks: int
    holders: list[list[str]] = field(default_factory=list)

    def blocks_per_node(self) -> dict[str, int]:
        """Per node: how many blocks of the cached prefix it holds (the routers' affinity).

        Only the first ``num_blocks`` entries of ``holders`` count, and a node listed twice for
        one block counts once, so no node's count exceeds ``num_blocks``.
        """
        counts: dict[str, int] = {}
        for nodes in self.holders[:self.num_blocks]:
            for node in set(nodes):
                counts[node] = counts.get(node, 0) + 1
        return counts


@dataclass(slots=True)
class PoolStats:
    """A snapshot of a store node's pool: heartbeats carry it to the coordinator and metrics."""

    capacity_bytes: int
    used_bytes: int
    num_blocks: int
    num_pinned: int
    num_leased: int
    hits: int
    misses: int
    evictions: int
    # The disk tier under the arena (kvstore.node.tiered_pool); all 0 when the node has none.
    disk_capacity_bytes: int = 0
    disk_used_bytes: int = 0
    disk_blocks: int = 0
    disk_hits: int = 0


@dataclass(slots=True)
class NodeAddress:
    """Where a store node listens: gRPC (control + data), the bulk byte channel, its arena file,
    and its Prometheus ``/metrics`` (``host:port``; None when ``server.metrics_port`` is off)."""

    node_id: str
    grpc_address: str
    bulk_address: str | None = None
    shm_path: str | None = None
    metrics_address: str | None = None
