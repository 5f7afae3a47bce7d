"""The embedded index: plain dicts behind one lock, for tests and in-process users.

One process, no server. The coordinator does not use it (it keeps its ``TableIndex``, which is
the LRU table itself); ``LocalStore`` and single-process benchmarks do.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.index.base import IndexEntry, InProcessMarker, KeyInfo
from kvstore.index.checks import check_entries, check_keys, check_node_id
from kvstore.records import PrefixHit


@dataclass(slots=True)
class _Meta:
    nbytes: int
    parent_key: bytes
    namespace_root: bytes
    last_use: float


class InMemoryIndex(InProcessMarker):
    """The embedded index: plain dicts behind one lock (every call is short and in memory)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders: dict[bytes, set[str]] = {}
        self._meta: dict[bytes, _Meta] = {}
        self._keys_by_node: dict[str, set[bytes]] = {}
        self._keys_by_namespace: dict[bytes, set[bytes]] = {}

    def publish(self, entries: Sequence[IndexEntry]) -> None:
        """Add holders; visible to every reader when it returns."""
        check_entries(entries)
        now = time.time()
        with self._lock:
            for e in entries:
                self._holders.setdefault(e.key, set()).add(e.node_id)
                old = self._meta.get(e.key)
                if old is not None and old.namespace_root != e.namespace_root:
                    self._drop_from_namespace(e.key, old.namespace_root)
                last_use = now if old is None else max(old.last_use, now)
                self._meta[e.key] = _Meta(e.nbytes, e.parent_key, e.namespace_root, last_use)
                self._keys_by_node.setdefault(e.node_id, set()).add(e.key)
                self._keys_by_namespace.setdefault(e.namespace_root, set()).add(e.key)

    def lookup_prefix(self, keys: Sequence[bytes]) -> PrefixHit:
        """Leading keys with a holder; stops at the first miss."""
        check_keys(keys)
        found: list[list[str]] = []
        with self._lock:
            for k in keys:
                h = self._holders.get(k)
                if not h:
                    break
                found.append(sorted(h))
        return PrefixHit(num_blocks=len(found), holders=found)

    def holders(self, keys: Sequence[bytes]) -> list[list[str]]:
        """The holders of each key."""
        check_keys(keys)
        with self._lock:
            return [sorted(self._holders.get(k, ())) for k in keys]

    def info(self, keys: Sequence[bytes]) -> list[KeyInfo | None]:
        """Everything known about each key."""
        check_keys(keys)
        out: list[KeyInfo | None] = []
        with self._lock:
            for k in keys:
                m = self._meta.get(k)
                if m is None:
                    out.append(None)
                    continue
                out.append(KeyInfo(k, sorted(self._holders[k]), m.nbytes, m.parent_key,
                                   m.namespace_root, m.last_use))
        return out

    def touch(self, keys: Sequence[bytes], now: float | None = None) -> None:
        """Record a use; last use never moves backwards."""
        check_keys(keys)
        t = time.time() if now is None else float(now)
        with self._lock:
            for k in keys:
                m = self._meta.get(k)
                if m is not None and t > m.last_use:
                    m.last_use = t

    def remove(self, keys: Sequence[bytes], node_id: str) -> None:
        """``node_id`` no longer holds ``keys``."""
        check_keys(keys)
        check_node_id(node_id)
        with self._lock:
            for k in keys:
                self._remove_one(k, node_id)

    def drop_node(self, node_id: str) -> int:
        """Remove a node from every key it held."""
        check_node_id(node_id)
        with self._lock:
            keys = list(self._keys_by_node.get(node_id, ()))
            for k in keys:
                self._remove_one(k, node_id)
            return len(keys)

    def keys_of_node(self, node_id: str) -> list[bytes]:
        """The keys a node holds."""
        with self._lock:
            return sorted(self._keys_by_node.get(node_id, ()))

    def keys_of_namespace(self, namespace_root: bytes) -> list[bytes]:
        """The keys of one namespace."""
        with self._lock:
            return sorted(self._keys_by_namespace.get(namespace_root, ()))

    def nodes(self) -> list[str]:
        """Nodes holding at least one key."""
        with self._lock:
            return sorted(self._keys_by_node)

    def num_keys(self) -> int:
        """Keys with at least one holder."""
        with self._lock:
            return len(self._holders)

    def clear(self) -> None:
        """Forget everything."""
        with self._lock:
            self._holders.clear()
            self._meta.clear()
            self._keys_by_node.clear()
            self._keys_by_namespace.clear()

    def close(self) -> None:
        """Nothing to release; kept for the protocol."""

    def _remove_one(self, key: bytes, node_id: str) -> None:
        # Caller holds the lock. Empty containers are deleted so nodes() and num_keys() stay exact.
        h = self._holders.get(key)
        if h is None or node_id not in h:
            return
        h.discard(node_id)
        node_keys = self._keys_by_node[node_id]
        node_keys.discard(key)
        if not node_keys:
            del self._keys_by_node[node_id]
        if not h:
            del self._holders[key]
            self._drop_from_namespace(key, self._meta.pop(key).namespace_root)

    def _drop_from_namespace(self, key: bytes, root: bytes) -> None:
        ns_keys = self._keys_by_namespace.get(root)
        if ns_keys is not None:
            ns_keys.discard(key)
            if not ns_keys:
                del self._keys_by_namespace[root]
