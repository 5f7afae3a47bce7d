"""What the cache holds, for ``kvstore ls``: namespaces and cached prefixes, never tokens.

A block key says nothing about its model, so workers describe the namespace they publish in
when they report at start (``kvstore.cluster.operations.describe_namespace``): the root and the
fields hashed into it, with the tenant salt as a label (a short hash), never the salt itself.
Blocks whose namespace nobody described are still listed, with their root only.

A *cached prefix* is the deepest block of a chain: a live block that is no live block's parent.
Its key names the whole prefix, so it is what an operator pins (with its ancestors, which
``kvstore pin --prompts`` computes) or compares against a prompt's keys.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.coordinator.lru import PIN_NONE, LRUTable
from kvstore.index.base import Index

#: The descriptor fields a namespace report must carry (``describe_namespace`` writes them).
NAMESPACE_FIELDS = ("root", "model", "model_fingerprint", "dtype", "block_size", "num_layers",
                    "num_kv_heads", "head_dim", "salt")
#: Optional descriptor fields: the numerics tag ("" = portable) of workers that report one.
OPTIONAL_NAMESPACE_FIELDS = ("numerics",)
#: Namespaces are few (models x tenants); a table past this is a caller bug, not data.
MAX_NAMESPACES = 1024


@dataclass(slots=True)
class CachedPrefix:
    """One chain's deepest block: ``num_blocks`` cached blocks end at ``key``."""

    key: bytes
    namespace_root: bytes
    num_blocks: int
    complete: bool  # the chain reaches the namespace root (no ancestor was evicted)
    pinned_blocks: int
    nbytes: int


class NamespaceTable:
    """Namespace descriptors by root (hex), as workers reported them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_root: dict[str, dict[str, Any]] = {}

    def describe(self, desc: Mapping[str, Any]) -> None:
        """Record one worker's namespace; a malformed descriptor is refused whole."""
        missing = [f for f in NAMESPACE_FIELDS if f not in desc]
        if missing:
            raise ValueError(f"namespace descriptor lacks {missing}")
        root = str(desc["root"])
        if len(root) != 64 or any(c not in "0123456789abcdef" for c in root):
            raise ValueError(f"namespace root must be 64 lower-case hex digits, got {root!r}")
        with self._lock:
            if root not in self._by_root and len(self._by_root) >= MAX_NAMESPACES:
                raise ValueError(f"more than {MAX_NAMESPACES} namespaces described")
            self._by_root[root] = {f: desc[f] for f in NAMESPACE_FIELDS
                                   + tuple(f for f in OPTIONAL_NAMESPACE_FIELDS if f in desc)}

    def get(self, root_hex: str) -> dict[str, Any] | None:
        with self._lock:
            found = self._by_root.get(root_hex)
            return None if found is None else dict(found)

    def roots(self) -> list[str]:
        with self._lock:
            return sorted(self._by_root)


def cached_prefixes(lru: LRUTable, limit: int) -> tuple[list[CachedPrefix], int]:
    """The ``limit`` most recently used chain ends, and how many chain ends there are.

    Parents are matched by fingerprint (the key's first 8 bytes), as the eviction planner does;
    the walk up each listed chain is bounded by the number of live blocks.
    """
    n = lru._next_slot
    live = np.flatnonzero(lru.holders[:n] != 0)
    if not live.size:
        return [], 0
    fps = lru.keys[live, 0]
    parent_fps = lru.parent[live, 0]
    is_parent = np.isin(fps, parent_fps)
    leaves = live[~is_parent]
    order = np.argsort(-lru.last_use[leaves], kind="stable")[:max(limit, 0)]
    slot_of = dict(zip(fps.tolist(), live.tolist(), strict=True))
    out = []
    for leaf in leaves[order].tolist():
        chain = [leaf]
        rid = int(lru.root[leaf])
        root_fp = int.from_bytes(lru.roots[rid][:8], "little") if rid else None
        parent = int(lru.parent[leaf, 0])
        while parent in slot_of and len(chain) <= live.size:
            chain.append(slot_of[parent])
            parent = int(lru.parent[chain[-1], 0])
        out.append(CachedPrefix(
            key=lru.keys[leaf].tobytes(), namespace_root=lru.roots[rid],
            num_blocks=len(chain), complete=parent == root_fp,
            pinned_blocks=int((lru.pin[chain] != PIN_NONE).sum()),
            nbytes=int(lru.nbytes[chain].sum())))
    return out, int(leaves.size)


def namespace_totals(lru: LRUTable) -> dict[bytes, tuple[int, int]]:
    """``{root: (blocks, bytes)}`` over live blocks (root ``b""``: unknown)."""
    n = lru._next_slot
    live = np.flatnonzero(lru.holders[:n] != 0)
    ids = lru.root[live].astype(np.int64)
    counts = np.bincount(ids, minlength=len(lru.roots))
    sizes = np.bincount(ids, weights=lru.nbytes[live], minlength=len(lru.roots))
    return {lru.roots[i]: (int(counts[i]), int(sizes[i]))
            for i in range(len(lru.roots)) if counts[i]}


def listing(lru: LRUTable, index: Index, namespaces: NamespaceTable, limit: int
            ) -> dict[str, Any]:
    """The json-able ``kvstore ls`` view (full hex keys; tokens never leave the workers)."""
    prefixes, num_prefixes = cached_prefixes(lru, limit)
    keys = [p.key for p in prefixes]
    holders = index.holders(keys) if keys else []
    infos = index.info(keys) if keys else []
    ns_out = []
    totals = namespace_totals(lru)
    for root in sorted(set(totals) | {bytes.fromhex(r) for r in namespaces.roots()}):
        blocks, nbytes = totals.get(root, (0, 0))
        desc = namespaces.get(root.hex()) if root else None
        ns_out.append({**(desc or {}), "root": root.hex() if root else None,
                       "described": desc is not None, "blocks": blocks, "bytes": nbytes})
    pre_out = []
    for p, hs, info in zip(prefixes, holders, infos, strict=True):
        desc = namespaces.get(p.namespace_root.hex()) if p.namespace_root else None
        bs = int(desc["block_size"]) if desc else None
        pre_out.append({"key": p.key.hex(), "namespace_root": p.namespace_root.hex() or None,
                        "blocks": p.num_blocks, "complete": p.complete,
                        "tokens": p.num_blocks * bs if bs else None, "holders": hs,
                        "pinned_blocks": p.pinned_blocks, "bytes": p.nbytes,
                        "last_use": info.last_use if info is not None else None})
    return {"namespaces": ns_out, "prefixes": pre_out, "num_prefixes": num_prefixes,
            "limit": limit}
