"""The eviction planner: which blocks one node should let go of, in order (design.md 5.3)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from kvstore.constants import PIN_HARD, PIN_SOFT
from kvstore.coordinator.holders import sorted_unique

#: added to a soft-pinned block's last use, so one int64 orders blocks by (soft, last_use)
_SOFT = 1 << 62
#: the first pass looks at this many times the blocks an average size says are needed
_MARGIN = 2
_MIN_PREFIX = 256


class PlannedTable(Protocol):
    """What the planner reads of ``lru.LRUTable`` (a protocol, so the table can call the
    planner without the two modules importing each other)."""

    keys: np.ndarray
    parent: np.ndarray
    pin: np.ndarray
    last_use: np.ndarray
    nbytes: np.ndarray

    def _slots_of(self, node: int, ordered: bool = True) -> np.ndarray: ...
    def on_disk(self, node: int, slots: np.ndarray) -> np.ndarray: ...
    def lookup(self, keys: Sequence[bytes]) -> np.ndarray: ...
    def key_of(self, slots: np.ndarray) -> list[bytes]: ...


def plan_evictions(table: PlannedTable, node: int, nbytes_to_free: int,
                   exclude: Sequence[bytes] = (), tier: str = "arena") -> list[bytes]:
    """Keys node slot ``node`` should evict from ``tier`` to free ``nbytes_to_free`` bytes.

    Tiers (design.md §5.3): the arena plan sees only the blocks in the node's arena (a block
    on its disk alone frees no arena bytes), and children are counted among those: a parent
    may go to disk before its child, since the node still serves it. The disk plan chooses
    among the disk-only blocks but counts children over every block the node holds, so a
    chain is never cut in the middle by dropping a parent that a child in the arena needs.

    Least recently used first; a block whose child is on the same node waits until the
    child is chosen (evicting a parent would orphan the chain); hard pins never; soft pins
    only when nothing unpinned is left. Children are counted over *every* block the node
    holds: a hard-pinned or excluded child is never chosen, so its ancestors stay too.

    Precisely: repeatedly take the ready block (eligible, no child left on the node) that is
    smallest by (soft pinned, last use, table slot). A block's parent is the held block whose
    key fingerprint is the parent's (the lowest slot if several share it).

    How: a plan frees a few percent of a node, so the blocks it takes are almost always
    among the least recently used. The run is first played on only the eligible blocks of
    smallest (soft, last use) — a *prefix* of that order — with children still counted over
    every held block; while its heap is not empty, its smallest block is also the smallest
    ready block overall (every block outside the prefix is larger), so the run is exactly
    the full one. Only when the prefix runs dry before enough is freed does it grow (4x),
    up to every eligible block: the full computation. Nothing here sorts the node's blocks.
    """
    if nbytes_to_free <= 0:
        return []
    if tier not in ("arena", "disk"):
        raise ValueError(f"tier must be 'arena' or 'disk', got {tier!r}")
    held = table._slots_of(node, ordered=False)
    if not held.size:
        return []
    on_disk = table.on_disk(node, held)
    if tier == "arena" and on_disk.any():
        held = held[~on_disk]
        if not held.size:
            return []
    pin = table.pin[held]
    eligible = pin != PIN_HARD
    if tier == "disk":
        eligible &= on_disk
    if exclude:
        skip = table.lookup(exclude)
        skip = skip[skip >= 0]
        if skip.size:
            mark = np.zeros(len(table.pin), dtype=bool)
            mark[skip] = True
            eligible &= ~mark[held]
    cand = np.flatnonzero(eligible)
    if not cand.size:
        return []
    rank = table.last_use[held[cand]]
    if rank.size and (int(rank.max()) >= _SOFT or int(rank.min()) < 0):
        raise ValueError("last_use out of the planner's range")  # a clock of 2^62 ticks
    rank = rank + (pin[cand] == PIN_SOFT).astype(np.int64) * _SOFT
    fps = table.keys[held, 0]
    parents = table.parent[held, 0]
    sample = table.nbytes[held[: 64]]
    mean = max(1.0, float(sample.mean()))
    k = max(_MIN_PREFIX, int(_MARGIN * nbytes_to_free / mean) + 1)
    while True:
        if k >= cand.size:
            prefix, prank = cand, rank
        else:
            inside = rank <= np.partition(rank, k - 1)[k - 1]  # ties at the bound all in
            prefix, prank = cand[inside], rank[inside]
        whole = prefix.size == cand.size
        chosen, done = _run(table, held, fps, parents, prefix, prank, nbytes_to_free)
        if done or whole:
            return table.key_of(held[np.asarray(chosen, dtype=np.int64)]) if chosen else []
        k *= 4


def _members(values: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Indices of ``values`` (uint64) that are in ``q`` (sorted, distinct): a bitmap on the
    low bits first (fingerprints are hash bits), exact comparison only for what passes."""
    if not q.size:
        return np.zeros(0, dtype=np.int64)
    size = 1 << max(12, min(22, (q.size * 64).bit_length()))
    low = np.uint64(size - 1)
    bits = np.zeros(size, dtype=bool)
    bits[(q & low).astype(np.intp)] = True
    maybe = np.flatnonzero(bits[(values & low).astype(np.intp)])
    v = values[maybe]
    at = np.minimum(np.searchsorted(q, v), q.size - 1)
    return maybe[q[at] == v]


