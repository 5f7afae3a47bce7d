"""The embedded index as one compact table: ``Index`` answered from the coordinator's LRUTable.

In memory mode the table *is* the index, so the coordinator keeps every block once, not in
its LRU table and again in an ``InMemoryIndex`` of dicts and sets: holders are its holder sets
(node ids map to node slots in a registry of up to ``MAX_NODES``), size, parent, namespace
root and last use are its columns, so each block costs one table row and no Python object.

Node slots (``_bits`` and ``bit`` in the code: a slot number, not a bit position): a node
keeps its slot from its first publish (or ``claim_node``) until ``drop_node``, so the
coordinator can use it as its node slot; the lowest free slot is taken first, and a slot
whose node holds nothing and was never claimed is recycled when all ``max_nodes`` are taken.

Keys are 32 bytes (sha256 block keys): other lengths are rejected with a ``KVStoreError``
instead of being silently never found.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Iterable, Sequence

import numpy as np

from kvstore.constants import KEY_NBYTES
from kvstore.coordinator.holders import decode
from kvstore.coordinator.lru import MAX_NODES, LRUTable
from kvstore.errors import KVStoreError
from kvstore.index.base import IndexEntry, InProcessMarker, KeyInfo
from kvstore.index.checks import check_entries, check_keys, check_node_id, entry_columns
from kvstore.records import PrefixHit

#: distinct holder codes whose sorted node-id tuple is cached (one per replica set in use)
_MAX_CACHED_MASKS = 4096


def check_table_keys(keys: Sequence[bytes]) -> None:
    """Keys are 32-byte bytes; checked with C-speed map/set (this is every lookup's path)."""
    _check_types(keys)
    if set(map(len, keys)) - {KEY_NBYTES}:
        check_keys(keys)  # an empty key is a TypeError, as on the other backends
        raise KVStoreError(f"block keys are {KEY_NBYTES} bytes (sha256), got keys of "
                           f"{sorted(set(map(len, keys)) - {KEY_NBYTES})} bytes")


def _check_types(keys: Sequence[bytes]) -> None:
    if isinstance(keys, (bytes, str)) or set(map(type, keys)) - {bytes}:
        check_keys(keys)  # raises the precise TypeError


class TableIndex(InProcessMarker):
    """``kvstore.index.base.Index`` over one ``LRUTable``: every block stored once, compactly."""

    def __init__(self, table: LRUTable | None = None, max_nodes: int = MAX_NODES) -> None:
        if not 0 < max_nodes <= MAX_NODES:
            raise ValueError(f"max_nodes must be in 1..{MAX_NODES}, got {max_nodes}")
        self.table = LRUTable() if table is None else table
        self.max_nodes = max_nodes
        # Re-entrant: the coordinator takes it around calls that also enter the index.
        self.lock = threading.RLock()
        self._bits: dict[str, int] = {}
        self._names: list[str | None] = []  # by slot; grows up to max_nodes
        self._free: list[int] = []  # released slots, a min-heap: the lowest is reused first
        self._claimed: set[int] = set()  # slots the coordinator uses as node slots: kept
        self._mask_names: dict[int, tuple[str, ...]] = {}

    # -- node bits -------------------------------------------------------------------------

    def claim_node(self, node_id: str) -> int:
        """The node's bit, allocated if new and kept until ``drop_node`` (a node slot)."""
        check_node_id(node_id)
        with self.lock:
            bit = self._bit(node_id)
            self._claimed.add(bit)
            return bit

    def _bit(self, node_id: str) -> int:
        bit = self._bits.get(node_id)
        if bit is not None:
            return bit
        if not self._free and len(self._names) >= self.max_nodes:
            # recycle slots of nodes that hold nothing and nobody claimed
            busy = set(self.table.live_nodes()) | self._claimed
            for b, name in enumerate(self._names):
                if b not in busy and name is not None:
                    self._release(name)
        if self._free:
            bit = heapq.heappop(self._free)
            self._names[bit] = node_id
        elif len(self._names) < self.max_nodes:
            bit = len(self._names)
            self._names.append(node_id)
        else:
            raise KVStoreError(f"the index tracks at most {self.max_nodes} store nodes; "
                               "drain or remove one first")
        self._bits[node_id] = bit
        self._mask_names.clear()
        return bit

    def _release(self, node_id: str) -> None:
        bit = self._bits.pop(node_id)
        self._names[bit] = None
        heapq.heappush(self._free, bit)
        self._claimed.discard(bit)
        self._mask_names.clear()

    def _slots(self, keys: Sequence[bytes]) -> np.ndarray:
        """Slot per key (-1 if unknown); the table checks the lengths as it packs them."""
        _check_types(keys)
        try:
            return self.table.lookup(keys)
        except KVStoreError:
            check_keys(keys)  # an empty key is a TypeError, as on the other backends
            raise

    def _names_of(self, bits: Iterable[int]) -> tuple[str, ...]:
        names = self._names
        return tuple(sorted(n for n in map(names.__getitem__, bits) if n is not None))

    def _holder_lists(self, slots: np.ndarray, known: bool = False) -> list[list[str]]:
        """Sorted node ids per slot (-1: none, unless ``known``); one fresh list per key (the
        reply owns it)."""
        cache = self._mask_names
        if len(cache) > _MAX_CACHED_MASKS:
            cache.clear()
        sets = self.table.sets
        codes = sets.codes[slots]
        codes = (codes if known else np.where(slots >= 0, codes, 0)).tolist()
        for c in set(codes).difference(cache):  # a chain has one or two distinct codes
            cache[c] = self._names_of(decode(c))
        out = list(map(list, map(cache.__getitem__, codes)))  # C loops, no per-key bytecode
        for i in sets.spilled_rows(slots):  # more than four holders: rare, listed one by one
            out[i] = list(self._names_of(sets.holders_of(int(slots[i]))))
        return out

    # -- the Index protocol ----------------------------------------------------------------

    def publish(self, entries: Sequence[IndexEntry]) -> None:
        """Add holders; visible to every reader when it returns."""
        cols = entry_columns(entries, KEY_NBYTES)  # checked in a few C loops, if all is well
        if cols is None:
            check_entries(entries)  # entry by entry: the first bad one raises its own error
            for e in entries:
                check_table_keys([e.key, e.parent_key, e.namespace_root])
        elif len(set(cols[3])) == 1:  # one node's batch (every put's): no regrouping
            keys, parents, roots, nodes, sizes = cols
            now = time.time()
            with self.lock:
                self.table.add(self._bit(nodes[0]), keys, parents, sizes, roots, now=now)
            return
        now = time.time()
        by_node: dict[str, list[IndexEntry]] = {}
        for e in entries:
            by_node.setdefault(e.node_id, []).append(e)
        with self.lock:
            bits = {n: self._bit(n) for n in by_node}  # may fail: before anything is written
            for node_id, es in by_node.items():
                self.table.add(bits[node_id], [e.key for e in es], [e.parent_key for e in es],
                               [e.nbytes for e in es], [e.namespace_root for e in es], now=now)

    def lookup_prefix(self, keys: Sequence[bytes]) -> PrefixHit:
        """Leading keys with a holder, found in one vectorised probe of the table."""
        with self.lock:
            slots = self._slots(keys)
            missing = np.flatnonzero(slots < 0)
            n = int(missing[0]) if missing.size else len(slots)
            found = self._holder_lists(slots[:n], known=True)
        return PrefixHit(num_blocks=n, holders=found)

    def holders(self, keys: Sequence[bytes]) -> list[list[str]]:
        """The holders of each key (empty list for an unknown key)."""
        with self.lock:
            slots = self._slots(keys)
            return self._holder_lists(slots)

    def info(self, keys: Sequence[bytes]) -> list[KeyInfo | None]:
        """Everything known about each key, ``None`` for an unknown key."""
        t = self.table
        with self.lock:
            slots = self._slots(keys)
            known = slots[slots >= 0]
            holders = iter(self._holder_lists(known, known=True))
            out: list[KeyInfo | None] = []
            for key, s in zip(keys, slots.tolist(), strict=True):
                if s < 0:
                    out.append(None)
                    continue
                out.append(KeyInfo(key, next(holders), int(t.nbytes[s]), t.parent[s].tobytes(),
                                   t.roots[int(t.root[s])], float(t.used_at[s])))
            return out

    def touch(self, keys: Sequence[bytes], now: float | None = None) -> None:
        """Record a use (LRU order and wall-clock last use); unknown keys are ignored."""
        check_table_keys(keys)
        with self.lock:
            self.table.touch(keys, time.time() if now is None else float(now))

    def remove(self, keys: Sequence[bytes], node_id: str) -> None:
        """``node_id`` no longer holds ``keys``; a key left without holders disappears."""
        check_table_keys(keys)
        check_node_id(node_id)
        with self.lock:
            bit = self._bits.get(node_id)
            if bit is not None:
                self.table.remove(bit, keys)

    def drop_node(self, node_id: str) -> int:
        """Forget a node that left (its bit is free again); returns how many keys it held."""
        check_node_id(node_id)
        with self.lock:
            bit = self._bits.get(node_id)
            if bit is None:
                return 0
            num = self.table.drop_node(bit)
            self._release(node_id)
            return num

    def keys_of_node(self, node_id: str) -> list[bytes]:
        """The keys a node holds."""
        with self.lock:
            bit = self._bits.get(node_id)
            return [] if bit is None else sorted(self.table.keys_of(bit))

    def keys_of_namespace(self, namespace_root: bytes) -> list[bytes]:
        """The keys of one namespace."""
        with self.lock:
            return sorted(self.table.namespace_keys(namespace_root))

    def nodes(self) -> list[str]:
        """The nodes that hold at least one key."""
        with self.lock:
            return sorted(n for n in map(self._names.__getitem__, self.table.live_nodes())
                          if n is not None)

    def num_keys(self) -> int:
        """How many keys have at least one holder."""
        return self.table.num_blocks

    def clear(self) -> None:
        """Forget everything, in place (the coordinator shares the table)."""
        with self.lock:
            self.table.clear()
            self._bits.clear()
            self._names = []
            self._free = []
            self._claimed = set()
            self._mask_names.clear()

    def close(self) -> None:
        """Nothing to release; kept for the protocol."""
