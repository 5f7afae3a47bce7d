"""The key -> slot hash table behind ``LRUTable``: open addressing, probed a batch at once.

Linear probing with tombstones, kept at most half full (``LRUTable._reserve`` rebuilds it). A
key's home position is its first 8 bytes masked: block keys are sha256, so those bytes are
already a good hash. Entries are table slots; the keys themselves stay in the table's column,
so a probe compares whole 32-byte rows there.
"""

from __future__ import annotations

import numpy as np

EMPTY = -1
TOMB = -2
_ROW = np.dtype("V32")  # one key row as a single value: a row compare is one numpy op
#: keys still probing when a batch round is not worth its numpy calls: the few with long
#: probe runs (a batch's longest is often 10-20 positions) go on one by one
_SCALAR_TAIL = 16


class SlotHash:
    """Positions (a power of two) each holding a slot, ``EMPTY`` or ``TOMB``."""

    def __init__(self, size: int) -> None:
        self.table = np.full(size, EMPTY, dtype=np.int32)
        self.num_tombs = 0

    def forget(self, where: np.ndarray) -> None:
        """Tombstone the positions of removed keys (probes go on past them)."""
        self.table[where] = TOMB
        self.num_tombs += int(where.size)

    def find(self, rows: np.ndarray, packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Slot (or -1) of each packed key in ``rows`` (the key column), and its table position
        (meaningful where found).

        The whole batch probes together. At most half full, most keys sit at their home
        position, so the first round is written without sub-indexing and compares whole
        32-byte rows as one void value (a handful of numpy calls: this is every lookup's
        path); only keys that collided go round the loop.
        """
        mask = len(self.table) - 1
        rows = rows.view(_ROW)[:, 0]
        want = packed.view(_ROW)[:, 0]
        pos = (packed[:, 0] & np.uint64(mask)).astype(np.int64)
        s = self.table[pos].astype(np.int64)
        # s == -1 reads the last row: a harmless compare, masked out by s >= 0
        match = (rows[s] == want) & (s >= 0)
        slots = np.where(match, s, -1)
        active = np.flatnonzero(~match & (s != EMPTY))
        while active.size:
            if active.size <= _SCALAR_TAIL:
                self._find_tail(rows, want, active.tolist(), pos, slots)
                break
            pos[active] = (pos[active] + 1) & mask
            p = pos[active]
            s = self.table[p].astype(np.int64)
            match = (rows[s] == want[active]) & (s >= 0)
            slots[active[match]] = s[match]
            active = active[~match & (s != EMPTY)]
        return slots, pos

    def place(self, packed: np.ndarray, slots: np.ndarray) -> None:
        """Put absent, distinct keys into the table (first free position along each probe; two
        keys reaching one free position in the same round: the first in the batch takes it)."""
        table = self.table
        mask = len(table) - 1
        pos = (packed[:, 0] & np.uint64(mask)).astype(np.int64)
        slots = np.asarray(slots)
        active = np.arange(len(packed))
        while active.size:
            if active.size <= _SCALAR_TAIL:
                self._place_tail(active.tolist(), pos[active].tolist(), slots.tolist())
                break
            p = pos[active]
            old = table[p]
            free = old < 0
            cand, pc, old = active[free], p[free], old[free]
            cs = slots[cand]
            table[pc] = cs  # slots are distinct: a read-back shows who got each position
            won = table[pc] == cs
            if not won.all():  # rare: settle it by batch order (np.unique is a sort)
                won_pos, first = np.unique(pc, return_index=True)
                table[won_pos] = cs[first]
                won = np.zeros(pc.size, dtype=bool)
                won[first] = True
            if self.num_tombs:
                self.num_tombs -= int((old[won] == TOMB).sum())
            keep = ~free
            keep[np.flatnonzero(free)[~won]] = True
            active = active[keep]
            pos[active] = (pos[active] + 1) & mask

    def _find_tail(self, rows: np.ndarray, want: np.ndarray, active: list[int],
                   pos: np.ndarray, slots: np.ndarray) -> None:
        """``find``'s probe for the last few keys (each one past its current position)."""
        table = self.table
        mask = len(table) - 1
        for i in active:
            p, w = int(pos[i]), want[i]
            while True:
                p = (p + 1) & mask
                s = int(table[p])
                if s == EMPTY:
                    break
                if s >= 0 and rows[s] == w:
                    slots[i] = s
                    break
            pos[i] = p

    def _place_tail(self, active: list[int], pos: list[int], slots: list[int]) -> None:
        """``place``'s rounds for the last few keys (ascending batch order, each at its current
        position): a key taking a position in a round beats the later ones reaching it."""
        table = self.table
        mask = len(table) - 1
        while active:
            left, at = [], []
            for i, p in zip(active, pos, strict=True):
                s = table[p]
                if s < 0:
                    self.num_tombs -= int(s == TOMB)
                    table[p] = slots[i]
                else:
                    left.append(i)
                    at.append((p + 1) & mask)
            active, pos = left, at
