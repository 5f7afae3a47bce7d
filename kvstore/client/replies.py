"""What a store node's calls return to a client, as plain data (``StoreNodeClient``'s results).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.constants import KEY_NBYTES
from kvstore.errors import NodeUnavailable
from kvstore.node.block_pool import BlockLocation


@dataclass(slots=True)
class LeaseInfo:
    """A lease a node granted: where the blocks lie in its arena file, until when."""

    lease_id: str
    locations: list[BlockLocation]
    missing: list[bytes]
    expires_at: float
    shm_path: str


def lease_info(resp: Any) -> LeaseInfo:
    """A ``LeaseResponse`` as plain data: the blocks it lists one message each (files, or all
    of them from a node that does not pack), then the arena's blocks it packed into columns."""
    where = [BlockLocation(loc.key, loc.offset, loc.nbytes, loc.file) for loc in resp.locations]
    if resp.offsets:
        held, n = resp.held_keys, KEY_NBYTES
        if len(held) != n * len(resp.offsets) or len(resp.sizes) != len(resp.offsets):
            raise NodeUnavailable("a lease reply's packed blocks do not line up")
        where += [BlockLocation(held[i * n:(i + 1) * n], offset, size)
                  for i, (offset, size) in enumerate(zip(resp.offsets, resp.sizes, strict=True))]
    return LeaseInfo(resp.lease_id, where, list(resp.missing), resp.expires_at, resp.shm_path)


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


def blocks_of_get_stream(stream: Iterable[Any], keys: Sequence[bytes], address: str
                         ) -> list[bytes | bytearray | None]:
    """The whole blocks a gRPC ``Get`` stream of ``GetChunk`` messages carries, in the order
    of ``keys`` (None: not found). NodeUnavailable if the chunks come out of order or the
    stream ends inside a block: none of a cut block may be used."""
    found: dict[bytes, bytes | bytearray] = {}
    partial: dict[bytes, bytearray] = {}
    for msg in stream:
        if not msg.found:
            continue
        if msg.offset == 0 and len(msg.data) == msg.total_nbytes:
            found[msg.key] = msg.data  # the common case: the block in one message
            continue
        buf = partial.setdefault(msg.key, bytearray())
        if msg.offset != len(buf):
            raise NodeUnavailable(f"{address} sent block chunks out of order")
        buf += msg.data
        if len(buf) == msg.total_nbytes:
            found[msg.key] = partial.pop(msg.key)
    if partial:
        raise NodeUnavailable(f"{address} ended the Get stream inside a block")
    return [found.get(k) for k in keys]