def _run(table: PlannedTable, held: np.ndarray, fps: np.ndarray, parents: np.ndarray,
         prefix: np.ndarray, prank: np.ndarray, need: int) -> tuple[list[int], bool]:
    """The planner's heap run on ``prefix`` (ascending indices into ``held``, with their
    ranks), children counted over all of ``held``. Returns the chosen indices into ``held``
    and whether they free ``need`` (if not, the prefix ran dry: its run may differ from the
    full one from there on)."""
    slots = held[prefix]
    fp = fps[prefix]
    par = parents[prefix]
    # the canonical (lowest-slot) held block of each fingerprint the prefix needs
    q = sorted_unique(np.concatenate([fp, par]))
    m = _members(fps, q)
    o = np.lexsort((held[m], fps[m]))
    m, m_fp = m[o], fps[m[o]]
    first = np.ones(m.size, dtype=bool)
    first[1:] = m_fp[1:] != m_fp[:-1]
    can_fp, can_idx = m_fp[first], m[first]
    canon = can_idx[np.searchsorted(can_fp, fp)] == prefix
    at = np.minimum(np.searchsorted(can_fp, par), can_fp.size - 1)
    parent_held = np.where(can_fp[at] == par, can_idx[at], -1)
    at = np.minimum(np.searchsorted(prefix, parent_held), prefix.size - 1)
    parent_local = np.where((parent_held >= 0) & (prefix[at] == parent_held), at, -1)
    # children on the node: held blocks whose parent fingerprint is a prefix block's
    ufp = sorted_unique(fp)
    c = _members(parents, ufp)
    per_fp = np.bincount(np.searchsorted(ufp, parents[c]), minlength=ufp.size)
    children = np.where(canon, per_fp[np.searchsorted(ufp, fp)], 0)
    ready = np.flatnonzero(children == 0)
    heap = list(zip(prank[ready].tolist(), slots[ready].tolist(), ready.tolist(), strict=True))
    heapq.heapify(heap)
    kids = children.tolist()
    up = parent_local.tolist()
    sizes = table.nbytes[slots].tolist()
    ranks = prank.tolist()
    slot_list = slots.tolist()
    where = prefix.tolist()
    chosen: list[int] = []
    freed = 0
    while heap and freed < need:
        _, _, j = heapq.heappop(heap)
        chosen.append(where[j])
        freed += sizes[j]
        p = up[j]
        if p >= 0:
            kids[p] -= 1
            if kids[p] == 0:
                heapq.heappush(heap, (ranks[p], slot_list[p], p))
    return chosen, freed >= need
