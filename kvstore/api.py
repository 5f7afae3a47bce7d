"""What workers see of the store: a small facade and the plain data it exchanges.

Workers depend on this protocol only, so the same engine runs on the embedded store
(``kvstore.client.local_store.LocalStore``), on a cluster
(``kvstore.client.cluster_store.ClusterStore``), or on nothing (``--no-cache``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from kvstore.errors import BlockCorrupted, BlockMismatch
from kvstore.keys import Namespace
from kvstore.records import (
    MISS_CORRUPTED,
    MISS_LEASE_EXPIRED,
    MISS_MISMATCH,
    MISS_NODE_UNAVAILABLE,
    MISS_NOT_FOUND,
    MISS_REASONS,
    MissReason,
    NodeAddress,
    PoolStats,
    PrefixHit,
)

__all__ = [
    "MISS_CORRUPTED", "MISS_LEASE_EXPIRED", "MISS_MISMATCH", "MISS_NODE_UNAVAILABLE",
    "MISS_NOT_FOUND", "MISS_REASONS", "BlockPut", "FetchedBlock", "KVStore", "Miss",
    "MissReason", "NodeAddress", "PoolStats", "PrefixHit", "TokenIds",
]

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
