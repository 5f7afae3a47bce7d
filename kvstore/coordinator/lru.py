"""The cluster LRU: a compact table of every indexed block and the eviction planner.

The coordinator tracks every block in the cluster, so a Python object per block (a dict of
32-byte keys alone costs ~205 B per entry) would not scale. Instead every fixed-width field lives
in one numpy array indexed by a *slot*, and keys map to slots through an open-addressing table
of int32 (linear probing, tombstones) that is probed for a whole batch at once:

    table[hash & mask] -> slot       keys[slot]     32 B  the block key (sha256, so its first
                                                          8 bytes are already a good hash)
                                     holders[slot]  8 B   bit i = node slot i holds it
                                     nbytes[slot]   8 B
                                     parent[slot]   32 B  the parent key
                                     root[slot]     4 B   namespace root id (see roots)
                                     last_use[slot] 8 B   logical clock, larger = more recent
                                     used_at[slot]  8 B   wall-clock last use (the index's)
                                     hits[slot]     4 B   touches, for the top-prefixes view
                                     pin[slot]      1 B   PIN_NONE / PIN_SOFT / PIN_HARD

The table is the whole embedded index (``kvstore.coordinator.table_index.TableIndex``), so it
keeps the full parent key and namespace root that ``Index.info`` returns. Namespaces are few: a
root is stored once in ``roots`` and each block holds its 4-byte id. Parents are referenced by
key, not by slot, so a parent can arrive after its child or be freed without leaving a dangling
slot behind; the planner links them by fingerprint, and a (2^-64) fingerprint collision can only
change eviction order, never which bytes a reader gets.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstore.constants import KEY_NBYTES
from kvstore.errors import KVStoreError

MAX_NODES = 64  # holders is one uint64 bitmask per block

PIN_NONE = 0
PIN_SOFT = 1
PIN_HARD = 2

_EMPTY = -1
_ROW = np.dtype("V32")  # one key row as a single value: a row compare is one numpy op
_TOMB = -2


def fingerprint(key: bytes) -> int:
    """The uint64 the table hashes and links parents by: the key's first 8 bytes."""
    return int.from_bytes(key[:8], "little")


def _pack(keys: Sequence[bytes]) -> np.ndarray:
    """Keys as a ``[n, 4]`` uint64 array (one row per 32-byte key), validating lengths."""
    lengths = set(map(len, keys))  # map/set run in C: this check is on the touch hot path
    if lengths - {KEY_NBYTES}:
        bad = sorted(lengths - {KEY_NBYTES})
        raise KVStoreError(f"block keys are {KEY_NBYTES} bytes (sha256), got keys of {bad} bytes")
    if not keys:
        return np.zeros((0, 4), dtype=np.uint64)
    return np.frombuffer(b"".join(keys), dtype=np.uint64).reshape(len(keys), 4)


@dataclass(slots=True)
class Candidate:
    """Why a block was chosen: kept for tests and the status view."""

    key: bytes
    nbytes: int
    pinned: bool


