"""What a store node's pool hands out (locations, leases, reservations) and what the server and
the bulk channel need of a pool (``ServedPool``), apart from ``BlockPool`` itself so that the
node's other modules and the cluster's wrapper depend on the contract, not the allocator.

The contract names one shared segment (``path``): the memory file same-node readers map. A
lease's locations always lie in it, so a pool that keeps blocks in slower tiers as well (disk)
brings a block into the segment before it leases it; readers and the bulk channel
(``leased_bytes``) never learn which tier a block came from.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

from kvstore.keys import Namespace
from kvstore.records import PoolStats


@dataclass(slots=True)
class BlockLocation:
    """Where a leased block lies for same-node readers: in the pool's shared segment at
    ``offset``, or, when ``path`` is set, the whole file at ``path`` (a disk-tier block a
    reader that accepts files reads straight into its buffer; ``offset`` is 0)."""

    key: bytes
    offset: int
    nbytes: int
    path: str = ""

    def __reduce__(self) -> tuple[type[BlockLocation], tuple[bytes, int, int, str]]:
        """Pickled as its four fields: a lease's locations cross from vLLM's scheduler to its
        worker in every load's plan, and a slotted dataclass's default pickling is several
        times slower."""
        return BlockLocation, (self.key, self.offset, self.nbytes, self.path)


@dataclass(slots=True)
class Lease:
    """Blocks pinned for a reader until release or ``expires_at``; missing keys are absent.
    ``locations`` come in no promised order (a tiered pool lists the arena's first, then what
    it promoted or leased as files): readers match them by key."""

    lease_id: int
    locations: list[BlockLocation]
    expires_at: float


@dataclass(slots=True)
class Reservation:
    """Space for one block being written; the key is invisible until ``commit``."""

    reservation_id: int
    key: bytes
    offset: int
    nbytes: int
    view: memoryview


class ServedPool(Protocol):
    """What a store node's server and bulk channel need of a pool.

    ``BlockPool`` is one; the cluster's store node serves a wrapper that asks the coordinator
    for room when a reserve finds the pool full, which the server need not know about.
    """

    path: str
    capacity_bytes: int

    def reserve(self, key: bytes, nbytes: int) -> Reservation: ...
    def reserve_many(self, keys: Sequence[bytes], nbytes: int) -> list[Reservation | None]: ...
    def commit(self, reservation: Reservation) -> bool: ...
    def commit_many(self, reservations: Sequence[Reservation]) -> list[bool]: ...
    def abort(self, reservation: Reservation) -> None: ...
    def contains(self, key: bytes) -> bool: ...
    def nbytes_of(self, key: bytes) -> int | None: ...
    def read(self, key: bytes) -> AbstractContextManager[memoryview]: ...
    def leased_bytes(self, offset: int, nbytes: int) -> memoryview: ...
    def lease(self, keys: Sequence[bytes], ttl_s: float,
              namespace: Namespace | None = None, *, files: bool = False) -> Lease: ...
    def renew(self, lease_id: int, ttl_s: float) -> bool: ...
    def release(self, lease_id: int) -> None: ...
    def delete(self, key: bytes) -> bool: ...
    def evict(self, keys: Sequence[bytes]) -> int: ...
    def keys(self) -> list[bytes]: ...
    def stats(self) -> PoolStats: ...
