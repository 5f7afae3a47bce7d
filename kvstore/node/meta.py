"""What a store node remembers about each block it holds: its parent key and namespace root.

The index needs both to re-announce a block, and every read needs the root: the node serves a
block only to readers of its namespace (``kvstore.node.access``). Both come from the block's
header, which the Put path has already parsed; a block with no entry (the cache may be
cleared) has its header read once, on demand.

Ordering matters for tenants: a key can be evicted and stored again by another writer, so the
Put path drops a key's entry *before* committing it and records the new one after; a read in
between finds no entry and reads the header of whatever the pool holds then. A stale root can
therefore never stand for a block stored since.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvstore.block import read_header
from kvstore.errors import BlockCorrupted, BlockNotFound
from kvstore.node.block_pool import ServedPool


class BlockMeta:
    """key -> (parent key, namespace root) for the blocks of one pool; thread-safe."""

    def __init__(self, pool: ServedPool) -> None:
        self.pool = pool
        self._meta: dict[bytes, tuple[bytes, bytes]] = {}
        self._lock = threading.Lock()

    def remember(self, key: bytes, parent_key: bytes, namespace_root: bytes) -> None:
        with self._lock:
            self._meta[key] = (parent_key, namespace_root)

    def remember_many(self, keys_and_parents: Sequence[tuple[bytes, bytes]],
                      namespace_root: bytes) -> None:
        with self._lock:
            for key, parent_key in keys_and_parents:
                self._meta[key] = (parent_key, namespace_root)

    def forget(self, key: bytes) -> None:
        with self._lock:
            self._meta.pop(key, None)

    def forget_many(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                self._meta.pop(key, None)

    def cached_root(self, key: bytes) -> bytes | None:
        """The root remembered for ``key``, or None (then the header is the authority)."""
        with self._lock:
            meta = self._meta.get(key)
        return None if meta is None else meta[1]

    def get(self, key: bytes) -> tuple[bytes, bytes] | None:
        """``(parent_key, namespace_root)`` of a held block (its header read once if not
        remembered), or None when the pool does not hold it or it cannot be parsed."""
        with self._lock:
            meta = self._meta.get(key)
        if meta is not None:
            return meta
        if not self.pool.contains(key):  # absent: no read (it would count a pool miss)
            return None
        try:
            with self.pool.read(key) as view:
                header = read_header(view)
        except (BlockNotFound, BlockCorrupted):
            return None
        meta = (header.parent_key, header.namespace_root)
        with self._lock:
            self._meta.setdefault(key, meta)
        return meta

    def roots_of(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Each key's namespace root (None: not held), one lock hold for the remembered ones."""
        with self._lock:
            got = [self._meta.get(k) for k in keys]
        out: list[bytes | None] = []
        for key, meta in zip(keys, got, strict=True):
            if meta is None:
                meta = self.get(key)
            out.append(None if meta is None else meta[1])
        return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._meta)
