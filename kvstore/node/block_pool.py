"""A store node's block memory: immutable blocks in a shared-memory arena, with leases and LRU.

Writes are two-phase (``reserve`` -> copy -> ``commit``), so nobody sees a half-written block and
payload bytes are copied outside the lock. Reads take a lease; a block deleted or evicted while
leased leaves the key space at once but keeps its bytes until the last lease ends (or expires,
so a crashed reader cannot hold memory forever). Eviction policy belongs to the coordinator: the
pool only reports ``lru_candidates`` and obeys ``evict``. The plain data it hands out and the
protocol the server needs of a pool are ``kvstore.node.pool_contract``.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.constants import align_up
from kvstore.errors import BlockNotFound, KVStoreError, PoolFull
from kvstore.keys import Namespace
from kvstore.node.arena import Arena, ExtentAllocator
from kvstore.node.pool_contract import BlockLocation as BlockLocation
from kvstore.node.pool_contract import Lease as Lease
from kvstore.node.pool_contract import Reservation as Reservation
from kvstore.node.pool_contract import ServedPool as ServedPool
from kvstore.records import PoolStats


@dataclass(slots=True, eq=False)
class _Entry:
    key: bytes
    offset: int
    nbytes: int
    pinned: bool = False
    num_leases: int = 0
    deleted: bool = False  # out of the key space, bytes kept for live leases


@dataclass(slots=True)
class _LeaseRecord:
    entries: list[_Entry]
    expires_at: float


@dataclass(slots=True)
class _Counters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0


class BlockPool:
    """Immutable blocks in one preallocated shared-memory arena; thread-safe."""

    def __init__(
        self, capacity_bytes: int, *, shm_dir: str = "/dev/shm", name: str | None = None
    ) -> None:
        self._arena = Arena(capacity_bytes, shm_dir, name)
        self.path = self._arena.path
        self.capacity_bytes = self._arena.capacity
        self._alloc = ExtentAllocator(self.capacity_bytes)
        self._lock = threading.Lock()
        # Insertion order is recency order: the first entry is the least recently used.
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._num_pinned = 0
        self._leases: dict[int, _LeaseRecord] = {}
        self._expiry_heap: list[tuple[float, int]] = []  # lazy: stale items skipped on pop
        self._reservations: dict[int, Reservation] = {}
        self._reserved_bytes = 0  # aligned bytes of open reservations (not yet committed)
        self._ids = itertools.count(1)
        self._counters = _Counters()
        self._closed = False

    # -- writes ---------------------------------------------------------------------------

    def put(self, key: bytes, data: bytes | bytearray | memoryview) -> bool:
        """Copy a block in; False if the key already exists (blocks are immutable)."""
        src = memoryview(data)
        if src.format != "B" or src.ndim != 1:
            src = src.cast("B")
        with self._lock:
            self._check_open()
            if key in self._entries:
                return False
        res = self.reserve(key, src.nbytes)
        try:
            np.copyto(np.frombuffer(res.view, np.uint8), np.frombuffer(src, np.uint8))
        except BaseException:
            self.abort(res)
            raise
        return self.commit(res)

    def reserve(self, key: bytes, nbytes: int) -> Reservation:
        """Claim space and return a writable view of it; the key stays invisible until commit."""
        if nbytes <= 0:
            raise ValueError(f"a block must have > 0 bytes, got {nbytes}")
        with self._lock:
            self._check_open()
            offset = self._alloc_locked(nbytes)
            res = Reservation(next(self._ids), key, offset, nbytes,
                              self._arena.view[offset : offset + nbytes])
            self._reservations[res.reservation_id] = res
            self._reserved_bytes += align_up(nbytes)
        return res

    def commit(self, reservation: Reservation, lease_id: int | None = None) -> bool:
        """Make a reserved block visible; False (space freed) if the key was published first.

        ``lease_id``: a live lease the block (or the copy published first) joins in the same
        lock hold, so no eviction can take it between its commit and its lease (a disk
        block promoted for a reader, ``TieredPool.lease``).
        """
        with self._lock:
            self._take_reservation(reservation)
            entry = self._entries.get(reservation.key)
            published = entry is None
            if entry is not None:
                self._alloc.free(reservation.offset, reservation.nbytes)
            else:
                entry = self._entries[reservation.key] = _Entry(
                    reservation.key, reservation.offset, reservation.nbytes)
            if lease_id is not None:
                record = self._leases.get(lease_id)
                if record is not None:  # the lease counted the key a miss: a hit after all
                    entry.num_leases += 1
                    record.entries.append(entry)
                    self._counters.hits += 1
                    self._counters.misses -= 1
            return published

    def reserve_many(self, keys: Sequence[bytes], nbytes: int) -> list[Reservation | None]:
        """``reserve`` for a batch of equal-sized blocks in one lock hold: a reservation per
        key, None for a key the pool holds already. Stops at the first key there is no room
        for, so the list can be shorter than ``keys`` (the caller makes room and asks again
        for the rest); raises PoolFull only when not even the first fits."""
        if nbytes <= 0:
            raise ValueError(f"a block must have > 0 bytes, got {nbytes}")
        out: list[Reservation | None] = []
        with self._lock:
            self._check_open()
            entries, view, ids = self._entries, self._arena.view, self._ids
            for key in keys:
                if key in entries:
                    out.append(None)
                    continue
                try:
                    offset = self._alloc_locked(nbytes)
                except PoolFull:
                    if out:
                        break
                    raise
                res = Reservation(next(ids), key, offset, nbytes, view[offset : offset + nbytes])
                self._reservations[res.reservation_id] = res
                self._reserved_bytes += align_up(nbytes)
                out.append(res)
        return out

    def commit_many(self, reservations: Sequence[Reservation]) -> list[bool]:
        """``commit`` for a batch in one lock hold: per reservation, True if it is now
        visible, False (space freed) if its key was committed first by another writer."""
        out: list[bool] = []
        with self._lock:
            for res in reservations:
                self._take_reservation(res)
                if res.key in self._entries:
                    self._alloc.free(res.offset, res.nbytes)
                    out.append(False)
                    continue
                self._entries[res.key] = _Entry(res.key, res.offset, res.nbytes)
                out.append(True)
        return out

    def abort(self, reservation: Reservation) -> None:
        """Give a reservation's space back without publishing anything."""
        with self._lock:
            self._take_reservation(reservation)
            self._alloc.free(reservation.offset, reservation.nbytes)

    # -- reads ----------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._entries

    def nbytes_of(self, key: bytes) -> int | None:
        with self._lock:
            entry = self._entries.get(key)
            return None if entry is None else entry.nbytes

    def leased_bytes(self, offset: int, nbytes: int) -> memoryview:
        """Read-only bytes at ``offset`` (one or more leased blocks lying back to back), for the
        bulk channel to send from. Valid while the caller holds the lease; release the view."""
        if offset < 0 or nbytes < 0 or offset + nbytes > self.capacity_bytes:
            raise ValueError(f"range [{offset}, {offset + nbytes}) is outside the "
                             f"{self.capacity_bytes}-byte arena")
        return self._arena.view[offset : offset + nbytes].toreadonly()

    @contextlib.contextmanager
    def read(self, key: bytes) -> Iterator[memoryview]:
        """A read-only view of a block, valid only inside the ``with`` body (held leased)."""
        with self._lock:
            self._check_open()
            entry = self._entries.get(key)
            if entry is None:
                self._counters.misses += 1
                raise BlockNotFound(f"block {key.hex()[:16]} is not in this pool")
            self._counters.hits += 1
            self._entries.move_to_end(key)
            entry.num_leases += 1
        view = self._arena.view[entry.offset : entry.offset + entry.nbytes].toreadonly()
        try:
            yield view
        finally:
            with contextlib.suppress(BufferError):  # a caller's export keeps its own reference
                view.release()
            with self._lock:
                self._drop_lease_locked(entry)

    def copy_out(self, key: bytes) -> bytes | None:
        """A copy of a block's bytes for the pool's own use (demotion to a slower tier): not a
        read, so neither a hit nor a use in the LRU order; None if absent."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            entry.num_leases += 1
        try:
            return bytes(self._arena.view[entry.offset : entry.offset + entry.nbytes])
        finally:
            with self._lock:
                self._drop_lease_locked(entry)

    def evictable(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether ``evict`` would take each key now (held, not pinned, not leased)."""
        with self._lock:
            self._reap_expired_locked(time.monotonic())
            out = []
            for key in keys:
                entry = self._entries.get(key)
                out.append(entry is not None and not entry.pinned and not entry.num_leases)
            return out

    def get(self, key: bytes) -> bytes:
        """A copy of a block's bytes; BlockNotFound if absent."""
        with self.read(key) as view:
            return bytes(view)

    def lease(self, keys: Sequence[bytes], ttl_s: float,
              namespace: Namespace | None = None, *, files: bool = False) -> Lease:
        """Pin the present blocks' bytes for ``ttl_s`` seconds or until ``release``. Neither
        ``namespace`` nor ``files`` matters here: arena blocks were verified on Put."""
        if not ttl_s > 0:
            raise ValueError(f"lease ttl_s must be > 0 seconds, got {ttl_s}")
        now = time.monotonic()
        with self._lock:
            self._check_open()
            self._reap_expired_locked(now)
            entries: list[_Entry] = []
            for key in keys:
                entry = self._entries.get(key)
                if entry is None:
                    self._counters.misses += 1
                    continue
                self._counters.hits += 1
                self._entries.move_to_end(key)
                entry.num_leases += 1
                entries.append(entry)
            lease_id = next(self._ids)
            record = _LeaseRecord(entries, now + ttl_s)
            self._leases[lease_id] = record
            heapq.heappush(self._expiry_heap, (record.expires_at, lease_id))
        locations = [BlockLocation(e.key, e.offset, e.nbytes) for e in entries]
        return Lease(lease_id, locations, record.expires_at)

    def leased_locations(self, lease_id: int) -> list[BlockLocation]:
        """Where a live lease's blocks lie, in the order they joined it ([] once it ended)."""
        with self._lock:
            record = self._leases.get(lease_id)
            entries = list(record.entries) if record is not None else []
        return [BlockLocation(e.key, e.offset, e.nbytes) for e in entries]

    def renew(self, lease_id: int, ttl_s: float) -> bool:
        """Extend a live lease to ``ttl_s`` from now; False if it ended already."""
        if not ttl_s > 0:
            raise ValueError(f"lease ttl_s must be > 0 seconds, got {ttl_s}")
        now = time.monotonic()
        with self._lock:
            self._reap_expired_locked(now)
            record = self._leases.get(lease_id)
            if record is None:
                return False
            record.expires_at = now + ttl_s
            heapq.heappush(self._expiry_heap, (record.expires_at, lease_id))
            return True

    def release(self, lease_id: int) -> None:
        """End a lease (idempotent: an expired or unknown lease is a no-op)."""
        with self._lock:
            record = self._leases.pop(lease_id, None)
            if record is not None:
                for entry in record.entries:
                    self._drop_lease_locked(entry)

    # -- eviction and bookkeeping --------------------------------------------------------

    def delete(self, key: bytes) -> bool:
        """Remove a block from view now; its bytes are freed when the last lease ends."""
        with self._lock:
            return self._delete_locked(key) is not None

    def pin(self, key: bytes) -> bool:
        """Protect a block from eviction; False if absent."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return False
            if not entry.pinned:
                entry.pinned = True
                self._num_pinned += 1
            return True

    def unpin(self, key: bytes) -> bool:
        """Make a pinned block evictable again; False if absent."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return False
            if entry.pinned:
                entry.pinned = False
                self._num_pinned -= 1
            return True

    def touch(self, keys: Sequence[bytes]) -> None:
        """Mark blocks as just used (LRU)."""
        with self._lock:
            for key in keys:
                if key in self._entries:
                    self._entries.move_to_end(key)

    def lru_candidates(self, limit: int) -> list[bytes]:
        """Up to ``limit`` evictable keys, least recently used first (no pinned or leased)."""
        out: list[bytes] = []
        with self._lock:
            self._reap_expired_locked(time.monotonic())
            for key, entry in self._entries.items():
                if len(out) >= limit:
                    break
                if not entry.pinned and entry.num_leases == 0:
                    out.append(key)
        return out

    def evict(self, keys: Sequence[bytes]) -> int:
        """Delete unpinned, unleased blocks among ``keys``; returns the bytes freed.

        Pinned or leased keys are skipped: the coordinator's view may be a moment old, and a
        lease taken since then must win over an eviction order.
        """
        freed = 0
        with self._lock:
            self._reap_expired_locked(time.monotonic())
            for key in keys:
                entry = self._entries.get(key)
                if entry is None or entry.pinned or entry.num_leases:
                    continue
                self._delete_locked(key)
                freed += entry.nbytes
                self._counters.evictions += 1
        return freed

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._entries)

    def held(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether the pool holds each of ``keys`` (``contains`` for a batch, one lock hold)."""
        with self._lock:
            entries = self._entries
            return [key in entries for key in keys]

    def used_bytes(self) -> int:
        """Bytes in use now, as ``stats().used_bytes`` says, without walking the entries."""
        with self._lock:
            self._reap_expired_locked(time.monotonic())
            return self.capacity_bytes - self._alloc.free_bytes

    def committed_bytes(self) -> int:
        """Bytes in use by committed blocks (and deleted ones still leased): ``used_bytes``
        less open reservations. Eviction pressure is measured in these, so a Put that has
        reserved space but not committed it never makes the node evict committed blocks."""
        with self._lock:
            self._reap_expired_locked(time.monotonic())
            return self.capacity_bytes - self._alloc.free_bytes - self._reserved_bytes

    def reserved_bytes(self) -> int:
        """Bytes held by reservations not yet committed or aborted."""
        with self._lock:
            return self._reserved_bytes

    def stats(self) -> PoolStats:
        with self._lock:
            self._reap_expired_locked(time.monotonic())
            num_leased = sum(1 for e in self._entries.values() if e.num_leases)
            return PoolStats(
                capacity_bytes=self.capacity_bytes,
                used_bytes=self.capacity_bytes - self._alloc.free_bytes,
                num_blocks=len(self._entries),
                num_pinned=self._num_pinned,
                num_leased=num_leased,
                hits=self._counters.hits,
                misses=self._counters.misses,
                evictions=self._counters.evictions,
            )

    def close(self) -> None:
        """Unmap and unlink the arena file; the pool is unusable afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._entries.clear()
            self._leases.clear()
            for res in self._reservations.values():
                with contextlib.suppress(BufferError):
                    res.view.release()
            self._reservations.clear()
            self._reserved_bytes = 0
        self._arena.close()

    def __enter__(self) -> BlockPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals (caller holds the lock) ------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise KVStoreError(f"block pool {self.path} is closed")

    def _alloc_locked(self, nbytes: int) -> int:
        offset = self._alloc.alloc(nbytes)
        if offset is None:
            # Expired leases may hold deleted blocks' bytes: reclaim them before giving up.
            self._reap_expired_locked(time.monotonic())
            offset = self._alloc.alloc(nbytes)
        if offset is None:
            used = self.capacity_bytes - self._alloc.free_bytes
            raise PoolFull(
                f"pool has no room for a {nbytes}-byte block: capacity {self.capacity_bytes} B, "
                f"used {used} B, largest free extent {self._alloc.largest_free()} B"
                + (" (the block is larger than the whole pool; raise pool.capacity_bytes)"
                   if align_up(nbytes) > self.capacity_bytes else
                   " (evict blocks or raise pool.capacity_bytes)")
            )
        return offset

    def _take_reservation(self, reservation: Reservation) -> None:
        if self._reservations.pop(reservation.reservation_id, None) is None:
            raise ValueError(
                f"reservation {reservation.reservation_id} for {reservation.key.hex()[:16]} was "
                "already committed or aborted (or the pool was closed)"
            )
        self._reserved_bytes -= align_up(reservation.nbytes)
        with contextlib.suppress(BufferError):  # the writer's own export outlives us harmlessly
            reservation.view.release()

    def _delete_locked(self, key: bytes) -> _Entry | None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        if entry.pinned:
            entry.pinned = False
            self._num_pinned -= 1
        entry.deleted = True
        if entry.num_leases == 0:
            self._alloc.free(entry.offset, entry.nbytes)
        return entry

    def _drop_lease_locked(self, entry: _Entry) -> None:
        entry.num_leases -= 1
        if entry.num_leases == 0 and entry.deleted and not self._closed:
            self._alloc.free(entry.offset, entry.nbytes)

    def _reap_expired_locked(self, now: float) -> None:
        heap = self._expiry_heap
        while heap and heap[0][0] <= now:
            expires_at, lease_id = heapq.heappop(heap)
            record = self._leases.get(lease_id)
            if record is None or record.expires_at != expires_at:
                continue  # released, or renewed (a later heap item stands for it)
            del self._leases[lease_id]
            for entry in record.entries:
                self._drop_lease_locked(entry)
