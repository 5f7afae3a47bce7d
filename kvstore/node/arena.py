"""A node's block memory: one preallocated shared-memory file and an extent allocator over it.

The arena is a single file in ``/dev/shm`` (tmpfs), mapped once and pre-faulted, so a put on
the hot path only copies bytes: no malloc, no page fault, no syscall. Because it is a file,
another process on the same node can map it read-only (``kvstore.client.shm_reader``) and copy a
leased block without a socket in between.

::

    arena file (capacity_bytes, a multiple of ALIGN)
    +---------+---------+-----------------+---------+------------------------------+
    | block a | block b | free (coalesced)| block c |        free                  |
    +---------+---------+-----------------+---------+------------------------------+
    ^ offset 0, every extent starts on a 64-byte boundary (ALIGN)

The allocator is best fit over coalesced free extents with an exact-size index: blocks of one
namespace all have the same size, so a freed slot is reused in O(1) by the next block of that
namespace, while mixed sizes still work (fragmentation can only make an allocation fail, never
corrupt or over-commit memory).
"""

from __future__ import annotations

import mmap
import os
import secrets
import weakref

from kvstore.constants import align_up
from kvstore.node.arena_files import owned_name

_PAGE = mmap.PAGESIZE


class ExtentAllocator:
    """Best-fit allocation of aligned extents in ``[0, capacity)``; the caller holds the lock."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free_bytes = capacity
        self._free_by_offset: dict[int, int] = {}  # offset -> size
        self._free_by_end: dict[int, int] = {}  # end -> offset, to coalesce with the left side
        self._offsets_by_size: dict[int, set[int]] = {}  # exact-fit index
        if capacity > 0:
            self._add(0, capacity)

    @property
    def num_free_extents(self) -> int:
        return len(self._free_by_offset)

    def largest_free(self) -> int:
        """The biggest allocation that could succeed now."""
        return max(self._free_by_offset.values(), default=0)

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a new extent of ``align_up(nbytes)`` bytes, or None if none fits."""
        size = align_up(nbytes)
        exact = self._offsets_by_size.get(size)
        if exact:
            offset = min(exact)  # low offsets first keeps the tail of the arena in one piece
            self._remove(offset, size)
            self.free_bytes -= size
            return offset
        best_offset, best_size = -1, 0
        for offset, extent in self._free_by_offset.items():
            if extent >= size and (best_offset < 0 or extent < best_size):
                best_offset, best_size = offset, extent
        if best_offset < 0:
            return None
        self._remove(best_offset, best_size)
        if best_size > size:
            self._add(best_offset + size, best_size - size)
        self.free_bytes -= size
        return best_offset

    def free(self, offset: int, nbytes: int) -> None:
        """Return an extent, merging it with free neighbours."""
        size = align_up(nbytes)
        self.free_bytes += size
        start, end = offset, offset + size
        right = self._free_by_offset.get(end)
        if right is not None:
            self._remove(end, right)
            end += right
        left = self._free_by_end.get(start)
        if left is not None:
            self._remove(left, start - left)
            start = left
        self._add(start, end - start)

    def _add(self, offset: int, size: int) -> None:
        self._free_by_offset[offset] = size
        self._free_by_end[offset + size] = offset
        self._offsets_by_size.setdefault(size, set()).add(offset)

    def _remove(self, offset: int, size: int) -> None:
        del self._free_by_offset[offset]
        del self._free_by_end[offset + size]
        bucket = self._offsets_by_size[size]
        bucket.discard(offset)
        if not bucket:
            del self._offsets_by_size[size]


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class Arena:
    """One shared-memory file of ``capacity`` bytes, mapped read-write and pre-faulted."""

    def __init__(self, capacity: int, shm_dir: str = "/dev/shm", name: str | None = None) -> None:
        if capacity <= 0:
            raise ValueError(f"arena capacity must be > 0 bytes, got {capacity}")
        if not os.path.isdir(shm_dir):
            raise ValueError(f"shm_dir {shm_dir!r} is not a directory (use /dev/shm on Linux)")
        self.capacity = align_up(capacity)
        # Named after its owner (kvstore.node.arena_files), so the file left by a crash is
        # found and removed by the next kvstore command.
        name = name or owned_name(secrets.token_hex(8))
        self.path = os.path.join(shm_dir, name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        # Unlink even if the owner forgets close() or crashes between here and close().
        self._finalizer = weakref.finalize(self, _unlink_quietly, self.path)
        try:
            try:
                # Reserve tmpfs pages now: a too-small /dev/shm fails here, not with SIGBUS later.
                os.posix_fallocate(fd, 0, self.capacity)
            except OSError as exc:
                raise ValueError(
                    f"cannot allocate a {self.capacity}-byte arena in {shm_dir}: {exc}; "
                    "lower pool.capacity_bytes or enlarge the shm filesystem"
                ) from exc
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self.mm = mmap.mmap(fd, self.capacity, flags=flags)
        except BaseException:
            self._finalizer()
            raise
        finally:
            os.close(fd)
        if not hasattr(mmap, "MAP_POPULATE"):
            self._touch_pages()
        self.view = memoryview(self.mm)

    def _touch_pages(self) -> None:
        """Fault every page in once, where MAP_POPULATE is not available."""
        for off in range(0, self.capacity, _PAGE):
            self.mm[off] = 0

    def close(self) -> None:
        """Unmap and unlink; views still held elsewhere keep the mapping alive until dropped."""
        self.view.release()
        try:
            self.mm.close()
        except BufferError:
            pass  # an outstanding export (a caller's view) pins the mapping; GC unmaps it
        self._finalizer()
