"""The eviction planner: which blocks one node should let go of, in order (design.md 5.3)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from kvstore.constants import PIN_HARD, PIN_SOFT


class PlannedTable(Protocol):
    """What the planner reads of ``lru.LRUTable`` (a protocol, so the table can call the
    planner without the two modules importing each other)."""

    keys: np.ndarray
    parent: np.ndarray
    pin: np.ndarray
    last_use: np.ndarray
    nbytes: np.ndarray

    def _slots_of(self, node: int) -> np.ndarray: ...
    def lookup(self, keys: Sequence[bytes]) -> np.ndarray: ...
    def key_of(self, slots: np.ndarray) -> list[bytes]: ...


def plan_evictions(table: PlannedTable, node: int, nbytes_to_free: int,
                   exclude: Sequence[bytes] = ()) -> list[bytes]:
    """Keys node slot ``node`` should evict to free ``nbytes_to_free`` bytes.

    Least recently used first; a block whose child is on the same node waits until the
    child is chosen (evicting a parent would orphan the chain); hard pins never; soft pins
    only when nothing unpinned is left. Children are counted over *every* block the node
    holds: a hard-pinned or excluded child is never chosen, so its ancestors stay too.
    """
    if nbytes_to_free <= 0:
        return []
    held = table._slots_of(node)
    if not held.size:
        return []
    eligible = table.pin[held] != PIN_HARD
    if exclude:
        skip = table.lookup(exclude)
        eligible &= ~np.isin(held, skip[skip >= 0])
    fps = table.keys[held, 0]
    order = np.argsort(fps, kind="stable")
    sorted_fps = fps[order]
    # children on this node per block: count held blocks whose parent is that block
    parents = table.parent[held, 0]
    pidx = np.minimum(np.searchsorted(sorted_fps, parents), sorted_fps.size - 1)
    has_parent = sorted_fps[pidx] == parents
    parent_pos = np.full(held.size, -1, dtype=np.int64)
    parent_pos[has_parent] = order[pidx[has_parent]]
    children = np.bincount(parent_pos[has_parent], minlength=held.size)
    soft = table.pin[held] == PIN_SOFT
    last = table.last_use[held]
    sizes = table.nbytes[held]
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
    return table.key_of(held[np.asarray(chosen, dtype=np.int64)]) if chosen else []
