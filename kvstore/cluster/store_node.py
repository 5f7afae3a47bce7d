"""The store-node actor: one per Ray node, a BlockPool and a StoreServer tied to the coordinator.

It keeps the coordinator's view true: every Put is published to the coordinator (and to Redis,
when that is the index) before Put returns; everything it holds is (re)announced at start and
whenever the coordinator's epoch changes (the coordinator restarted); a heartbeat thread
reports pool stats and the keys read since the last beat (batched LRU touches, never one Ray
call per block) and executes the eviction and replication orders in the reply. A full pool
asks the coordinator what to evict (down to the low watermark), evicts, and retries a bounded
number of times; when nothing is evictable the Put fails with RESOURCE_EXHAUSTED, never an
out-of-memory crash.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from kvstore import metrics
from kvstore.block import BlockHeader, verify_block_self
from kvstore.client.node_client import StoreNodeClient
from kvstore.cluster.evicting_pool import EvictingPool as EvictingPool
from kvstore.cluster.names import arena_name, coordinator_handle
from kvstore.config import ClientConfig, KVStoreConfig, ServerConfig
from kvstore.coordinator.index_service import FastPath, NoAnswer
from kvstore.errors import BlockCorrupted, BlockMismatch, KVStoreError, NodeUnavailable, PoolFull
from kvstore.gc_tuning import freeze_startup_objects
from kvstore.index.base import IndexEntry
from kvstore.index.factory import make_index
from kvstore.index.packed import PackedEntries
from kvstore.node.arena_files import freed_line, sweep_leftovers
from kvstore.node.block_pool import BlockPool
from kvstore.node.disk_tier import DiskTier
from kvstore.node.grpc_setup import bind_node_ip
from kvstore.node.store_server import StoreServer
from kvstore.node.tiered_pool import TieredPool
from kvstore.records import NodeAddress, PoolStats

log = logging.getLogger(__name__)

#: Attempts (one per second) to register with a coordinator that is (re)starting.
_REGISTER_ATTEMPTS = 60
#: The fill past which a Put wakes the evictor. Near full, not at the high watermark: the
#: round frees down to the low watermark either way, and a pool that runs fuller hits more
#: (closer to an exact LRU of the whole pool); the last 1% takes many Puts to fill, enough
#: for an eviction round to land first.
_EVICT_AHEAD_FILL = 0.99
#: Eviction causes that are about room in the arena: with a disk tier these demote.
SPACE_CAUSES = frozenset({"capacity", "watermark"})
#: Eviction plans one make-room asks for while the pool refuses every key (all leased).
_ROOM_REQUESTS = 3


class StoreNode:
    """One Ray node's store: pool + server + registration + heartbeat."""

    def __init__(self, config: KVStoreConfig) -> None:
        self.config = config
        ctx = ray.get_runtime_context()
        self.node_id: str = ctx.get_node_id()
        ip = ray.util.get_node_ip_address()
        # A predecessor killed by SIGKILL (OOM killer, ray.kill, its head's end) could not
        # unlink its arena: RAM on tmpfs, so a crash-looping node would eat the machine's
        # memory one capacity at a time. Only files whose owner is certainly gone go.
        freed = freed_line(sweep_leftovers(config.pool.shm_dir))
        if freed:
            log.warning("store node %s: %s", self.node_id[:12], freed)
        arena = BlockPool(config.pool.capacity_bytes, shm_dir=config.pool.shm_dir,
                          name=arena_name(self.node_id))
        self.tiered = open_disk_tier(arena, config)
        self.pool: BlockPool | TieredPool = self.tiered or arena
        self._lock = threading.Lock()
        self._touched: dict[bytes, None] = {}  # ordered set: recency order is kept
        self._remote_reads: dict[str, list[bytes]] = {}  # reader node -> keys, one per read
        self._coordinator = coordinator_handle()
        # Publishes over the coordinator's gRPC index service when it has one (index_service).
        self._index_fast = FastPath(lambda: self._call("index_address"), config.client)
        # With Redis the node writes the index itself, so readers see keys even while the
        # coordinator restarts; the coordinator still records the blocks for its LRU.
        self._redis = make_index(config.index) if config.index.backend == "redis" else None
        self._evicting = EvictingPool(self.pool, self._make_room)
        # A Put that leaves the pool above the high watermark wakes the evictor thread, which
        # asks for the plan down to the low watermark and evicts it off the Put path: under a
        # steady stream of Puts the heartbeat (every second) is too late, and a Put that finds the
        # pool full waits for a whole eviction round (plan + evict + tell the index).
        self._ahead_bytes = int(max(_EVICT_AHEAD_FILL, config.coordinator.high_watermark)
                                * self.pool.capacity_bytes)
        self._evict_ahead = threading.Event()
        self.server = StoreServer(
            self._evicting,
            self.node_id, bind_node_ip(config.server, ip), on_publish=self._on_publish,
            default_lease_ttl_s=config.coordinator.lease_ttl_s, on_read=self._record_reads,
            data_key=(bytes.fromhex(config.security.data_key)
                      if config.security.data_key else None),
        )
        self.server.start()
        if self.tiered is not None:  # blocks a previous run left: the index needs their meta
            for key, entry in self.tiered.disk.items():
                self.server.remember(key, entry.parent_key, entry.namespace_root)
        grpc_address, bulk_address = self.server.addresses
        self.address = NodeAddress(self.node_id, grpc_address, bulk_address, self.pool.path,
                                   start_node_metrics(config.server, ip, self.node_id,
                                                      self.pool.stats))
        self.epoch = -1
        self.num_registrations = 0
        self._register()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._heartbeat_loop, daemon=True,
                                        name="kvstore-heartbeat")
        self._thread.start()
        self._evictor = threading.Thread(target=self._evictor_loop, daemon=True,
                                         name="kvstore-evictor")
        self._evictor.start()
        freeze_startup_objects()

    # -- actor methods ------------------------------------------------------------------
    def ping(self) -> NodeAddress:
        """Where this node listens (returns once the node has registered)."""
        return self.address

    def stats(self) -> PoolStats:
        return self.pool.stats()

    def keys(self) -> list[bytes]:
        return self.pool.keys()

    def pin(self, keys: list[bytes]) -> int:
        """Pin blocks in the local pool (operators pin through the coordinator)."""
        return sum(bool(self.pool.pin(k)) for k in keys)

    def reload_credentials(self, auth_token: str | None, previous_auth_token: str | None,
                           client_auth_token: str | None = None,
                           tls_cert_pem: str | None = None, tls_key_pem: str | None = None
                           ) -> bool:
        """New credentials from ``kvstore rotate-credentials`` (kvstore.cluster.rotation):
        the server accepts both tokens from now on, this node's own calls (replication, the
        index service) present ``client_auth_token``. A new certificate is kept for the next
        start of the server (TLS contexts are not swapped live). Returns whether the running
        server took the tokens (False: it cannot, and keeps its old ones until restarted)."""
        import dataclasses

        server = dataclasses.replace(self.config.server, auth_token=auth_token,
                                     previous_auth_token=previous_auth_token)
        if tls_cert_pem and tls_key_pem:
            server = dataclasses.replace(server, tls_cert_pem=tls_cert_pem,
                                         tls_key_pem=tls_key_pem)
        self.config.server = server
        if client_auth_token:
            self.config.client = dataclasses.replace(self.config.client,
                                                     auth_token=client_auth_token)
            old_fast = self._index_fast
            self._index_fast = FastPath(lambda: self._call("index_address"), self.config.client)
            old_fast.close()
        setter = getattr(self.server, "set_auth_tokens", None)
        if setter is None:
            log.warning("store node %s cannot reload its tokens live; restart it to use the "
                        "rotated ones", self.node_id[:12])
            return False
        setter(auth_token, previous_auth_token)
        return True

    def heartbeat_now(self) -> int:
        """One heartbeat right away (tests and operators); returns the coordinator epoch."""
        self._heartbeat()
        return self.epoch

    def shutdown(self, purge: bool = False) -> None:
        """Stop heartbeats and serving, unlink the arena; the disk tier stays for the next
        start (its queued demotions written first) unless ``purge``."""
        self._stop.set()
        self._evict_ahead.set()
        self._thread.join(timeout=5)
        self._evictor.join(timeout=5)
        self.server.stop(grace=0.5)
        metrics.stop_metrics_servers()
        metrics.forget_node(self.node_id)
        if self.tiered is not None:
            self.tiered.close(purge=purge)
        else:
            self.pool.close()
        self._index_fast.close()
        if self._redis is not None:
            self._redis.close()

    # -- coordinator protocol -------------------------------------------------------------
    def _call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any
              ) -> Any:
        """A coordinator call; re-resolves the actor by name if it was replaced."""
        timeout_s = timeout_s or self.config.client.timeout_s
        try:
            return ray.get(getattr(self._coordinator, method).remote(*args, **kwargs),
                           timeout=timeout_s)
        except RayActorError:
            self._coordinator = coordinator_handle()  # stopped and started again: new actor
            return ray.get(getattr(self._coordinator, method).remote(*args, **kwargs),
                           timeout=timeout_s)

    def _held_entries(self) -> list[IndexEntry]:
        entries = []
        for key in self.pool.keys():
            info = self.server.key_info(key)
            if info is not None:
                entries.append(IndexEntry(key, self.node_id, int(info.nbytes),
                                          bytes(info.parent_key), bytes(info.namespace_root)))
        return entries

    def _register(self) -> None:
        last: Exception | None = None
        for _ in range(_REGISTER_ATTEMPTS):
            try:
                entries = self._held_entries()
                if self._redis is not None and entries:
                    self._redis.publish(entries)
                disk_keys = self.tiered.disk_only_keys() if self.tiered is not None else []
                self.epoch = int(self._call("register_node", self.node_id, self.address,
                                            self.pool.capacity_bytes, entries,
                                            disk_keys=disk_keys))
                self.num_registrations += 1
                return
            except (RayActorError, GetTimeoutError, NodeUnavailable) as exc:
                last = exc
                time.sleep(1.0)
        raise NodeUnavailable(f"store node {self.node_id[:12]} cannot register with the "
                              f"coordinator: {last}")

    def _on_publish(self, entries: list[IndexEntry]) -> None:
        """Make freshly stored blocks visible before Put returns (raises = Put fails)."""
        if self.pool.committed_bytes() > self._ahead_bytes:
            self._evict_ahead.set()
        if self._redis is not None:
            self._redis.publish(entries)
        # gRPC when the coordinator serves it (a few times cheaper than a Ray call)
        if not isinstance(self._index_fast.attempt(lambda c: c.publish(self.node_id, entries)),
                          NoAnswer):
            return
        # Packed: the coordinator gets the same list[IndexEntry], pickled as a few byte strings.
        self._call("publish", self.node_id, PackedEntries(entries))

    def _record_reads(self, keys: Sequence[bytes], reader_node_id: str) -> None:
        """Touch ``keys``; reads from another (named) node also count toward replication."""
        with self._lock:
            for k in keys:
                self._touched[k] = None
            if reader_node_id and reader_node_id != self.node_id:
                self._remote_reads.setdefault(reader_node_id, []).extend(keys)

    def _evictor_loop(self) -> None:
        while True:
            self._evict_ahead.wait()
            self._evict_ahead.clear()
            if self._stop.is_set():
                return
            if self.pool.committed_bytes() > self._ahead_bytes:
                try:
                    self._evicting.make_room_ahead(lambda: self._make_room(0, "watermark"))
                except Exception as exc:  # a Put that finds the pool full asks again
                    log.warning("kvstore evictor on %s failed: %s", self.node_id[:12], exc)

    def _make_room(self, nbytes: int, cause: str = "capacity") -> bool:
        """Ask the coordinator what to evict for ``nbytes`` more; True if anything was freed.

        Sends the pool's use now (the coordinator's is from the last heartbeat): committed
        bytes only, so space that unfinished Puts reserved never counts as pressure. Asks
        again, a few times, when the pool refused every key it was told (leased since): the
        coordinator then plans the next ones instead.
        """
        with contextlib.suppress(RayActorError, GetTimeoutError, NodeUnavailable):
            self._report_tier_changes()  # blocks promoted since the last beat are arena's now
        for _ in range(_ROOM_REQUESTS):
            try:
                keys = self._call("request_eviction", self.node_id, nbytes,
                                  self.pool.committed_bytes())
            except (RayActorError, GetTimeoutError, NodeUnavailable):
                return False  # no coordinator: refuse the Put rather than guess
            if not keys:
                return False
            if self._evict(keys, [cause] * len(keys)) > 0:
                return True
        return False

    def _evict(self, keys: Sequence[bytes], causes: Sequence[str]) -> int:
        """Evict what the pool allows (never leased or pinned), count it by cause (one per
        key; ``watermark`` where missing) and tell the index. With a disk tier, eviction for
        space (capacity, watermark) demotes instead: the block stays this node's, on disk,
        and the coordinator learns its tier; any other cause deletes it from both tiers."""
        if not keys:
            return 0
        keys = list(keys)
        cause_of = dict(zip(keys, causes, strict=False))
        freed = 0
        if self.tiered is not None:
            cold = [k for k in keys if cause_of.get(k) == "disk"]
            if cold:  # the disk tier's LRU: only the disk copy goes (one promoted since stays)
                lost = self.tiered.evict_lower(cold)
                metrics.record_evictions(self.node_id, "disk", len(lost))
                self._forget_lost(lost)
                keys = [k for k in keys if cause_of.get(k) != "disk"]
            space = [k for k in keys if cause_of.get(k, "watermark") in SPACE_CAUSES]
            if space:
                in_arena = self.tiered.arena.held(space)
                freed += self.tiered.demote(space)
                now = self.tiered.arena.held(space)
                left = [k for k, was, there in zip(space, in_arena, now, strict=True)
                        if was and not there]
                for cause, n in Counter(cause_of.get(k, "watermark") for k in left).items():
                    metrics.record_evictions(self.node_id, cause, n)
                demoted = [k for k, held in zip(left, self.tiered.held(left), strict=True)
                           if held]
                # Ordered out of an arena that no longer had them (a promotion reported late):
                # the coordinator's tier is stale, and its next plan must not name them again.
                below = [k for k, was in zip(space, in_arena, strict=True) if not was]
                stale = [k for k, held in zip(below, self.tiered.held(below), strict=True)
                         if held]
                if demoted or stale:
                    with contextlib.suppress(RayActorError, GetTimeoutError, NodeUnavailable):
                        self._call("report_tiers", self.node_id, demoted + stale, [])
                self._forget_lost([k for k in left if k not in set(demoted)])
                keys = [k for k in keys if cause_of.get(k, "watermark") not in SPACE_CAUSES]
            if not keys:
                return freed
        before = self.pool.held(keys)
        freed += self.pool.evict(keys)
        after = self.pool.held(keys)
        gone = [k for k, there in zip(keys, after, strict=True) if not there]
        evicted = Counter(cause_of.get(k, "watermark")
                          for k, was, there in zip(keys, before, after, strict=True)
                          if was and not there)
        for cause, n in evicted.items():
            metrics.record_evictions(self.node_id, cause, n)
        self._forget_lost(gone)
        return freed

    def _forget_lost(self, gone: Sequence[bytes]) -> None:
        """Keys this node no longer holds in any tier: out of its meta and the index."""
        for k in gone:
            self.server.forget(k)
        if gone:
            if self._redis is not None:
                self._redis.remove(list(gone), self.node_id)
            with contextlib.suppress(RayActorError, GetTimeoutError, NodeUnavailable):
                self._call("removed", self.node_id, list(gone))  # re-announce reconciles else

    def _report_tier_changes(self) -> None:
        """What the disk tier lost (full, failing, damaged files) and what reads promoted back
        into the arena since the last beat: the index and the coordinator's tiers follow."""
        if self.tiered is None:
            return
        lost, promoted = self.tiered.take_changes()
        self._forget_lost(lost)
        if promoted:
            try:
                self._call("report_tiers", self.node_id, [], promoted)
            except Exception:
                self.tiered.requeue_promoted(promoted)
                raise

    def _take_reads(self) -> tuple[list[bytes], dict[str, list[bytes]]]:
        with self._lock:
            touched, self._touched = list(self._touched), {}
            remote, self._remote_reads = self._remote_reads, {}
        return touched, remote

    def _stats(self) -> PoolStats:
        """The pool's stats as the coordinator sees them: ``used_bytes`` counts committed
        blocks only (its watermark plan must never evict committed blocks because a stalled
        Put holds a reservation)."""
        stats = self.pool.stats()
        return dataclasses.replace(stats, used_bytes=min(stats.used_bytes,
                                                         self.pool.committed_bytes()))

    def _heartbeat(self) -> None:
        self._report_tier_changes()
        touched, remote = self._take_reads()
        try:
            reply = self._call("heartbeat", self.node_id, self._stats(), touched, remote)
        except Exception:
            self._record_reads(touched, "")  # keep the touches and counts for the next beat
            for reader, keys in remote.items():
                self._record_reads(keys, reader)
            raise
        if reply.epoch != self.epoch or getattr(reply, "reannounce", False):
            # The coordinator restarted, or declared us dead: tell it everything we hold.
            self._register()
        self._evict(reply.evict, getattr(reply, "evict_causes", []))
        for order in reply.replicate:
            self._replicate(order.keys, order.source)

    def _replicate(self, keys: Sequence[bytes], source: NodeAddress) -> None:
        """Copy hot blocks from ``source`` into this pool and publish them."""
        wanted = [k for k in keys if not self.pool.contains(k)]
        entries = []
        for key, data, header in fetch_verified(source, wanted, self.config.client,
                                                reader_node_id=self.node_id):
            self.server.forget(key)  # kvstore.node.meta: before the block can be committed
            try:
                stored = self.pool.put(key, data)
            except PoolFull:
                break  # replication is best effort: never evict to make room for a copy
            if stored:
                self.server.remember(key, header.parent_key, header.namespace_root)
                entries.append(IndexEntry(key, self.node_id, len(data), header.parent_key,
                                          header.namespace_root))
        if entries:
            self._on_publish(entries)
            metrics.record_stored("replica", len(entries), sum(e.nbytes for e in entries))

    def _heartbeat_loop(self) -> None:
        interval = self.config.coordinator.heartbeat_interval_s
        while not self._stop.wait(interval):
            try:
                self._heartbeat()
            except Exception as exc:  # a missed beat is retried; the coordinator may restart
                log.warning("kvstore heartbeat from %s failed: %s", self.node_id[:12], exc)


