"""A store node's pool with two tiers: the shared-memory arena over a disk directory.

``ServedPool`` promises that leased locations lie in the arena, so readers and the bulk
channel never learn a block's tier, unless a same-node reader accepts files: then a disk block
not read lately is leased as its file, which the reader reads into its own buffer and verifies
(``lease(files=True)``, ``kvstore.client.file_reads``). Otherwise this pool brings a disk block
into the arena before it leases it (*promotion*: a lease's files read by ``disk_reads``'
threads into the reserved arena extents while this thread verifies each, ``verify_block_self``
or, for a keyed namespace the reader names, ``verify_block`` with the tenant's MAC), and by
writing an arena block to disk when the node evicts it for space (*demotion*: the bytes are
copied out, the arena extent is freed at once, ``DemotionQueue`` writes the file off the Put
and read paths)::

    Put ──> arena (BlockPool) ──demote (capacity, watermark)──> DemotionQueue ──> DiskTier
              ^                                                    │ pending    │ files
              └──────────── promote (lease, read) <────────────────┴────────────┘

The tiers are inclusive: a promoted block keeps its file, so demoting it again costs no
write, and the disk tier's own LRU decides when the file goes. Eviction for other reasons
(invalidation, drain, an admin's delete) deletes from both tiers.

The node learns what changed through ``take_changes``: keys no tier holds any more (the disk
dropped them: full, failing, damaged) and keys promoted back into the arena, which the
coordinator plans arena evictions over (design.md §5.3).
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvstore import metrics
from kvstore.block import stated_nbytes, verify_block, verify_block_self
from kvstore.errors import BlockCorrupted, BlockMismatch, BlockNotFound, PoolFull
from kvstore.keys import Namespace
from kvstore.node.block_pool import BlockPool
from kvstore.node.demotion import DemotionQueue, drop_reason
from kvstore.node.disk_tier import DiskTier
from kvstore.node.pool_contract import BlockLocation, Lease, Reservation
from kvstore.records import PoolStats

#: Disk blocks remembered as read from their files (``lease(files=True)``): one read again
#: while remembered is hot and promoted into the arena. 64 Ki keys: ~6 MiB of bookkeeping.
FILE_READS_REMEMBERED = 1 << 16
#: Times a lease asks for room and promotes again when the arena has no room for its disk
#: blocks (concurrent Puts can take the room made for it).
ROOM_ROUNDS = 4


@dataclass(slots=True)
class TierCounters:
    """What moved between the tiers since the pool opened."""

    disk_hits: int = 0  # blocks served from the disk tier (promoted or read through)
    demotions: int = 0  # blocks that left the arena for the disk tier
    promotions: int = 0  # disk blocks brought back into the arena
    drops: dict[str, int] = field(default_factory=dict)  # reason -> blocks lost to the tier


class TieredPool:
    """``BlockPool`` + ``DiskTier``: what ``ServedPool`` asks, over both tiers; thread-safe."""

    def __init__(self, arena: BlockPool, disk: DiskTier, *, queue_bytes: int) -> None:
        self.arena = arena
        self.disk = disk
        self.path = arena.path
        self.capacity_bytes = arena.capacity_bytes
        self.counters = TierCounters()
        self._lock = threading.Lock()
        self._lost: list[bytes] = []
        self._promoted: list[bytes] = []
        self._deleted_while_writing: set[bytes] = set()
        self._read_as_file: OrderedDict[bytes, bool] = OrderedDict()
        self._queue = DemotionQueue(disk, queue_bytes, self._on_dropped, self._on_written)

    # -- writes: the arena's, but a key on disk already exists --------------------------------

    def reserve(self, key: bytes, nbytes: int) -> Reservation:
        return self.arena.reserve(key, nbytes)

    def reserve_many(self, keys: Sequence[bytes], nbytes: int) -> list[Reservation | None]:
        """The arena's ``reserve_many``; None for keys either tier holds (first copy wins)."""
        on_disk = self._lower_held(keys)
        wanted = [k for k, d in zip(keys, on_disk, strict=True) if not d]
        got = iter(self.arena.reserve_many(wanted, nbytes) if wanted else [])
        out: list[Reservation | None] = []
        for there in on_disk:
            if there:
                out.append(None)
                continue
            res = next(got, False)
            if res is False:
                break  # the arena stopped short: so does this list
            out.append(res)  # type: ignore[arg-type]
        return out

    def commit(self, reservation: Reservation) -> bool:
        return self.arena.commit(reservation)

    def commit_many(self, reservations: Sequence[Reservation]) -> list[bool]:
        return self.arena.commit_many(reservations)

    def abort(self, reservation: Reservation) -> None:
        self.arena.abort(reservation)

    def put(self, key: bytes, data: bytes | bytearray | memoryview) -> bool:
        """Copy a block into the arena; False if either tier holds the key already."""
        if self._lower_held([key])[0]:
            return False
        return self.arena.put(key, data)

    # -- presence ---------------------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        return self.arena.contains(key) or self._lower_held([key])[0]

    def held(self, keys: Sequence[bytes]) -> list[bool]:
        upper = self.arena.held(keys)
        lower = self._lower_held(keys)
        return [a or b for a, b in zip(upper, lower, strict=True)]

    def nbytes_of(self, key: bytes) -> int | None:
        nbytes = self.arena.nbytes_of(key)
        if nbytes is not None:
            return nbytes
        entry = self.disk.entry(key)
        if entry is not None:
            return entry.nbytes
        pending = self._queue.pending(key)
        return None if pending is None else len(pending.data)

    def keys(self) -> list[bytes]:
        upper = self.arena.keys()
        return upper + self.disk_only_keys(set(upper))

    def disk_only_keys(self, upper: set[bytes] | None = None) -> list[bytes]:
        """Keys the node holds below the arena only (on disk, or on their way there)."""
        upper = set(self.arena.keys()) if upper is None else upper
        lower = dict.fromkeys(self.disk.keys())
        lower.update(dict.fromkeys(self._queue.keys()))
        return [k for k in lower if k not in upper]

    # -- reads: a disk block is brought into the arena first -----------------------------------

    def lease(self, keys: Sequence[bytes], ttl_s: float,
              namespace: Namespace | None = None, *,
              make_room: Callable[[int], bool] | None = None, files: bool = False) -> Lease:
        """Lease what the arena holds, then promote into the same lease what is only on disk;
        keys neither tier can serve are missing from the lease, as ever. Each promoted block
        joins the lease as it is committed, so no eviction can take it before the reader
        has it. ``namespace``: the reader's, as in ``promote``. ``make_room(nbytes)``: asked
        when the arena has no room for a disk block (the node's eviction; False when nothing
        could be freed), then the promotion is tried again, a few rounds at most.

        ``files``: the reader is on this node and reads block files itself. A disk block not
        read lately is then leased as its file (``BlockLocation.path``): the reader reads it
        straight into its own buffer and verifies it there, one copy where a promotion makes
        two, and a cold read does not push hotter blocks out of the arena. A block read again
        while remembered (``FILE_READS_REMEMBERED``) is hot and promoted as ever. A file the
        disk tier drops before the reader opens it is the reader's to ask for again."""
        lease = self.arena.lease(keys, ttl_s)
        metrics.record_tier_hits("arena", len(lease.locations))
        as_files = self._file_locations(keys, lease) if files else []
        if as_files:
            by_file = {loc.key for loc in as_files}
            keys = [k for k in keys if k not in by_file]
        lease, no_room = self._promote_into(lease, keys, namespace)
        for _ in range(ROOM_ROUNDS):
            if not no_room or make_room is None:
                break
            if not make_room(sum(self.nbytes_of(k) or 0 for k in no_room)):
                break
            lease, no_room = self._promote_into(lease, no_room, namespace)
        if as_files:
            lease = Lease(lease.lease_id, lease.locations + as_files, lease.expires_at)
        return lease

    def _file_locations(self, keys: Sequence[bytes], lease: Lease) -> list[BlockLocation]:
        """The disk blocks among ``keys`` (not in ``lease``, whole on disk, not queued) to
        serve as files: those not read lately. The rest (hot) are left to promotion."""
        have = {loc.key for loc in lease.locations}
        cold: list[BlockLocation] = []
        for key in keys:
            entry = None if key in have else self.disk.entry(key)
            if entry is None or self._queue.pending(key) is not None:
                continue
            with self._lock:
                if self._read_as_file.pop(key, False):
                    continue  # read again while remembered: hot
                self._read_as_file[key] = True
                if len(self._read_as_file) > FILE_READS_REMEMBERED:
                    self._read_as_file.popitem(last=False)
            cold.append(BlockLocation(key, 0, entry.nbytes, self.disk.path_of(key)))
        if cold:
            self.disk.touch([loc.key for loc in cold])
            self._count_hits(len(cold))
        return cold

    def _promote_into(self, lease: Lease, keys: Sequence[bytes],
                      namespace: Namespace | None) -> tuple[Lease, list[bytes]]:
        """Promote the ``keys`` ``lease`` lacks into it; returns the lease as it stands now
        and the keys the arena had no room for."""
        have = {loc.key for loc in lease.locations}
        missing = [k for k in keys if k not in have]
        if not missing:
            return lease, []
        no_room = self.promote(missing, namespace, lease_id=lease.lease_id)
        locations = self.arena.leased_locations(lease.lease_id)
        return Lease(lease.lease_id, locations, lease.expires_at), no_room

    @contextlib.contextmanager
    def read(self, key: bytes) -> Iterator[memoryview]:
        """The arena's ``read``, after a promotion; a disk block the arena has no room for is
        read into a private buffer (verified) instead of failing."""
        if not self.arena.contains(key) and self.promote([key]):
            buf = bytearray(self.nbytes_of(key) or 0)
            if not buf or not self._fill(key, memoryview(buf)):
                raise BlockNotFound(f"block {key.hex()[:16]} is not in this pool")
            self._count_hits(1)
            yield memoryview(buf).toreadonly()
            return
        with self.arena.read(key) as view:
            yield view

    def leased_bytes(self, offset: int, nbytes: int) -> memoryview:
        return self.arena.leased_bytes(offset, nbytes)

    def renew(self, lease_id: int, ttl_s: float) -> bool:
        return self.arena.renew(lease_id, ttl_s)

    def release(self, lease_id: int) -> None:
        self.arena.release(lease_id)

    def promote(self, keys: Sequence[bytes], namespace: Namespace | None = None,
                lease_id: int | None = None) -> list[bytes]:
        """Bring the keys held only below the arena into it, verified; returns the ones the
        arena had no room for (the caller may make room and ask again). A damaged file is
        dropped (counted ``corrupted``) and its key is a miss. ``namespace`` (the reader's,
        with its MAC key): blocks of a keyed namespace are checked against the tenant's MAC
        too, which ``verify_block_self`` cannot do, so a damaged payload is dropped here
        rather than promoted for every reader to refuse. ``lease_id``: the lease each
        promoted block joins as it is committed (``lease_more``).

        The arena extents are reserved first, then the files are read by the disk tier's
        reader threads while this thread verifies and commits the ones already read, in
        order: one lease's blocks keep the device busy instead of waiting on each other.
        """
        in_arena = self.arena.held(keys)
        todo = [k for k, up, low in zip(keys, in_arena, self._lower_held(keys), strict=True)
                if low and not up]
        reserved: list[Reservation] = []
        no_room: list[bytes] = []
        for i, key in enumerate(todo):
            nbytes = self.nbytes_of(key)
            if nbytes is None:
                continue  # dropped since
            try:
                reserved.append(self.arena.reserve(key, nbytes))
            except PoolFull:
                no_room = todo[i:]
                break
        if not reserved:
            return no_room
        # Blocks still queued for the disk are copied from the queue; the rest are read.
        from_disk = [r for r in reserved if not self._fill_pending(r.key, r.view)]
        reads = self.disk.read_many([r.key for r in from_disk], [r.view for r in from_disk])
        done: set[int] = set()
        try:
            for res, got in zip(from_disk, reads, strict=True):
                if not self._check_read(res.key, res.view, got, namespace):
                    self.arena.abort(res)
                    done.add(res.reservation_id)
            for res in reserved:
                if res.reservation_id in done:
                    continue
                done.add(res.reservation_id)
                if self.arena.commit(res, lease_id):
                    with self._lock:
                        self.counters.promotions += 1
                        self._promoted.append(res.key)
                    metrics.record_tier_moves("promotion", 1)
                    self._count_hits(1)
        finally:
            reads.close()  # no reader thread writes into an extent once this returns
            for res in reserved:
                if res.reservation_id not in done:
                    self.arena.abort(res)
        return no_room

    def _fill(self, key: bytes, dest: memoryview) -> bool:
        """Copy block ``key`` from below the arena into ``dest`` and verify it; False (the
        file dropped and counted when it was damaged or unreadable) if it cannot serve."""
        if self._fill_pending(key, dest):
            return True
        reads = self.disk.read_many([key], [dest])
        try:
            got = next(reads)
        finally:
            reads.close()
        return self._check_read(key, dest, got)

    def _fill_pending(self, key: bytes, dest: memoryview) -> bool:
        """Copy a block still queued for the disk into ``dest``; False if it is not queued."""
        pending = self._queue.pending(key)
        if pending is None or len(pending.data) != len(dest):
            return False
        np.copyto(np.frombuffer(dest, np.uint8), np.frombuffer(pending.data, np.uint8))
        return True

    def _check_read(self, key: bytes, dest: memoryview, got: int | Exception,
                    namespace: Namespace | None = None) -> bool:
        """Whether a disk read of ``key`` into ``dest`` (``got``: bytes read or the error)
        may serve: verified like a Put's block; a damaged or unreadable file is dropped and
        counted by reason."""
        if isinstance(got, BlockNotFound):
            return False
        if isinstance(got, Exception):
            self._lose(key, "corrupted" if isinstance(got, BlockCorrupted) else
                       drop_reason(got) if isinstance(got, OSError) else "io_error")
            return False
        try:
            header = verify_block_self(dest, key)
            if (namespace is not None and namespace.mac_key is not None
                    and header.namespace_root == namespace.root):
                verify_block(dest, namespace, key)
        except (BlockCorrupted, BlockMismatch):
            self._lose(key, "corrupted")
            return False
        return True

    def _lose(self, key: bytes, reason: str) -> None:
        self.disk.delete(key)
        self._on_dropped([key], reason)

    # -- eviction -----------------------------------------------------------------------------

    def demote(self, keys: Sequence[bytes]) -> int:
        """Move evictable arena blocks among ``keys`` to the disk tier (eviction for space);
        returns the arena bytes freed. A block already on disk only leaves the arena; one the
        queue has no room for is dropped (counted ``queue_full``)."""
        keys = list(keys)
        freed = 0
        lower = self._lower_held(keys)
        for key, ok, on_disk in zip(keys, self.arena.evictable(keys), lower, strict=True):
            if not ok:
                continue
            if not on_disk:
                data = self.arena.copy_out(key)
                if data is None:
                    continue
                header, _ = stated_nbytes(data)
                if not self._queue.offer(key, data, header.parent_key, header.namespace_root):
                    freed += self.arena.evict([key])
                    self._on_dropped([key], "queue_full")
                    continue
            got = self.arena.evict([key])
            if got:
                freed += got
                with self._lock:
                    self.counters.demotions += 1
                metrics.record_tier_moves("demotion", 1)
        return freed

    def evict(self, keys: Sequence[bytes]) -> int:
        """Delete from both tiers (invalidation, drain, an admin's evict); returns the arena
        bytes freed. Pinned or leased arena blocks stay, as ``BlockPool.evict`` says."""
        freed = self.arena.evict(keys)
        for key in keys:
            if not self.arena.contains(key):
                self._delete_lower(key)
        return freed

    def evict_lower(self, keys: Sequence[bytes]) -> list[bytes]:
        """Drop the disk copies of ``keys`` (the disk tier's least recently used); returns
        the keys the node no longer holds at all (a block promoted since keeps its arena
        copy)."""
        gone = []
        for key in keys:
            if self._delete_lower(key) and not self.arena.contains(key):
                gone.append(key)
        return gone

    def delete(self, key: bytes) -> bool:
        upper = self.arena.delete(key)
        return self._delete_lower(key) or upper

    def _delete_lower(self, key: bytes) -> bool:
        queued = self._queue.cancel(key)
        if not queued and self._queue.pending(key) is not None:
            with self._lock:
                self._deleted_while_writing.add(key)  # its file goes once written
        return self.disk.delete(key) or queued

    def take_changes(self) -> tuple[list[bytes], list[bytes]]:
        """``(lost, promoted)`` since the last call: keys no tier holds any more, and keys
        brought back into the arena (the node reports both to the coordinator)."""
        with self._lock:
            lost, self._lost = self._lost, []
            promoted, self._promoted = self._promoted, []
        still = self.held(lost) if lost else []
        return [k for k, h in zip(lost, still, strict=True) if not h], promoted

    def requeue_promoted(self, keys: Sequence[bytes]) -> None:
        """Give back promotions ``take_changes`` handed out that could not be reported."""
        with self._lock:
            self._promoted[:0] = list(keys)

    @property
    def queued_bytes(self) -> int:
        """Bytes of demoted blocks still waiting for the disk."""
        return self._queue.queued_bytes

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait for queued demotions to reach the disk (a stop, tests, benchmarks)."""
        return self._queue.flush(timeout_s)

    # -- the arena's bookkeeping, as is -------------------------------------------------------

    def pin(self, key: bytes) -> bool:
        if not self.arena.contains(key):
            self.promote([key])
        return self.arena.pin(key)

    def unpin(self, key: bytes) -> bool:
        return self.arena.unpin(key)

    def touch(self, keys: Sequence[bytes]) -> None:
        self.arena.touch(keys)
        self.disk.touch(keys)

    def lru_candidates(self, limit: int) -> list[bytes]:
        return self.arena.lru_candidates(limit)

    def used_bytes(self) -> int:
        return self.arena.used_bytes()

    def committed_bytes(self) -> int:
        return self.arena.committed_bytes()

    def reserved_bytes(self) -> int:
        return self.arena.reserved_bytes()

    def stats(self) -> PoolStats:
        st = self.arena.stats()
        st.disk_capacity_bytes = self.disk.capacity_bytes
        st.disk_used_bytes = self.disk.used_bytes
        st.disk_blocks = len(self.disk)
        with self._lock:
            st.disk_hits = self.counters.disk_hits
        return st

    def close(self, *, purge: bool = False) -> None:
        """Close the arena; the disk tier keeps its files (queued demotions are written
        first) unless ``purge``."""
        if not purge:
            self._queue.flush(timeout_s=10.0)
        self._queue.close()
        self.arena.close()
        self.disk.close(remove=purge)

    def __enter__(self) -> TieredPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals ----------------------------------------------------------------------------

    def _lower_held(self, keys: Sequence[bytes]) -> list[bool]:
        on_disk = self.disk.held(keys)
        if not len(self._queue):
            return on_disk
        return [d or self._queue.pending(k) is not None for k, d in zip(keys, on_disk,
                                                                          strict=True)]

    def _count_hits(self, n: int) -> None:
        with self._lock:
            self.counters.disk_hits += n
        metrics.record_tier_hits("disk", n)

    def _on_written(self, key: bytes) -> None:
        with self._lock:
            gone = key in self._deleted_while_writing
            self._deleted_while_writing.discard(key)
        if gone:
            self.disk.delete(key)

    def _on_dropped(self, keys: list[bytes], reason: str) -> None:
        with self._lock:
            self.counters.drops[reason] = self.counters.drops.get(reason, 0) + len(keys)
            self._lost.extend(keys)
        metrics.record_tier_drops(reason, len(keys))
