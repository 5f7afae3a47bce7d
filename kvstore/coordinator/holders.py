"""Which store nodes hold each block: any number of holders, 8 B per block in the common case.

A node slot is a small integer below ``MAX_NODES``. Most blocks have one or two holders, so each
table slot keeps up to four of them inline, as four uint16 *lanes* (node slot + 1; 0 = empty)
that read as one uint64 *code*. Code 0 means nobody holds the block, and equal codes mean equal
holder lists, which is what ``TableIndex`` caches node names by. A block with more than four
holders keeps the rest in ``spill``; lanes fill before the spill and are refilled from it when a
holder leaves, so every held block has a non-zero code and a spill only behind four full lanes:

    lanes[slot] = [n0+1, n1+1, n2+1, n3+1]   8 B    codes = lanes viewed as one uint64
    spill[slot] = {n4, n5, ...}              only for blocks with more than 4 holders
    by_node[n]  = table slots, appended      4 B per (block, holder), at most 2x that

``by_node`` makes "the blocks of node n" (eviction planning, drain, drop) cost O(that node's
blocks) instead of a scan of every row: with 1,024 nodes and 10 M blocks a scan per heartbeat
would be the bottleneck. Entries are only appended; a query filters them against the lanes (an
entry is stale once its block no longer lists the node, or the slot was freed and reused) and
rewrites the list, and an append that leaves it over twice the node's block count compacts it.
"""

from __future__ import annotations

import sys
from array import array

import numpy as np

from kvstore.errors import KVStoreError

#: node slots 0 .. MAX_NODES - 1: a lane is a uint16 and 0 marks it empty
MAX_NODES = 65_535
LANES = 4

_NO_SLOTS = np.zeros(0, dtype=np.int64)


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """``np.unique`` of a 1-d array by sort and compare (numpy 2's hashing ``unique`` is
    several times slower on integers)."""
    out = np.sort(values)
    if out.size > 1:
        keep = np.empty(out.size, dtype=bool)
        keep[0] = True
        np.not_equal(out[1:], out[:-1], out=keep[1:])
        out = out[keep]
    return out


def decode(code: int) -> tuple[int, ...]:
    """The inline node slots of one code, lane order."""
    return tuple(lane - 1 for lane in (code & 0xFFFF, code >> 16 & 0xFFFF, code >> 32 & 0xFFFF,
                                       code >> 48) if lane)


