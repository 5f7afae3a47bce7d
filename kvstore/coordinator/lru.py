"""The cluster LRU: a compact table of every indexed block (its planner is ``planner.py``).

The coordinator tracks every block in the cluster, so a Python object per block (even a dict
entry per 32-byte key) would not scale. Instead every fixed-width field lives
in one numpy array indexed by a *slot*, and keys map to slots through an open-addressing table
of int32 (``slot_table.SlotHash``: linear probing, tombstones) probed for a whole batch at once:

    table[hash & mask] -> slot       keys[slot]     32 B  the block key (sha256, so its first
                                                          8 bytes are already a good hash)
                                     holders[slot]  8 B   up to 4 node slots inline, more
                                                          spilled (``holders.HolderSets``)
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

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np

from kvstore.constants import KEY_NBYTES, PIN_HARD, PIN_NONE, PIN_SOFT
from kvstore.coordinator.holders import MAX_NODES, HolderSets
from kvstore.coordinator.planner import plan_evictions
from kvstore.coordinator.slot_table import SlotHash
from kvstore.errors import KVStoreError

__all__ = ["MAX_NODES", "PIN_HARD", "PIN_NONE", "PIN_SOFT", "Candidate", "LRUTable",
           "fingerprint"]



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


def _distinct(keys: Sequence[bytes]) -> bool:
    """Whether no key repeats (a set in C: cheaper than sorting the packed rows)."""
    try:
        return len(set(keys)) == len(keys)
    except TypeError:  # unhashable (a bytearray): let the sort decide
        return False


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
        # slots need not be a power of two (only the hash table must): a table sized for
        # N blocks up front holds N rows, not up to 2N
        cap = max(16, self._initial_capacity)
        self._alloc(cap)
        self.sets = HolderSets(cap)
        #: which holders keep the block in their disk tier only (a subset of ``sets``): the
        #: arena plan passes them over, the disk plan takes only them
        self.disk = HolderSets(cap)
        self._hash = SlotHash(1 << (cap * 2 - 1).bit_length())
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
        self.nbytes = np.zeros(cap, dtype=np.int64)
        self.parent = np.zeros((cap, 4), dtype=np.uint64)
        self.root = np.zeros(cap, dtype=np.uint32)
        self.last_use = np.zeros(cap, dtype=np.int64)
        self.used_at = np.zeros(cap, dtype=np.float64)
        self.hits = np.zeros(cap, dtype=np.uint32)
        self.pin = np.zeros(cap, dtype=np.uint8)

    _COLUMNS = ("keys", "nbytes", "parent", "root", "last_use", "used_at", "hits", "pin")

    @property
    def holders(self) -> np.ndarray:
        """One uint64 code per slot: 0 = nobody holds it; equal codes = equal holder lists
        (see ``holders.HolderSets``; blocks with more than four holders also have a spill)."""
        return self.sets.codes

    def _grow_slots(self) -> None:
        old = {n: getattr(self, n) for n in self._COLUMNS}
        # 1.5x, not 2x: right after a growth up to a third of the slots sit unused, not half
        self._alloc(len(self.nbytes) * 3 // 2)
        for name, arr in old.items():
            getattr(self, name)[: len(arr)] = arr
        self.sets.grow(len(self.nbytes))
        self.disk.grow(len(self.nbytes))

    def nbytes_used(self) -> int:
        """Bytes of the arrays, holder sets and hash table (what the table itself costs)."""
        arrays = [getattr(self, n) for n in self._COLUMNS] + [self._hash.table]
        return (sum(a.nbytes for a in arrays) + self._free.itemsize * len(self._free)
                + self.sets.nbytes())

    # -- the hash table (``slot_table.SlotHash``) ------------------------------------------

    def _rehash(self, table_size: int) -> None:
        self._hash = SlotHash(table_size)
        live = np.flatnonzero(self.holders[: self._next_slot] != 0)
        if live.size:
            self._hash.place(self.keys[live], live)

    def _find(self, packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self._hash.find(self.keys, packed)

    def _reserve(self, n: int) -> None:
        """Keep the table at most half full (counting tombstones) after adding ``n`` keys."""
        need = (self.num_blocks + n) * 2
        if need > len(self._hash.table):
            size = len(self._hash.table)
            while size < need:
                size *= 2
            self._rehash(size)
        elif (self.num_blocks + n + self._hash.num_tombs) * 2 > len(self._hash.table):
            self._rehash(len(self._hash.table))

    def _new_slots(self, n: int) -> np.ndarray:
        reuse = min(n, len(self._free))
        out = np.empty(n, dtype=np.int64)
        if reuse:
            out[:reuse] = self._free[len(self._free) - reuse:]
            del self._free[len(self._free) - reuse:]
        fresh = n - reuse
        while self._next_slot + fresh > len(self.nbytes):
            self._grow_slots()
        out[reuse:] = np.arange(self._next_slot, self._next_slot + fresh)
        self._next_slot += fresh
        return out

    def _release(self, slots: np.ndarray, where: np.ndarray) -> None:
        """Forget blocks nobody holds any more."""
        if not slots.size:
            return
        self._hash.forget(where)
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
        if not _distinct(keys):  # one row per distinct key: a batch may repeat a key
            _, first = np.unique(packed, axis=0, return_index=True)
            first.sort()
            packed = packed[first]
            keys = [keys[i] for i in first]
            parents = [parents[i] for i in first]
            nbytes = [nbytes[i] for i in first]
            roots = None if roots is None else [roots[i] for i in first]
        root_list = roots
        self._reserve(len(keys))
        slots, _ = self._find(packed)
        missing = np.flatnonzero(slots < 0)
        if missing.size:
            new = self._new_slots(missing.size)
            self.keys[new] = packed[missing]
            self._hash.place(packed[missing], new)
            slots[missing] = new
            self.num_blocks += int(missing.size)
            self.sets.lanes[new] = 0
            self.disk.lanes[new] = 0
            self.last_use[new] = 0
            self.used_at[new] = 0.0
        newly = self.sets.hold(node, slots)
        if self.disk.num_held(node):  # stored again: in the node's arena now
            self.disk.unhold(node, np.unique(slots))
        self.nbytes[slots] = np.asarray(nbytes, dtype=np.int64)
        packed_parents = _pack([p if p else bytes(KEY_NBYTES) for p in parents]
                               if not all(parents) else parents)  # type: ignore[arg-type]
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
            # one id per distinct root, new ones numbered in order of first appearance
            known = cast(list[bytes], list(roots))
            ids = {r: self._root_id(r) for r in dict.fromkeys(known)}
            self.root[slots] = (ids[known[0]] if len(ids) == 1
                                else list(map(ids.__getitem__, known)))
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
        if self.disk.num_held(node):
            self.disk.unhold(node, slots)
        held = self.sets.unhold(node, slots)
        gone = self.holders[slots] == 0
        self._release(slots[gone], where[gone])
        return int(held.sum())

    def _slots_of(self, node: int, ordered: bool = True) -> np.ndarray:
        """Table slots node slot ``node`` holds, ascending: O(its blocks), no full scan.
        ``ordered=False`` (the planner) skips the sort: each slot once, in any order."""
        return self.sets.slots_of(node) if ordered else self.sets.held_slots(node)

    def num_blocks_of(self, node: int) -> int:
        """How many blocks node slot ``node`` holds."""
        return self.sets.num_held(node)

    def drop_node(self, node: int) -> int:
        """Forget node slot ``node`` everywhere (it died or left; the slot may be reused at
        once); returns its block count."""
        self.disk.drop(node)
        slots = self.sets.drop(node)
        gone = slots[self.holders[slots] == 0]
        if gone.size:
            where = self._find(self.keys[gone])[1]
            self._release(gone, where)
        return int(slots.size)

    def set_tier(self, node: int, keys: Sequence[bytes], on_disk: bool) -> int:
        """Node slot ``node`` keeps ``keys`` in its disk tier only (``on_disk``), or in its
        arena again; keys it does not hold are ignored. Returns how many changed."""
        if not keys:
            return 0
        slots = self.lookup(keys)
        slots = np.unique(slots[slots >= 0])
        slots = slots[self.sets.contains(node, slots)]
        if on_disk:
            return self.disk.hold(node, slots)
        if not self.disk.num_held(node):
            return 0
        return int(self.disk.unhold(node, slots).sum())

    def on_disk(self, node: int, slots: np.ndarray) -> np.ndarray:
        """Whether node slot ``node`` keeps each of ``slots`` (which it holds) on disk only."""
        if not self.disk.num_held(node):
            return np.zeros(len(slots), dtype=bool)
        return self.disk.contains(node, slots)

    def num_disk_blocks_of(self, node: int) -> int:
        """How many blocks node slot ``node`` keeps on disk only."""
        return self.disk.num_held(node)

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
        """Holder bitmask per key (0 for unknown keys), as Python ints in an object array:
        bit i = node slot i, as wide as the cluster."""
        slots = self.lookup(keys)
        return self.slot_masks(slots)

    def slot_masks(self, slots: np.ndarray) -> np.ndarray:
        """Holder bitmask (Python int) per table slot; 0 where the slot is -1."""
        out = np.zeros(len(slots), dtype=object)
        ok = np.flatnonzero(slots >= 0)
        out[ok] = self.sets.masks(slots[ok])
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

    def live_nodes(self) -> list[int]:
        """The node slots that hold at least one block, ascending."""
        return self.sets.live_nodes()

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

    def plan(self, node: int, nbytes_to_free: int, exclude: Sequence[bytes] = (),
             tier: str = "arena") -> list[bytes]:
        """Keys node slot ``node`` should evict from ``tier`` to free ``nbytes_to_free`` bytes
        there (see ``planner.plan_evictions``: LRU, children before parents, hard pins
        never). The arena's least recently used go to disk (a node with a disk tier demotes
        what the arena plan names), the disk's least recently used are dropped."""
        return plan_evictions(self, node, nbytes_to_free, exclude, tier)