def open_disk_tier(arena: BlockPool, config: KVStoreConfig) -> TieredPool | None:
    """The pool with its disk tier when ``pool.disk_dir`` is set; None when it is not, or
    when the directory cannot be used (in use by another node, not writable): the node then
    serves from its arena alone, with one error line that says why, rather than not start."""
    pool = config.pool
    if not pool.disk_dir:
        return None
    data_key = bytes.fromhex(config.security.data_key) if config.security.data_key else None
    try:
        disk = DiskTier(pool.disk_dir, pool.disk_capacity_bytes, data_key=data_key,
                        fsync=pool.disk_fsync, read_path=pool.disk_read_path)
    except (KVStoreError, OSError) as exc:
        log.error("kvstore store node: no disk tier (%s); serving from the arena only", exc)
        return None
    log.info("kvstore disk tier %s: %d blocks (%d bytes) recovered in %.2f s, %d damaged "
             "files removed, reads %s", disk.directory, disk.counters.recovered,
             disk.used_bytes, disk.recovery_s, disk.counters.discarded, disk.read_path)
    return TieredPool(arena, disk, queue_bytes=pool.disk_queue_bytes)


def fetch_verified(source: NodeAddress, keys: Sequence[bytes], config: ClientConfig,
                   reader_node_id: str = "") -> list[tuple[bytes, bytes, BlockHeader]]:
    """Whole blocks of ``keys`` from ``source``, each checked on its own terms.

    Missing blocks are skipped and damaged ones dropped with a warning: replication is best
    effort, and a reader re-verifies every block against its namespace anyway.
    """
    if not keys:
        return []
    client = StoreNodeClient(source.grpc_address, bulk_address=source.bulk_address,
                             config=config, reader_node_id=reader_node_id)
    try:
        blocks = client.get_blocks(keys)
    except KVStoreError as exc:
        log.warning("kvstore replica source %s failed: %s", source.node_id[:12], exc)
        return []
    finally:
        client.close()
    out = []
    for key, data in zip(keys, blocks, strict=True):
        if data is None:
            continue
        try:
            out.append((key, bytes(data), verify_block_self(data, key)))
        except (BlockCorrupted, BlockMismatch) as exc:
            log.warning("kvstore replica rejected: %s", exc)
    return out


def start_node_metrics(config: ServerConfig, ip: str, node_id: str,
                       stats: Callable[[], PoolStats]) -> str | None:
    """Serve this process's /metrics on ``server.metrics_port``; returns ``host:port`` to
    advertise, or None when it is off or its port is taken (the node still serves blocks)."""
    metrics.watch_pool(node_id, stats)
    return metrics.serve_metrics(config.metrics_port, config.metrics_host, ip,
                                 f"store node {node_id[:12]}")