class LRUTable:
    """Every indexed block with its holders, size, parent, last use and pin state."""

    def __init__(self, initial_capacity: int = 1024) -> None:
        self._initial_capacity = initial_capacity
        self.clear()

    def clear(self) -> None:
        """Forget every block, in place (the coordinator and its index share this object)."""
        cap = max(16, 1 << (self._initial_capacity - 1).bit_length())
        self._alloc(cap)
        self._table = np.full(cap * 2, _EMPTY, dtype=np.int32)
        self._num_tombs = 0
        self._next_slot = 0
        self._free = array("i")
        self._clock = 0
        self.num_blocks = 0
        #: namespace roots by id; id 0 is "unknown" (no root given and no parent to inherit)
        self.roots: list[bytes] = [b""]
        self._root_ids: dict[bytes, int] = {}

    # -- storage ---------------------------------------------------------------------------

    def _alloc(self, cap: int) -> None:
        self.keys = np.zeros((cap, 4), dtype=np.uint64)
        self.holders = np.zeros(cap, dtype=np.uint64)
        self.nbytes = np.zeros(cap, dtype=np.int64)
        self.parent = np.zeros((cap, 4), dtype=np.uint64)
        self.root = np.zeros(cap, dtype=np.uint32)
        self.last_use = np.zeros(cap, dtype=np.int64)
        self.used_at = np.zeros(cap, dtype=np.float64)
        self.hits = np.zeros(cap, dtype=np.uint32)
        self.pin = np.zeros(cap, dtype=np.uint8)

    _COLUMNS = ("keys", "holders", "nbytes", "parent", "root", "last_use", "used_at", "hits",
                "pin")

    def _grow_slots(self) -> None:
        old = {n: getattr(self, n) for n in self._COLUMNS}
        # 1.5x, not 2x: right after a growth up to a third of the slots sit unused, not half
        self._alloc(len(self.holders) * 3 // 2)
        for name, arr in old.items():
            getattr(self, name)[: len(arr)] = arr

    def nbytes_used(self) -> int:
        """Bytes of the arrays and the hash table (what the table itself costs)."""
        arrays = [getattr(self, n) for n in self._COLUMNS] + [self._table]
        return sum(a.nbytes for a in arrays) + self._free.itemsize * len(self._free)

    # -- the hash table --------------------------------------------------------------------

    def _find(self, packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Slot (or -1) of each packed key, and its table position (meaningful where found).

        The whole batch probes together. At most half full, most keys sit at their home
        position, so the first round is written without sub-indexing and compares whole
        32-byte rows as one void value (a handful of numpy calls: this is every lookup's
        path); only keys that collided go round the loop.
        """
        mask = len(self._table) - 1
        rows = self.keys.view(_ROW)[:, 0]
        want = packed.view(_ROW)[:, 0]
        pos = (packed[:, 0] & np.uint64(mask)).astype(np.int64)
        s = self._table[pos].astype(np.int64)
        # s == -1 reads the last row: a harmless compare, masked out by s >= 0
        match = (rows[s] == want) & (s >= 0)
        slots = np.where(match, s, -1)
        active = np.flatnonzero(~match & (s != _EMPTY))
        while active.size:
            pos[active] = (pos[active] + 1) & mask
            p = pos[active]
            s = self._table[p].astype(np.int64)
            match = (rows[s] == want[active]) & (s >= 0)
            slots[active[match]] = s[match]
            active = active[~match & (s != _EMPTY)]
        return slots, pos

    def _place(self, packed: np.ndarray, slots: np.ndarray) -> None:
        """Put absent, distinct keys into the table (first free position along each probe)."""
        mask = len(self._table) - 1
        pos = (packed[:, 0] & np.uint64(mask)).astype(np.int64)
        active = np.arange(len(packed))
        while active.size:
            p = pos[active]
            free = self._table[p] < 0
            cand, pc = active[free], p[free]
            won_pos, first = np.unique(pc, return_index=True)  # one key per free position
            winners = cand[first]
            self._num_tombs -= int((self._table[won_pos] == _TOMB).sum())
            self._table[won_pos] = slots[winners]
            keep = np.ones(active.size, dtype=bool)
            keep[np.flatnonzero(free)[first]] = False
            active = active[keep]
            pos[active] = (pos[active] + 1) & mask

    def _rehash(self, table_size: int) -> None:
        self._table = np.full(table_size, _EMPTY, dtype=np.int32)
        self._num_tombs = 0
        live = np.flatnonzero(self.holders[: self._next_slot] != 0)
        if live.size:
            self._place(self.keys[live], live)

    def _reserve(self, n: int) -> None:
        """Keep the table at most half full (counting tombstones) after adding ``n`` keys."""
        need = (self.num_blocks + n) * 2
        if need > len(self._table):
            size = len(self._table)
            while size < need:
                size *= 2
            self._rehash(size)
        elif (self.num_blocks + n + self._num_tombs) * 2 > len(self._table):
            self._rehash(len(self._table))

    def _new_slots(self, n: int) -> np.ndarray:
        reuse = min(n, len(self._free))
        out = np.empty(n, dtype=np.int64)
        if reuse:
            out[:reuse] = self._free[len(self._free) - reuse:]
            del self._free[len(self._free) - reuse:]
        fresh = n - reuse
        while self._next_slot + fresh > len(self.holders):
            self._grow_slots()
        out[reuse:] = np.arange(self._next_slot, self._next_slot + fresh)
        self._next_slot += fresh
        return out

    def _release(self, slots: np.ndarray, where: np.ndarray) -> None:
        """Forget blocks nobody holds any more."""
        if not slots.size:
            return
        self._table[where] = _TOMB
        self._num_tombs += int(slots.size)
        self.holders[slots] = 0
        self.hits[slots] = 0
        self.pin[slots] = PIN_NONE
        self._free.extend(slots.astype(np.int32).tolist())
        self.num_blocks -= int(slots.size)

    def _tick(self, n: int) -> np.ndarray:
        stamps = np.arange(self._clock + 1, self._clock + 1 + n, dtype=np.int64)
        self._clock += n
        return stamps

    # -- public operations -----------------------------------------------------------------

    def lookup(self, keys: Sequence[bytes]) -> np.ndarray:
        """Slot of each key, -1 where the table does not know it."""
        return self._find(_pack(keys))[0]

    def add(self, node: int, keys: Sequence[bytes], parents: Sequence[bytes | None],
            nbytes: Sequence[int], roots: Sequence[bytes | None] | None = None,
            now: float = 0.0) -> int:
        """Record that node slot ``node`` holds ``keys``; returns how many were new to it.

        ``roots`` gives the namespace root where known; otherwise it is inherited from the
        parent (a chain is published in order) or, for a block whose parent is unknown, the
        parent itself is taken as the root (the first block of a chain).
        """
        if not keys:
            return 0
        packed = _pack(keys)
        # one row per distinct key: a batch may repeat a key
        _, first = np.unique(packed, axis=0, return_index=True)
        first.sort()
        packed = packed[first]
        keys = [keys[i] for i in first]
        parents = [parents[i] for i in first]
        nbytes = [nbytes[i] for i in first]
        root_list = None if roots is None else [roots[i] for i in first]
        self._reserve(len(keys))
        slots, _ = self._find(packed)
        missing = np.flatnonzero(slots < 0)
        if missing.size:
            new = self._new_slots(missing.size)
            self.keys[new] = packed[missing]
            self._place(packed[missing], new)
            slots[missing] = new
            self.num_blocks += int(missing.size)
            self.holders[new] = 0
            self.last_use[new] = 0
            self.used_at[new] = 0.0
        bit = np.uint64(1 << node)
        newly = int(((self.holders[slots] & bit) == 0).sum())
        self.holders[slots] |= bit
        self.nbytes[slots] = np.asarray(nbytes, dtype=np.int64)
        packed_parents = _pack([p if p else bytes(KEY_NBYTES) for p in parents])
        self.parent[slots] = packed_parents
        self.last_use[slots] = self._tick(len(keys))
        self.used_at[slots] = np.maximum(self.used_at[slots], now)
        self._assign_roots(keys, slots, parents, packed_parents, root_list)
        return newly

    def _root_id(self, root: bytes) -> int:
        rid = self._root_ids.get(root)
        if rid is None:
            rid = self._root_ids[root] = len(self.roots)
            self.roots.append(root)
        return rid

    def _assign_roots(self, keys: Sequence[bytes], slots: np.ndarray,
                      parents: Sequence[bytes | None], packed_parents: np.ndarray,
                      roots: Sequence[bytes | None] | None) -> None:
        if roots is not None and all(roots):  # the index always knows: no inference needed
            self.root[slots] = [self._root_id(r) for r in roots]  # type: ignore[arg-type]
            return
        pslots = self._find(packed_parents)[0]
        in_batch: dict[bytes, int] = {}
        for i, key in enumerate(keys):
            given = roots[i] if roots is not None else None
            parent = parents[i]
            if given:
                rid = self._root_id(given)
            elif parent and parent in in_batch:
                rid = in_batch[parent]
            elif pslots[i] >= 0:
                rid = int(self.root[pslots[i]])
            elif parent:  # the first block of a chain: its parent is the namespace root
                rid = self._root_id(parent)
            else:
                rid = 0
            self.root[slots[i]] = rid
            in_batch[key] = rid

    def touch(self, keys: Sequence[bytes], now: float | None = None) -> int:
        """Mark keys used now (in order: the last one is the most recent); unknown keys are
        ignored. ``now`` (wall clock) only moves ``used_at`` forward. Returns how many were
        known."""
        if not keys:
            return 0
        slots = self._find(_pack(keys))[0]
        known = slots >= 0
        slots = slots[known]
        self.last_use[slots] = self._tick(len(keys))[known]
        if now is not None:
            self.used_at[slots] = np.maximum(self.used_at[slots], now)
        np.add.at(self.hits, slots, 1)
        return int(slots.size)

    def remove(self, node: int, keys: Sequence[bytes]) -> int:
        """Node slot ``node`` no longer holds ``keys``; returns how many it did hold."""
        if not keys:
            return 0
        slots, where = self._find(_pack(keys))
        ok = slots >= 0
        slots, where = slots[ok], where[ok]
        slots, first = np.unique(slots, return_index=True)
        where = where[first]
        bit = np.uint64(1 << node)
        held = (self.holders[slots] & bit) != 0
        self.holders[slots] &= ~bit
        gone = self.holders[slots] == 0
        self._release(slots[gone], where[gone])
        return int(held.sum())

    def _slots_of(self, node: int) -> np.ndarray:
        bit = np.uint64(1 << node)
        return np.flatnonzero(self.holders[: self._next_slot] & bit)

    def drop_node(self, node: int) -> int:
        """Forget node slot ``node`` everywhere (it died or left); returns its block count."""
        slots = self._slots_of(node)
        self.holders[slots] &= ~np.uint64(1 << node)
        gone = slots[self.holders[slots] == 0]
        if gone.size:
            where = self._find(self.keys[gone])[1]
            self._release(gone, where)
        return int(slots.size)

    def key_of(self, slots: np.ndarray) -> list[bytes]:
        """The keys stored in ``slots``."""
        return [row.tobytes() for row in self.keys[slots]]

    def keys_of(self, node: int) -> list[bytes]:
        """Every key node slot ``node`` holds."""
        return self.key_of(self._slots_of(node))

    def node_bytes(self, node: int) -> int:
        """Bytes of the blocks the table thinks node slot ``node`` holds."""
        return int(self.nbytes[self._slots_of(node)].sum())

    def holder_masks(self, keys: Sequence[bytes]) -> np.ndarray:
        """Holder bitmask per key (0 for unknown keys)."""
        slots = self.lookup(keys)
        out = np.zeros(len(keys), dtype=np.uint64)
        ok = slots >= 0
        out[ok] = self.holders[slots[ok]]
        return out

    def set_pin(self, keys: Sequence[bytes], level: int) -> int:
        """Set the pin level of known keys; returns how many were known."""
        slots = self.lookup(keys)
        slots = slots[slots >= 0]
        self.pin[slots] = level
        return int(slots.size)

    def namespace_keys(self, root: bytes) -> list[bytes]:
        """Every known key whose chain starts at namespace ``root``."""
        rid = self._root_ids.get(root)
        if rid is None:
            return []
        n = self._next_slot
        slots = np.flatnonzero((self.root[:n] == rid) & (self.holders[:n] != 0))
        return self.key_of(slots)

    def live_holders(self) -> int:
        """OR of every block's holder mask: the node slots that hold at least one block."""
        return int(np.bitwise_or.reduce(self.holders[: self._next_slot], initial=0))

    def top(self, k: int) -> list[tuple[bytes, int]]:
        """The ``k`` most touched blocks with their touch counts."""
        n = self._next_slot
        hits = np.where(self.holders[:n] != 0, self.hits[:n], 0)
        if not n:
            return []
        k = min(k, n)
        idx = np.argpartition(-hits.astype(np.int64), k - 1)[:k]
        idx = idx[np.argsort(-hits[idx].astype(np.int64), kind="stable")]
        return [(self.keys[i].tobytes(), int(hits[i])) for i in idx if hits[i] > 0]

    def plan(self, node: int, nbytes_to_free: int, exclude: Sequence[bytes] = ()) -> list[bytes]:
        """Keys node slot ``node`` should evict to free ``nbytes_to_free`` bytes.

        Least recently used first; a block whose child is on the same node waits until the
        child is chosen (evicting a parent would orphan the chain); hard pins never; soft pins
        only when nothing unpinned is left. Children are counted over *every* block the node
        holds: a hard-pinned or excluded child is never chosen, so its ancestors stay too.
        """
        if nbytes_to_free <= 0:
            return []
        held = self._slots_of(node)
        if not held.size:
            return []
        eligible = self.pin[held] != PIN_HARD
        if exclude:
            skip = self.lookup(exclude)
            eligible &= ~np.isin(held, skip[skip >= 0])
        fps = self.keys[held, 0]
        order = np.argsort(fps, kind="stable")
        sorted_fps = fps[order]
        # children on this node per block: count held blocks whose parent is that block
        parents = self.parent[held, 0]
        pidx = np.minimum(np.searchsorted(sorted_fps, parents), sorted_fps.size - 1)
        has_parent = sorted_fps[pidx] == parents
        parent_pos = np.full(held.size, -1, dtype=np.int64)
        parent_pos[has_parent] = order[pidx[has_parent]]
        children = np.bincount(parent_pos[has_parent], minlength=held.size)
        soft = self.pin[held] == PIN_SOFT
        last = self.last_use[held]
        sizes = self.nbytes[held]
        ready = np.flatnonzero((children == 0) & eligible)
        heap = list(zip(soft[ready].tolist(), last[ready].tolist(), ready.tolist(), strict=True))
        heapq.heapify(heap)
        chosen: list[int] = []
        freed = 0
        while heap and freed < nbytes_to_free:
            _, _, i = heapq.heappop(heap)
            chosen.append(i)
            freed += int(sizes[i])
            p = int(parent_pos[i])
            if p >= 0:
                children[p] -= 1
                if children[p] == 0 and eligible[p]:
                    heapq.heappush(heap, (bool(soft[p]), int(last[p]), p))
        return self.key_of(held[np.asarray(chosen, dtype=np.int64)]) if chosen else []
