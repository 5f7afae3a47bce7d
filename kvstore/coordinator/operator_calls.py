"""The coordinator's operator calls: pins, drain, invalidate, the status view.

``CoordinatorCore`` mixes these in. They are what ``kvstore pin``, ``drain``, ``invalidate``,
``ls`` and ``status`` reach through the actor, and they share the core's lock, tables and
node states: the data path's calls (publish, heartbeat, eviction) stay in
``kvstore.coordinator.core``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvstore.coordinator.catalog import listing
from kvstore.coordinator.lru import PIN_HARD, PIN_NONE, PIN_SOFT
from kvstore.coordinator.messages import node_json
from kvstore.index.checks import check_keys, check_node_id


class OperatorCalls:
    """Operator calls over the core's state (``CoordinatorCore`` provides every attribute
    used here: ``_lock``, ``lru``, ``pins``, ``nodes``, ``index``, ``metrics``, ...)."""

    _lock: Any
    lru: Any
    pins: Any
    nodes: Any
    index: Any
    namespaces: Any
    metrics: Any
    cfg: Any
    clock: Any
    epoch: int
    _observe: Callable[[], None]
    _drop: Callable[[Any], int]
    _remove: Callable[[Any, Sequence[bytes]], None]
    nodes_status: Callable[[], list[Any]]

    def pin(self, keys: Sequence[bytes], *, hard: bool, ttl_s: float | None,
            ahead: bool = True) -> tuple[int, int]:
        """Pin keys (hard: never evicted; soft: evicted last, expires after ``ttl_s``).

        Returns ``(pinned, cached)``. ``ahead``: pin keys nobody holds yet too (the pin applies
        when they are published); otherwise only the cached ones, so a mistyped key pins
        nothing instead of a pin that never applies.
        """
        check_keys(keys)
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0 seconds or None, got {ttl_s}")
        if not hard and ttl_s is None:
            ttl_s = self.cfg.soft_pin_ttl_s
        with self._lock:
            cached = [k for k, s in zip(keys, self.lru.lookup(keys).tolist(), strict=True)
                      if s >= 0]
            chosen = list(keys) if ahead else cached
            expires = None if ttl_s is None else self.clock() + ttl_s
            self.pins.pin(chosen, hard=hard, expires_at=expires)
            self.lru.set_pin(chosen, PIN_HARD if hard else PIN_SOFT)
            self._observe()
            return len(chosen), len(cached)

    def num_cached(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` some node holds."""
        check_keys(keys)
        with self._lock:
            return int((self.lru.lookup(keys) >= 0).sum())

    def listing(self, limit: int = 20) -> dict[str, Any]:
        """The ``kvstore ls`` view: namespaces and the ``limit`` most recent cached prefixes."""
        with self._lock:
            return listing(self.lru, self.index, self.namespaces, limit)

    def unpin(self, keys: Sequence[bytes]) -> int:
        """Remove pins; returns how many keys were pinned."""
        check_keys(keys)
        with self._lock:
            gone = self.pins.unpin(keys)
            self.lru.set_pin(gone, PIN_NONE)
            self._observe()
            return len(gone)

    def _expire_pins(self, now: float) -> None:
        gone = self.pins.expire(now)
        if gone:
            self.lru.set_pin(gone, PIN_NONE)
            self.metrics["pins_expired"] += len(gone)
            self._observe()

    def drain(self, node_id: str) -> int:
        """Empty a node: replicate its blocks where there is room, evict the rest."""
        check_node_id(node_id)
        with self._lock:
            node = self.nodes.get(node_id)
            if node is None:
                raise ValueError(f"node {node_id!r} is not registered; see `kvstore status`")
            node.draining = True
            slots = self.lru._slots_of(node.slot)
            keys = self.lru.key_of(slots)
            sizes = self.lru.nbytes[slots].tolist()
            masks = self.lru.slot_masks(slots).tolist()
            targets = [n for n in self.nodes.nodes.values()
                       if n is not node and not n.draining and n.address is not None]
            room = {t.node_id: int(self.cfg.high_watermark * t.capacity_bytes) - t.used_bytes
                    for t in targets}
            for key, size, mask in zip(keys, sizes, masks, strict=True):
                if any(mask >> t.slot & 1 for t in targets):
                    node.pending_evict.append(key)  # another node already has a copy
                    node.evict_cause[key] = "drain"
                    continue
                dest = max(targets, key=lambda t: room[t.node_id], default=None)
                if dest is None or room[dest.node_id] < size:
                    node.pending_evict.append(key)
                    node.evict_cause[key] = "drain"
                    continue
                room[dest.node_id] -= size
                dest.pending_replicate.setdefault(node_id, []).append(key)
            self.metrics["drains"] += 1
            return len(keys)

    def remove_node(self, node_id: str) -> int:
        """Forget a node (after a drain, or a node shut down on purpose)."""
        with self._lock:
            node = self.nodes.remove(node_id)
            if node is None:
                return 0
            num = self._drop(node)
            for other in self.nodes.nodes.values():
                other.pending_replicate.pop(node_id, None)
            self._observe()
            return num

    def invalidate(self, namespace_root: bytes) -> int:
        """Evict every block of a namespace everywhere; returns how many keys."""
        check_keys([namespace_root])
        with self._lock:
            keys = sorted(set(self.index.keys_of_namespace(namespace_root))
                          | set(self.lru.namespace_keys(namespace_root)))
            return self._evict_everywhere(keys)

    def invalidate_keys(self, keys: Sequence[bytes]) -> int:
        """Evict exactly ``keys`` everywhere (``kvstore invalidate --prompts``); returns how
        many were cached. Longer prefixes built on them stay until the LRU takes them: a
        lookup stops at the first missing block, so nothing reads them meanwhile."""
        check_keys(keys)
        with self._lock:
            slots = self.lru.lookup(keys).tolist()
            return self._evict_everywhere(sorted({k for k, s in zip(keys, slots, strict=True)
                                                  if s >= 0}))

    def _evict_everywhere(self, keys: list[bytes]) -> int:
        """Order every holder of ``keys`` to drop them, forget them and their pins."""
        if not keys:
            return 0
        masks = self.lru.holder_masks(keys).tolist()
        for node in self.nodes.nodes.values():
            mine = [k for k, m in zip(keys, masks, strict=True) if m >> node.slot & 1]
            if mine:
                node.pending_evict.extend(mine)
                node.evict_cause.update(dict.fromkeys(mine, "invalidate"))
                self._remove(node, mine)
        self.unpin(keys)
        self.metrics["invalidated"] += len(keys)
        return len(keys)

    def status(self, top_k: int = 10) -> dict[str, Any]:
        """A json-able operator view: key hashes and counts, never tokens."""
        nodes = self.nodes_status()
        with self._lock:
            hits = sum(n.hits for n in nodes)
            misses = sum(n.misses for n in nodes)
            return {
                "epoch": self.epoch,
                "nodes": [node_json(n) for n in nodes],
                "totals": {
                    "nodes_alive": sum(n.alive for n in nodes),
                    "capacity_bytes": sum(n.capacity_bytes for n in nodes if n.alive),
                    "used_bytes": sum(n.used_bytes for n in nodes if n.alive),
                    "blocks": self.lru.num_blocks,
                    "hits": hits,
                    "misses": misses,
                    "hit_rate": hits / (hits + misses) if hits + misses else 0.0,
                    "evictions": sum(n.evictions for n in nodes),
                },
                "drift": {"added": self.metrics["drift_added"],
                          "removed": self.metrics["drift_removed"]},
                "pins": self.pins.counts(),
                "metrics": dict(self.metrics),
                "top_prefixes": [{"key": k.hex(), "touches": c}  # full: pin takes it
                                 for k, c in self.lru.top(top_k)],
            }
