"""The coordinator's view of store nodes: addresses, capacities, last stats, liveness.

A node is alive while it heartbeats; one silent for ``node_timeout_s`` is declared dead (a dead
Ray node kills its store-node actor too, so missing heartbeats cover both). Each known node
owns one of ``MAX_NODES`` node slots in the LRU table's holder sets; a slot is free again as
soon as its node is dropped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from kvstore.coordinator.lru import MAX_NODES
from kvstore.errors import KVStoreError
from kvstore.records import NodeAddress, PoolStats

log = logging.getLogger(__name__)


@dataclass(slots=True)
class NodeStatus:
    """One store node as ``Coordinator.nodes()`` reports it."""

    node_id: str
    address: NodeAddress | None
    capacity_bytes: int
    used_bytes: int
    blocks: int
    hits: int
    misses: int
    evictions: int
    alive: bool
    last_heartbeat: float
    draining: bool = False
    # the node's disk tier (all 0 without one): what `kvstore status` shows per tier
    disk_capacity_bytes: int = 0
    disk_used_bytes: int = 0
    disk_blocks: int = 0
    disk_hits: int = 0


@dataclass(slots=True)
class NodeState:
    """What the coordinator keeps per node."""

    node_id: str
    slot: int
    address: NodeAddress | None
    capacity_bytes: int
    last_heartbeat: float
    stats: PoolStats | None = None
    draining: bool = False
    #: keys ordered evicted since the node's last heartbeat (not planned twice meanwhile)
    ordered: set[bytes] = field(default_factory=set)
    pending_evict: list[bytes] = field(default_factory=list)
    #: why a pending key goes (drain, invalidate); the watermark plan's keys are not in it
    evict_cause: dict[bytes, str] = field(default_factory=dict)
    pending_replicate: dict[str, list[bytes]] = field(default_factory=dict)

    @property
    def used_bytes(self) -> int:
        return self.stats.used_bytes if self.stats is not None else 0

    def status(self, blocks: int) -> NodeStatus:
        s = self.stats
        return NodeStatus(
            node_id=self.node_id, address=self.address, capacity_bytes=self.capacity_bytes,
            used_bytes=self.used_bytes, blocks=s.num_blocks if s is not None else blocks,
            hits=s.hits if s else 0, misses=s.misses if s else 0,
            evictions=s.evictions if s else 0, alive=True, last_heartbeat=self.last_heartbeat,
            draining=self.draining,
            disk_capacity_bytes=getattr(s, "disk_capacity_bytes", 0),
            disk_used_bytes=getattr(s, "disk_used_bytes", 0),
            disk_blocks=getattr(s, "disk_blocks", 0), disk_hits=getattr(s, "disk_hits", 0),
        )


class NodeTable:
    """Live nodes by id, each with a holder-bit slot; silent ones time out."""

    def __init__(self, node_timeout_s: float) -> None:
        self.node_timeout_s = node_timeout_s
        self.nodes: dict[str, NodeState] = {}

    def get(self, node_id: str) -> NodeState | None:
        return self.nodes.get(node_id)

    def ensure(self, node_id: str, now: float) -> NodeState:
        """The node's state, creating it (without an address yet) if unknown."""
        node = self.nodes.get(node_id)
        if node is None:
            node = NodeState(node_id, self._free_slot(), None, 0, now)
            self.nodes[node_id] = node
        return node

    def _free_slot(self) -> int:
        """The lowest slot no live node uses (one of ``len(used) + 1`` candidates is free)."""
        used = {n.slot for n in self.nodes.values()}
        for slot in range(min(len(used) + 1, MAX_NODES)):
            if slot not in used:
                return slot
        raise KVStoreError(
            f"the coordinator tracks at most {MAX_NODES} store nodes; drain or remove one first"
        )

    def expired(self, now: float) -> list[NodeState]:
        """Nodes silent for longer than the timeout (removed from the table)."""
        dead = [n for n in self.nodes.values() if now - n.last_heartbeat > self.node_timeout_s]
        for n in dead:
            del self.nodes[n.node_id]
        return dead

    def remove(self, node_id: str) -> NodeState | None:
        return self.nodes.pop(node_id, None)

    def by_slot(self) -> dict[int, NodeState]:
        return {n.slot: n for n in self.nodes.values()}


class Reaper:
    """Calls ``check`` every ``interval_s`` on a daemon thread.

    Dead nodes are otherwise only noticed inside another node's heartbeat, so when the last
    (or only) node dies nothing would ever drop its keys from the index.
    """

    def __init__(self, check: Callable[[], object], interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0 seconds, got {interval_s}")
        self._check = check
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kvstore-reaper")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._check()
            except Exception as exc:  # an index hiccup must not end liveness checks for good
                log.warning("kvstore liveness check failed: %s", exc)

    def stop(self) -> None:
        """Stop and wait for the thread (at most one interval)."""
        self._stop.set()
        self._thread.join(timeout=self._interval_s + 1.0)
