"""What a store node's calls return to a client, as plain data (``StoreNodeClient``'s results).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.node.block_pool import BlockLocation


@dataclass(slots=True)
class LeaseInfo:
    """A lease a node granted: where the blocks lie in its arena file, until when."""

    lease_id: str
    locations: list[BlockLocation]
    missing: list[bytes]
    expires_at: float
    shm_path: str


@dataclass(slots=True)
class PutResult:
    num_stored: int
    num_existing: int


@dataclass(slots=True)
class NodeStats:
    node_id: str
    capacity_bytes: int
    used_bytes: int
    num_blocks: int
    num_leased: int
    num_pinned: int


@dataclass(slots=True)
class NodeHealth:
    node_id: str
    serving: bool
    grpc_address: str
    bulk_address: str | None
    shm_path: str


@dataclass(slots=True)
class HeldBlock:
    """A block a node holds, with what the index needs to re-announce it."""

    key: bytes
    nbytes: int
    parent_key: bytes
    namespace_root: bytes
