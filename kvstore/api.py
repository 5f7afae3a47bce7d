"""What workers see of the store: a small facade and the plain data it exchanges.

Workers depend on this protocol only, so the same engine runs on the embedded store
(``kvstore.client.local_store.LocalStore``), on a cluster
(``kvstore.client.cluster_store.ClusterStore``), or on nothing (``--no-cache``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, get_args

import numpy as np
import torch

from kvstore.errors import BlockCorrupted, BlockMismatch
from kvstore.keys import Namespace

#: Why a requested block did not come back. Metrics count misses by these.
MissReason = Literal["not_found", "corrupted", "mismatch", "node_unavailable", "lease_expired"]
MISS_REASONS: tuple[MissReason, ...] = get_args(MissReason)
MISS_NOT_FOUND: MissReason = "not_found"
MISS_CORRUPTED: MissReason = "corrupted"
MISS_MISMATCH: MissReason = "mismatch"
MISS_NODE_UNAVAILABLE: MissReason = "node_unavailable"
MISS_LEASE_EXPIRED: MissReason = "lease_expired"

TokenIds = Sequence[int] | np.ndarray | torch.Tensor


@dataclass(slots=True)
class BlockPut:
    """One full block to publish: its chained key, parent, tokens and ``[L,2,bs,H,D]`` KV."""

    key: bytes
    parent_key: bytes
    token_ids: TokenIds
    payload: torch.Tensor


@dataclass(slots=True)
class FetchedBlock:
    """A verified block copied into memory the caller owns."""

    key: bytes
    payload: torch.Tensor
    node_id: str


@dataclass(slots=True)
class Miss:
    """A block that could not be used, and why (one of the ``MISS_*`` reasons)."""

    key: bytes
    reason: MissReason
    detail: str = ""

    @classmethod
    def rejected(cls, key: bytes, exc: BlockCorrupted | BlockMismatch, where: str = "") -> Miss:
        """A block that failed verification: ``mismatch`` for any ``BlockMismatch`` (another
        namespace included), else ``corrupted``; ``where`` (a node) prefixes the detail."""
        reason = MISS_MISMATCH if isinstance(exc, BlockMismatch) else MISS_CORRUPTED
        return cls(key, reason, f"{where}: {exc}" if where else str(exc))


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


class KVStore(Protocol):
    """The store as a worker uses it."""

    node_id: str

    def lookup_prefix(self, namespace: Namespace, keys: Sequence[bytes]) -> PrefixHit:
        """How many leading ``keys`` are cached, and where."""
        ...

    def batch_get(
        self,
        namespace: Namespace,
        keys: Sequence[bytes],
        token_ids: Sequence[TokenIds],
        *,
        device: torch.device | str | None = None,
    ) -> list[FetchedBlock | Miss]:
        """Lease, fetch, verify and copy out blocks; one result per key, in order.

        Verification failures and unreachable holders come back as ``Miss``, never raise.

        ``device``: where the payloads go. None: CPU tensors, as always (views into one
        buffer of whole blocks). A device (``"cpu"``, ``"cuda"``, ``"cuda:1"``; bare
        ``"cuda"`` is the current one): every ``FetchedBlock.payload`` is a view into one
        contiguous ``[len(keys), *payload_shape]`` tensor on that device, its data complete
        when the call returns (copies are synchronized; usable on any stream). A block is
        exposed only after its bytes were verified; the rows of misses hold zeros. A
        device the process cannot use is a ``ValueError``.
        """
        ...

    def batch_put(self, namespace: Namespace, blocks: Sequence[BlockPut]) -> None:
        """Publish blocks; returns once every key is visible to every reader."""
        ...

    def close(self) -> None: ...