class HolderSets:
    """The holder set of every table slot, plus each node's table slots."""

    def __init__(self, capacity: int) -> None:
        self._set_lanes(np.zeros((capacity, LANES), dtype=np.uint16))
        self.spill: dict[int, set[int]] = {}
        self._by_node: dict[int, array[int]] = {}
        self._num_held: dict[int, int] = {}

    def _set_lanes(self, lanes: np.ndarray) -> None:
        self.lanes = lanes
        #: one uint64 per slot: 0 = no holder; a view, so it follows every lane write
        self.codes = lanes.view(np.uint64)[:, 0]

    def grow(self, capacity: int) -> None:
        """Room for ``capacity`` table slots, keeping what is there."""
        lanes = np.zeros((capacity, LANES), dtype=np.uint16)
        lanes[: len(self.lanes)] = self.lanes
        self._set_lanes(lanes)

    def nbytes(self) -> int:
        """Bytes of the lanes, the per-node lists and (estimated) the spill sets."""
        lists = sum(a.buffer_info()[1] * a.itemsize for a in self._by_node.values())
        spill = sys.getsizeof(self.spill) + sum(map(sys.getsizeof, self.spill.values()))
        return self.lanes.nbytes + lists + spill

    # -- membership ------------------------------------------------------------------------

    def _spilled(self, node: int, slots: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Of ``rows`` (indices into ``slots`` whose lanes are full), those whose spill holds
        ``node``."""
        if not self.spill:
            return np.zeros(0, dtype=np.int64)
        spill = self.spill
        return np.asarray([i for i in rows.tolist() if node in spill.get(int(slots[i]), ())],
                          dtype=np.int64)

    def contains(self, node: int, slots: np.ndarray) -> np.ndarray:
        """Whether ``node`` holds each of ``slots``."""
        lanes = self.lanes[slots]
        held = (lanes == node + 1).any(axis=1)
        if self.spill:
            full = np.flatnonzero((lanes != 0).all(axis=1) & ~held)
            held[self._spilled(node, slots, full)] = True
        return held

    def hold(self, node: int, slots: np.ndarray) -> int:
        """``node`` holds ``slots`` (distinct); returns how many it did not hold before."""
        if not 0 <= node < MAX_NODES:
            raise KVStoreError(f"node slot {node} is outside 0..{MAX_NODES - 1}")
        lanes = self.lanes[slots]
        held = (lanes == node + 1).any(axis=1)
        free = lanes == 0
        full = ~free.any(axis=1)
        if self.spill:
            held[self._spilled(node, slots, np.flatnonzero(full & ~held))] = True
        rows = np.flatnonzero(~held & ~full)
        self.lanes[slots[rows], free[rows].argmax(axis=1)] = node + 1
        for i in np.flatnonzero(~held & full).tolist():
            self.spill.setdefault(int(slots[i]), set()).add(node)
        self._track(node, slots[~held])
        return int((~held).sum())

    def unhold(self, node: int, slots: np.ndarray) -> np.ndarray:
        """``node`` no longer holds ``slots`` (distinct); returns whether it did, per slot."""
        lanes = self.lanes[slots]
        match = lanes == node + 1
        held = match.any(axis=1)
        rows, cols = np.nonzero(match)
        self.lanes[slots[rows], cols] = 0
        if self.spill:
            for i in np.flatnonzero((lanes != 0).all(axis=1)).tolist():
                slot = int(slots[i])
                extra = self.spill.get(slot)
                if extra is None:
                    continue
                if held[i]:  # refill the freed lane, so lanes stay ahead of the spill
                    self.lanes[slot, int(match[i].argmax())] = extra.pop() + 1
                elif node in extra:
                    extra.discard(node)
                    held[i] = True
                if not extra:
                    del self.spill[slot]
        num = int(held.sum())
        if num:
            self._num_held[node] -= num
        return held

    def holders_of(self, slot: int) -> list[int]:
        """Every node slot holding table slot ``slot``, lanes first."""
        return [*decode(int(self.codes[slot])), *sorted(self.spill.get(slot, ()))]

    def spilled_rows(self, slots: np.ndarray) -> list[int]:
        """Indices into ``slots`` of blocks with holders beyond the lanes (code is not all)."""
        if not self.spill:
            return []
        full = np.flatnonzero((self.lanes[slots] != 0).all(axis=1) & (slots >= 0))
        return [i for i in full.tolist() if int(slots[i]) in self.spill]

    def masks(self, slots: np.ndarray) -> list[int]:
        """Holders of each slot as a Python-int bitmask (bit i = node slot i, any width)."""
        cache: dict[int, int] = {}
        out = []
        for code in self.codes[slots].tolist():
            mask = cache.get(code)
            if mask is None:
                mask = cache[code] = sum(1 << n for n in decode(code))
            out.append(mask)
        for i in self.spilled_rows(slots):
            out[i] |= sum(1 << n for n in self.spill[int(slots[i])])
        return out

    # -- per node --------------------------------------------------------------------------

    def _track(self, node: int, new: np.ndarray) -> None:
        held = self._by_node.setdefault(node, array("i"))
        held.frombytes(new.astype(np.int32).tobytes())
        num = self._num_held[node] = self._num_held.get(node, 0) + int(new.size)
        if len(held) > 2 * num + 1024:
            self.slots_of(node)

    def slots_of(self, node: int) -> np.ndarray:
        """The table slots ``node`` holds, ascending (and its list compacted to exactly them)."""
        held = self._by_node.get(node)
        if not held:
            return _NO_SLOTS
        candidates = np.frombuffer(held, dtype=np.int32).astype(np.int64)
        mine = sorted_unique(candidates[self.contains(node, candidates)])
        if mine.size != len(held):
            self._by_node[node] = array("i", mine.astype(np.int32).tobytes())
        return mine

    def held_slots(self, node: int) -> np.ndarray:
        """The table slots ``node`` holds, each once, in no particular order.

        What the eviction planner reads on every call: unlike ``slots_of`` it neither sorts
        nor deduplicates when the node's list is already exact (as many entries as blocks
        held: every held slot is listed, so no entry can then be stale or repeated). Otherwise
        the stale entries are filtered out (and repeats dropped) and the list is rewritten, so
        the next call finds it exact again.
        """
        held = self._by_node.get(node)
        if not held:
            return _NO_SLOTS
        candidates = np.frombuffer(held, dtype=np.int32).astype(np.int64)
        num = self._num_held.get(node, 0)
        if candidates.size == num:
            return candidates
        if self.spill:
            mine = candidates[self.contains(node, candidates)]
        else:  # no spill: a lane of the code equals node + 1 (zero-lane test, SWAR)
            ones = np.uint64(0x0001_0001_0001_0001)
            x = self.codes[candidates] ^ (np.uint64(node + 1) * ones)
            mine = candidates[((x - ones) & ~x & np.uint64(0x8000_8000_8000_8000)) != 0]
        if mine.size != num:  # a slot listed twice (held, let go, held again): drop repeats
            mine = sorted_unique(mine)
        self._by_node[node] = array("i", mine.astype(np.int32).tobytes())
        return mine

    def num_held(self, node: int) -> int:
        """How many blocks ``node`` holds (kept as a count: no scan)."""
        return self._num_held.get(node, 0)

    def live_nodes(self) -> list[int]:
        """Node slots that hold at least one block."""
        return sorted(n for n, c in self._num_held.items() if c > 0)

    def drop(self, node: int) -> np.ndarray:
        """Forget ``node`` everywhere; returns the table slots it held."""
        slots = self.slots_of(node)
        self.unhold(node, slots)
        self._by_node.pop(node, None)
        self._num_held.pop(node, None)
        return slots
