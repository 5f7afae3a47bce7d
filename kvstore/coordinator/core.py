"""The coordinator's logic as plain Python: cluster LRU, watermarks, pins, liveness, recovery.

``kvstore.coordinator.actor.Coordinator`` is a thin Ray shell around this class, so every policy is
tested without Ray. Store nodes call in (register, publish, heartbeat, removed, request
eviction); orders go back in heartbeat replies, never as calls into the nodes, so a slow node
cannot stall the coordinator.

Recovery: every start bumps the epoch. Store nodes see the new epoch in a heartbeat reply and
re-announce everything they hold; ``register_node`` reconciles the index with that (adding
missing holders, dropping ones the node no longer has) and counts the difference as drift.
With Redis the index (and so the LRU table) is also reloaded at start, and a marker key holds
the epoch: when ``check_index`` finds it gone (Redis restarted empty, or was flushed), the
epoch is bumped so every live node re-announces what it holds and the index is rebuilt.

Two index modes. Embedded (``index.backend == "memory"``): the index *is* the LRU table
(``TableIndex``), so every block is stored once, in one compact row, and the index's node bits
are the nodes' slots. External (Redis, or any ``Index`` passed in): the index is shared with
readers and the LRU table mirrors it for eviction, so writes go to both.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

from kvstore import metrics as prom
from kvstore.config import KVStoreConfig
from kvstore.coordinator.catalog import NamespaceTable
from kvstore.coordinator.liveness import NodeState, NodeStatus, NodeTable
from kvstore.coordinator.lru import LRUTable
from kvstore.coordinator.messages import HeartbeatReply, ReplicateOrder
from kvstore.coordinator.operator_calls import OperatorCalls
from kvstore.coordinator.pins import PinTable
from kvstore.coordinator.table_index import TableIndex
from kvstore.index.base import Index, IndexEntry
from kvstore.index.checks import check_keys, check_node_id, owned_by
from kvstore.index.factory import make_index
from kvstore.records import NodeAddress, PoolStats, PrefixHit

log = logging.getLogger(__name__)

#: a (key, reader) pair counted toward replication; the counter is cleared past this size
_MAX_HOT_COUNTERS = 100_000


class CoordinatorCore(OperatorCalls):
    """Cluster state and policy; every public method is thread-safe."""

    def __init__(self, config: KVStoreConfig, *, index: Index | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.cfg = config.coordinator
        self.clock = clock
        # bumps on every start (a restart takes far longer than the 1 us resolution)
        self.epoch = time.time_ns() // 1_000
        if index is None:
            index = TableIndex() if config.index.backend == "memory" else make_index(config.index)
        self.index: Index = index
        self.pins = PinTable()
        self.namespaces = NamespaceTable()  # described by workers, for `kvstore ls`
        self.nodes = NodeTable(self.cfg.node_timeout_s)
        self.dead: dict[str, NodeStatus] = {}
        self.hot: Counter[tuple[bytes, str]] = Counter()
        self.metrics: Counter[str] = Counter()
        self._table_index = index if isinstance(index, TableIndex) else None
        if self._table_index is not None:
            self.lru = self._table_index.table
            # one lock for both: readers' lookups enter the index without the core's lock
            self._lock = self._table_index.lock
        else:
            self.lru = LRUTable()
            self._lock = threading.RLock()
        self._reload()
        self.index.set_marker(self.epoch)
        prom.watch_coordinator_table(lambda: self.lru.num_blocks)

    def _ensure(self, node_id: str, now: float) -> NodeState:
        """The node's state; in embedded mode its slot is its bit in the index."""
        node = self.nodes.get(node_id)
        if node is None:
            node = self.nodes.ensure(node_id, now)
            if self._table_index is not None:
                node.slot = self._table_index.claim_node(node_id)
        return node

    @property
    def external_index(self) -> bool:
        """True when the index is a separate store the LRU table must be kept in step with."""
        return self._table_index is None

    # -- recovery --------------------------------------------------------------------------

    def _reload(self) -> None:
        """Rebuild the LRU table from a persistent index (Redis); nodes get one timeout to
        re-register before their keys are dropped."""
        now = self.clock()
        if self._table_index is not None:  # the table is the index: nothing to copy
            for node_id in self.index.nodes():
                self._ensure(node_id, now)
            self.metrics["reloaded_blocks"] += self.lru.num_blocks
            return
        for node_id in self.index.nodes():
            keys = self.index.keys_of_node(node_id)
            infos = [i for i in self.index.info(keys) if i is not None]
            infos.sort(key=lambda i: i.last_use)  # oldest first: the table's clock order
            node = self._ensure(node_id, now)
            self.lru.add(node.slot, [i.key for i in infos], [i.parent_key for i in infos],
                         [i.nbytes for i in infos], [i.namespace_root for i in infos])
            self.metrics["reloaded_blocks"] += len(infos)

    def check_index(self) -> bool:
        """Bump the epoch when a persistent index lost its data (its epoch marker is gone), so
        every live node re-announces what it holds; True if it did. Runs on the reaper tick."""
        candidate = max(time.time_ns() // 1_000, self.epoch + 1)
        if not self.index.claim_marker(candidate):  # marker there, or an in-process index
            return False
        with self._lock:
            self.epoch = candidate
            # what the index lost: the blocks our LRU table still tracks for live nodes
            self.metrics["index_resets"] += 1
            self.metrics["index_lost_blocks"] += self.lru.num_blocks
            log.warning("kvstore index lost its data (epoch marker missing): %d blocks, "
                        "new epoch %d, live nodes re-announce", self.lru.num_blocks, candidate)
        return True

    def register_node(self, node_id: str, address: NodeAddress, capacity_bytes: int,
                      entries: Sequence[IndexEntry], disk_keys: Sequence[bytes] = ()) -> int:
        """A node (re)announces itself and everything it holds (``disk_keys``: those of the
        entries it keeps in its disk tier only); returns the epoch."""
        check_node_id(node_id)
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self._check_owner(node_id, entries)
        with self._lock:
            now = self.clock()
            node = self._ensure(node_id, now)
            node.address, node.capacity_bytes, node.last_heartbeat = address, capacity_bytes, now
            self.dead.pop(node_id, None)
            announced = {e.key for e in entries}
            known = set(self.index.keys_of_node(node_id))
            missing = [e for e in entries if e.key not in known]
            stale = sorted(known - announced)
            if missing and self.external_index:
                self.index.publish(missing)
            if stale:
                self._remove(node, stale)
            self._record(node, entries)
            if disk_keys:
                self.lru.set_tier(node.slot, list(disk_keys), True)
            self.metrics["drift_added"] += len(missing)
            self.metrics["drift_removed"] += len(stale)
            self.metrics["registrations"] += 1
            prom.record_drift(len(missing), len(stale))
            self._observe()
            return self.epoch

    def _check_owner(self, node_id: str, entries: Sequence[IndexEntry]) -> None:
        for e in () if owned_by(node_id, entries) else entries:  # the usual batch: C loops
            if not isinstance(e, IndexEntry):
                raise TypeError(f"entries must be IndexEntry objects, got {type(e).__name__}")
            if e.node_id != node_id:
                raise ValueError(f"entry for key {e.key[:8].hex()} names node {e.node_id!r}, "
                                 f"but node {node_id!r} sent it; a node announces its own blocks")

    def _record(self, node: NodeState, entries: Sequence[IndexEntry]) -> None:
        """Track entries for LRU (in embedded mode this is the index's publish itself)."""
        if not entries:
            return
        keys = [e.key for e in entries]
        if self._table_index is not None:
            self._table_index.publish(entries)
        else:
            self.lru.add(node.slot, keys, [e.parent_key for e in entries],
                         [e.nbytes for e in entries], [e.namespace_root for e in entries])
        for level, pinned in self.pins.levels(keys).items():
            self.lru.set_pin(pinned, level)
        # a replica landed elsewhere: a draining node can now let go of its copy
        draining = [n for n in self.nodes.nodes.values() if n.draining and n is not node]
        for d in draining:
            masks = self.lru.holder_masks(keys)
            bit = 1 << d.slot
            mine = [k for k, m in zip(keys, masks.tolist(), strict=True) if m & bit]
            d.pending_evict.extend(mine)
            d.evict_cause.update(dict.fromkeys(mine, "drain"))

    # -- the data path's calls -------------------------------------------------------------

    def publish(self, node_id: str, entries: Sequence[IndexEntry]) -> None:
        """Make ``entries`` visible (before the node's put returns) and track them for LRU."""
        check_node_id(node_id)
        self._check_owner(node_id, entries)
        with self._lock:
            node = self._ensure(node_id, self.clock())
            if self.external_index:
                self.index.publish(entries)
            self._record(node, entries)
            self.metrics["published"] += len(entries)

    def removed(self, node_id: str, keys: Sequence[bytes]) -> None:
        """The node evicted or deleted ``keys``."""
        check_node_id(node_id)
        check_keys(keys)
        with self._lock:
            node = self.nodes.get(node_id)
            if node is not None:
                self._remove(node, keys)
                node.ordered.difference_update(keys)
            else:
                self.index.remove(keys, node_id)
            self.metrics["removed"] += len(keys)

    def report_tiers(self, node_id: str, to_disk: Sequence[bytes],
                     to_arena: Sequence[bytes]) -> None:
        """The node demoted ``to_disk`` (they stay its blocks, in its disk tier only) and
        promoted ``to_arena`` back: the arena plan counts only what is in the arena.

        Both are orders carried out (or undone by a read), so they leave ``ordered``: a block
        demoted and promoted again since the last heartbeat is in the arena and may be
        planned again. Kept there, a burst of reads that promote what the last plans demoted
        could leave every arena block excluded, and the plan for a full arena empty."""
        check_node_id(node_id)
        check_keys(to_disk)
        check_keys(to_arena)
        with self._lock:
            node = self.nodes.get(node_id)
            if node is None:
                return  # unknown or dead: its re-registration says where everything is
            node.ordered.difference_update(to_disk)
            node.ordered.difference_update(to_arena)
            moved = self.lru.set_tier(node.slot, list(to_disk), True)
            moved += self.lru.set_tier(node.slot, list(to_arena), False)
            self.metrics["tier_moves"] += moved

    def _remove(self, node: NodeState, keys: Sequence[bytes]) -> None:
        self.index.remove(keys, node.node_id)
        if self.external_index:
            self.lru.remove(node.slot, keys)

    def touch(self, keys: Sequence[bytes], now: float | None = None) -> None:
        """Record uses (LRU order and the index's last use) of ``keys``."""
        check_keys(keys)
        with self._lock:
            self._touch(keys, self.clock() if now is None else now)

    def _touch(self, keys: Sequence[bytes], now: float) -> None:
        if self.external_index:
            self.lru.touch(keys)
        self.index.touch(keys, now)  # in embedded mode this is the table's touch
        self.metrics["touches"] += len(keys)

    def heartbeat(self, node_id: str, stats: PoolStats, touched: Sequence[bytes],
                  remote_reads: dict[str, list[bytes]]) -> HeartbeatReply:
        """Stats, batched LRU touches and remote reads in; eviction/replication orders out."""
        check_node_id(node_id)
        with self._lock:
            now = self.clock()
            self._sweep(now)
            came_back = node_id in self.dead
            node = self._ensure(node_id, now)
            node.last_heartbeat, node.stats = now, stats
            if stats.capacity_bytes > 0:
                node.capacity_bytes = stats.capacity_bytes
            if came_back:
                self.dead.pop(node_id, None)
            node.ordered.clear()  # the node has executed what it was told last time
            if touched:
                self._touch(touched, now)
            self._count_remote_reads(node, remote_reads)
            self._expire_pins(now)
            evict, causes = node.pending_evict, node.evict_cause
            node.pending_evict, node.evict_cause = [], {}
            cap = node.capacity_bytes
            if cap and stats.used_bytes > self.cfg.high_watermark * cap:
                target = stats.used_bytes - int(self.cfg.low_watermark * cap)
                evict += self.lru.plan(node.slot, target, list(node.ordered.union(evict)))
            disk_cap = getattr(stats, "disk_capacity_bytes", 0)
            if disk_cap and stats.disk_used_bytes > self.cfg.high_watermark * disk_cap:
                # the disk's least recently used leave the cluster: dropped, not demoted
                target = stats.disk_used_bytes - int(self.cfg.low_watermark * disk_cap)
                dropped = self.lru.plan(node.slot, target, list(node.ordered.union(evict)),
                                        tier="disk")
                causes.update(dict.fromkeys(dropped, "disk"))
                evict += dropped
            node.ordered.update(evict)
            replicate = []
            for src_id, keys in node.pending_replicate.items():
                src = self.nodes.get(src_id)
                if src is not None and src.address is not None:
                    replicate.append(ReplicateOrder(keys, src.address))
            node.pending_replicate = {}
            self.metrics["evict_orders"] += len(evict)
            prom.COORD_EVICT_ORDERS.inc(len(evict))
            self._observe()
            return HeartbeatReply(self.epoch, evict, replicate,
                                  reannounce=came_back or node.address is None,
                                  evict_causes=[causes.get(k, "watermark") for k in evict])

    def request_eviction(self, node_id: str, nbytes_needed: int,
                         used_bytes: int | None = None) -> list[bytes]:
        """What a full node should evict right now to fit ``nbytes_needed`` more bytes.

        The plan goes down to the low watermark, not just enough for one block, so one call
        serves many reservations. ``used_bytes`` is the node's use now: the last heartbeat's
        figure may be a second old (taken before that beat's evictions, or before a burst of
        Puts filled the pool), and a stale low figure would plan one block per call, which
        concurrent Puts then take from each other. Keys already ordered out are neither planned
        again nor counted as freed (the node may have refused them: leased or pinned there).
        """
        check_node_id(node_id)
        with self._lock:
            node = self._ensure(node_id, self.clock())
            self._expire_pins(self.clock())
            used = node.used_bytes if used_bytes is None else used_bytes
            target = nbytes_needed
            if node.capacity_bytes:
                low = int(self.cfg.low_watermark * node.capacity_bytes)
                target = max(nbytes_needed, used + nbytes_needed - low)
            keys = self.lru.plan(node.slot, target, list(node.ordered))
            node.ordered.update(keys)
            self.metrics["eviction_requests"] += 1
            self.metrics["evict_orders"] += len(keys)
            prom.COORD_EVICT_ORDERS.inc(len(keys))
            return keys

    def _count_remote_reads(self, source: NodeState, remote_reads: dict[str, list[bytes]]
                            ) -> None:
        """Queue replication to readers' nodes for soft-pinned or often-fetched keys."""
        if len(self.hot) > _MAX_HOT_COUNTERS:
            self.hot.clear()
        for reader_id, keys in remote_reads.items():
            reader = self.nodes.get(reader_id)
            # Only to a registered, live node (``nodes`` holds the live ones): store nodes
            # count a read toward a reader node only when the cluster token names it, and an
            # id nobody registered gets no orders either way.
            if (reader is None or reader.address is None or reader is source
                    or reader.draining or not keys):
                continue
            masks = self.lru.holder_masks(keys).tolist()
            sizes = self.lru.nbytes[self.lru.lookup(keys)].tolist()
            room = int(self.cfg.high_watermark * reader.capacity_bytes) - reader.used_bytes
            orders = reader.pending_replicate.setdefault(source.node_id, [])
            for key, mask, size in zip(keys, masks, sizes, strict=True):
                if not mask or mask >> reader.slot & 1 or key in orders:
                    continue
                self.hot[(key, reader_id)] += 1
                if self.pins.is_soft(key) or self.hot[(key, reader_id)] >= \
                        self.cfg.hot_fetch_threshold:
                    if size > room:
                        continue
                    room -= size
                    orders.append(key)
                    del self.hot[(key, reader_id)]
                    self.metrics["replicate_orders"] += 1
                    prom.COORD_REPLICATE_ORDERS.inc()
            if not orders:
                del reader.pending_replicate[source.node_id]

    # -- liveness --------------------------------------------------------------------------

    def _sweep(self, now: float) -> None:
        dead = self.nodes.expired(now)
        for node in dead:
            self._forget(node, alive=False)
            self.metrics["nodes_dead"] += 1
            prom.COORD_NODES_DEAD.inc()
            prom.forget_node(node.node_id)
        if dead:
            self._observe()

    def _observe(self) -> None:
        """Refresh the gauges (nodes alive, pins) after a change."""
        prom.observe_coordinator(len(self.nodes.nodes), self.pins.counts())

    def _forget(self, node: NodeState, *, alive: bool) -> None:
        num = self._drop(node)
        status = node.status(num)
        status.alive = alive
        self.dead[node.node_id] = status
        for other in self.nodes.nodes.values():
            other.pending_replicate.pop(node.node_id, None)

    def _drop(self, node: NodeState) -> int:
        num = self.index.drop_node(node.node_id)  # embedded: frees the node's bit/slot too
        if self.external_index:
            self.lru.drop_node(node.slot)
        return num

    def check_liveness(self) -> list[str]:
        """Declare silent nodes dead now; returns their ids."""
        with self._lock:
            before = set(self.nodes.nodes)
            self._sweep(self.clock())
            return sorted(before - set(self.nodes.nodes))

    # -- readers' view ---------------------------------------------------------------------

    def lookup_prefix(self, keys: Sequence[bytes]) -> PrefixHit:
        """The longest cached prefix of ``keys`` and its holders."""
        return self.index.lookup_prefix(keys)

    def holders(self, keys: Sequence[bytes]) -> list[list[str]]:
        """The holders of each key."""
        return self.index.holders(keys)

    def directory(self) -> dict[str, NodeAddress]:
        """Addresses of live nodes."""
        with self._lock:
            self._sweep(self.clock())
            return {n.node_id: n.address for n in self.nodes.nodes.values()
                    if n.address is not None}

    def nodes_status(self) -> list[NodeStatus]:
        """Every live node, then the ones declared dead."""
        with self._lock:
            self._sweep(self.clock())
            live = [n.status(self._blocks(n)) for n in self.nodes.nodes.values()]
            return sorted(live, key=lambda s: s.node_id) + sorted(
                self.dead.values(), key=lambda s: s.node_id)

    def _blocks(self, node: NodeState) -> int:
        return self.lru.num_blocks_of(node.slot)
