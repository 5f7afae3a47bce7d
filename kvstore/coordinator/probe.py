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
            pos[active] = (pos[active] + 1) & mask
            p = pos[active]
            s = self.table[p].astype(np.int64)
            match = (rows[s] == want[active]) & (s >= 0)
            slots[active[match]] = s[match]
            active = active[~match & (s != EMPTY)]
        return slots, pos

    def place(self, packed: np.ndarray, slots: np.ndarray) -> None:
        """Put absent, distinct keys into the table (first free position along each probe)."""
        mask = len(self.table) - 1
        pos = (packed[:, 0] & np.uint64(mask)).astype(np.int64)
        active = np.arange(len(packed))
        while active.size:
            p = pos[active]
            free = self.table[p] < 0
            cand, pc = active[free], p[free]
            won_pos, first = np.unique(pc, return_index=True)  # one key per free position
            winners = cand[first]
            self.num_tombs -= int((self.table[won_pos] == TOMB).sum())
            self.table[won_pos] = slots[winners]
            keep = np.ones(active.size, dtype=bool)
            keep[np.flatnonzero(free)[first]] = False
            active = active[keep]
            pos[active] = (pos[active] + 1) & mask
