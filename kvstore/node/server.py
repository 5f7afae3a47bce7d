"""A store node's gRPC server: put/get, leases for same-node readers, admin calls.

Errors leave as gRPC status codes here (the table is in ``kvstore.node.wire``). The write path
(the Put stream and the unary PutBatch: two-phase per block, returning only after
``on_publish`` made the keys visible in the index) is ``kvstore.node.put_path``, mixed into the
servicer; the node's bookkeeping it uses (metadata cache, publisher) lives here. Remote bulk
reads go through ``kvstore.node.bulk`` instead of ``Get`` when the client has its address
(see that module for why).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from kvstore import metrics
from kvstore.block import read_header
from kvstore.config import ServerConfig
from kvstore.errors import (
    BlockCorrupted,
    BlockNotFound,
    KVStoreError,
    LeaseExpired,
)
from kvstore.index.base import IndexEntry
from kvstore.node.bulk import BulkServer
from kvstore.node.pool import ServedPool
from kvstore.node.publisher import CoalescingPublisher
from kvstore.node.put_path import PutPath, abort_with, check_keys
from kvstore.node.wire import start_grpc_server, tally_from_proto
from protos import kvstore_pb2 as pb
from protos import kvstore_pb2_grpc as pb_grpc


class _Servicer(PutPath, pb_grpc.StoreNodeServicer):
    def __init__(self, server: StoreServer) -> None:
        self.s = server
        self.pool = server.pool

    # -- data: Put and PutBatch are PutPath's (kvstore.node.put_path) ----------------
    def Get(self, request: pb.KeysRequest, context: grpc.ServicerContext) -> Iterator[pb.GetChunk]:
        try:
            keys = check_keys(request.keys)
        except ValueError as exc:
            abort_with(context, exc)
        chunk = self.s.chunk_bytes
        for key in keys:
            try:
                with self.pool.read(key) as view:
                    total = len(view)
                    parts = [bytes(view[off : off + chunk]) for off in range(0, total, chunk)]
            except BlockNotFound:
                yield pb.GetChunk(key=key, found=False)
                continue
            self.s.record_reads([key], request.reader_node_id)
            metrics.record_served("grpc", 1, total)
            for i, data in enumerate(parts):
                yield pb.GetChunk(key=key, found=True, total_nbytes=total, offset=i * chunk,
                                  data=data)

    # -- leases for same-node readers -------------------------------------------------------
    def Lease(self, request: pb.LeaseRequest, context: grpc.ServicerContext) -> pb.LeaseResponse:
        for wire_id in request.release_lease_ids:  # the reader's finished leases, first
            self._release(wire_id)
        try:
            keys = check_keys(request.keys)
            ttl = request.ttl_s if request.ttl_s > 0 else self.s.default_lease_ttl_s
            lease = self.pool.lease(keys, ttl)  # absent keys are left out of the lease
        except (KVStoreError, ValueError) as exc:
            abort_with(context, exc)
        lease_id = self.s.track_lease(lease)
        got = {loc.key for loc in lease.locations}
        metrics.record_served("shm", len(got), sum(loc.nbytes for loc in lease.locations))
        self.s.record_reads([k for k in keys if k in got], request.reader_node_id)
        return pb.LeaseResponse(
            lease_id=lease_id,
            locations=[pb.BlockLocation(key=loc.key, offset=loc.offset, nbytes=loc.nbytes)
                       for loc in lease.locations],
            missing=[k for k in keys if k not in got],
            expires_at=time.time() + ttl,  # the pool's clock is monotonic: send wall time
            shm_path=self.pool.path,
        )

    def RenewLease(self, request: pb.RenewLeaseRequest, context: grpc.ServicerContext
                   ) -> pb.RenewLeaseResponse:
        try:
            ttl = request.ttl_s if request.ttl_s > 0 else self.s.default_lease_ttl_s
            if not self.pool.renew(self.s.lease_of(request.lease_id), ttl):
                raise LeaseExpired(f"lease {request.lease_id!r} ended before it was renewed")
        except (KVStoreError, ValueError) as exc:
            abort_with(context, exc)
        return pb.RenewLeaseResponse(expires_at=time.time() + ttl)

    def ReleaseLease(self, request: pb.ReleaseLeaseRequest, context: grpc.ServicerContext
                     ) -> pb.Empty:
        self._release(request.lease_id)
        return pb.Empty()

    def _release(self, wire_id: str) -> None:
        lease_id = self.s.forget_lease(wire_id)
        if lease_id is not None:
            self.pool.release(lease_id)

    # -- admin ------------------------------------------------------------------------------
    def Exists(self, request: pb.KeysRequest, context: grpc.ServicerContext) -> pb.ExistsResponse:
        present, sizes = [], []
        for key in request.keys:
            held = self.pool.contains(key)
            present.append(held)
            sizes.append(self._nbytes(key) if held else 0)
        return pb.ExistsResponse(present=present, nbytes=sizes)

    def _nbytes(self, key: bytes) -> int:
        return self.pool.nbytes_of(key) or 0  # evicted since contains(): 0, as if absent

    def Delete(self, request: pb.KeysRequest, context: grpc.ServicerContext) -> pb.DeleteResponse:
        n = 0
        for key in request.keys:
            try:
                if self.pool.delete(key) is not False:
                    n += 1
            except BlockNotFound:
                continue
            except KVStoreError as exc:
                abort_with(context, exc)
            self.s.forget(key)
        return pb.DeleteResponse(num_deleted=n)

    def Evict(self, request: pb.KeysRequest, context: grpc.ServicerContext) -> pb.EvictResponse:
        keys = list(request.keys)
        held = [k for k in keys if self.pool.contains(k)]
        try:
            freed = self.pool.evict(keys)
        except KVStoreError as exc:
            abort_with(context, exc)
        for key in keys:
            if not self.pool.contains(key):
                self.s.forget(key)
        metrics.record_evictions(self.s.node_id, "admin",
                                 sum(not self.pool.contains(k) for k in held))
        return pb.EvictResponse(bytes_freed=int(freed))

    def Stats(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.StatsResponse:
        st = self.pool.stats()

        def field(*names: str) -> int:
            for name in names:
                if hasattr(st, name):
                    return int(getattr(st, name))
            return 0

        return pb.StatsResponse(
            node_id=self.s.node_id, capacity_bytes=field("capacity_bytes", "capacity"),
            used_bytes=field("used_bytes", "used"), num_blocks=field("num_blocks"),
            num_leased=field("num_leased", "num_leases"), num_pinned=field("num_pinned"),
        )

    def Health(self, request: pb.Empty, context: grpc.ServicerContext) -> pb.HealthResponse:
        grpc_addr, bulk_addr = self.s.addresses
        return pb.HealthResponse(node_id=self.s.node_id, serving=True, grpc_address=grpc_addr,
                                 bulk_address=bulk_addr or "", shm_path=self.pool.path)

    def ReportReads(self, request: pb.ReaderReport, context: grpc.ServicerContext) -> pb.Empty:
        """A reader's metrics since its last report: served from this node's /metrics."""
        try:
            metrics.apply_reader_tally(tally_from_proto(request))
        except ValueError as exc:
            abort_with(context, exc)
        return pb.Empty()

    def ListKeys(self, request: pb.ListKeysRequest, context: grpc.ServicerContext
                 ) -> Iterator[pb.KeyPage]:
        page_size = request.page_size or 1024
        page: list[pb.KeyInfo] = []
        for key in list(self.pool.keys()):
            info = self.s.key_info(key)
            if info is None:
                continue
            page.append(info)
            if len(page) >= page_size:
                yield pb.KeyPage(keys=page)
                page = []
        if page:
            yield pb.KeyPage(keys=page)


class StoreServer:
    """One store node: gRPC on ``config.port`` and the bulk byte channel on ``config.bulk_port``."""

    def __init__(self, pool: ServedPool, node_id: str, config: ServerConfig,
                 on_publish: Callable[[list[IndexEntry]], None] | None = None,
                 *, bulk: bool = True, default_lease_ttl_s: float = 30.0,
                 on_read: Callable[[list[bytes], str], None] | None = None) -> None:
        """``on_read(keys, reader_node_id)`` hears of every block served (Get, Lease, bulk),
        with the reader's Ray node id ("" when the client did not say): LRU touches and
        per-reader remote-read counts for hot-prefix replication come from it."""
        self.pool = pool
        self.node_id = node_id
        self.config = config
        self.on_publish = on_publish
        # Concurrent Puts share one index call; each still returns only once it is visible.
        self.publisher = CoalescingPublisher(on_publish) if on_publish is not None else None
        self.on_read = on_read
        self.default_lease_ttl_s = default_lease_ttl_s
        # Headroom for the protobuf framing around one chunk of block bytes.
        self.chunk_bytes = config.max_message_bytes - (64 << 10)
        self.max_block_bytes = int(pool.capacity_bytes or (1 << 62))
        self._meta: dict[bytes, tuple[bytes, bytes]] = {}
        self._leases: dict[str, tuple[Any, float]] = {}
        self._lock = threading.Lock()
        self._grpc: grpc.Server | None = None
        self._bulk = BulkServer(pool, config, on_read=self.record_reads) if bulk else None
        self._ports: tuple[int, int | None] = (0, None)

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> tuple[int, int | None]:
        """Bind and serve; returns ``(grpc_port, bulk_port)`` (bulk_port None if disabled)."""
        cfg = self.config
        self._grpc, port = start_grpc_server(
            cfg, cfg.port, lambda server: pb_grpc.add_StoreNodeServicer_to_server(
                _Servicer(self), server),
            max_workers=cfg.max_workers, thread_prefix=f"kvstore-grpc-{self.node_id}",
            max_message_bytes=cfg.max_message_bytes, what="server.port")
        bulk_port = self._bulk.start() if self._bulk is not None else None
        self._ports = (port, bulk_port)
        return self._ports

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop accepting calls, let running ones finish for ``grace`` seconds, close sockets."""
        if self._bulk is not None:
            self._bulk.stop()
        if self._grpc is not None:
            self._grpc.stop(grace).wait()
            self._grpc = None

    @property
    def addresses(self) -> tuple[str, str | None]:
        """``(grpc_address, bulk_address)`` as other nodes should dial them."""
        host = self.config.advertise_host or self.config.host
        grpc_port, bulk_port = self._ports
        return f"{host}:{grpc_port}", (f"{host}:{bulk_port}" if bulk_port else None)

    # -- bookkeeping used by the servicer ---------------------------------------------------
    def record_reads(self, keys: list[bytes], reader_node_id: str) -> None:
        """Blocks served to a reader on ``reader_node_id`` ("" unknown)."""
        if keys and self.on_read is not None:
            self.on_read(keys, reader_node_id)

    def remember(self, key: bytes, parent_key: bytes, namespace_root: bytes) -> None:
        with self._lock:
            self._meta[key] = (parent_key, namespace_root)

    def remember_many(self, keys_and_parents: list[tuple[bytes, bytes]], namespace_root: bytes
                      ) -> None:
        with self._lock:
            for key, parent_key in keys_and_parents:
                self._meta[key] = (parent_key, namespace_root)

    def forget(self, key: bytes) -> None:
        with self._lock:
            self._meta.pop(key, None)

    def key_info(self, key: bytes) -> pb.KeyInfo | None:
        """What the index needs about a held block (header read once if not cached)."""
        with self._lock:
            meta = self._meta.get(key)
        try:
            if meta is None:
                with self.pool.read(key) as view:
                    header = read_header(view)
                meta = (header.parent_key, header.namespace_root)
                self.remember(key, *meta)
            nbytes = self.pool.nbytes_of(key)
        except (BlockNotFound, BlockCorrupted):
            return None
        if nbytes is None:  # evicted since it was read
            return None
        return pb.KeyInfo(key=key, nbytes=nbytes, parent_key=meta[0], namespace_root=meta[1])

    def track_lease(self, lease: Any) -> str:
        now = time.monotonic()  # the pool's lease clock
        wire_id = str(lease.lease_id)
        with self._lock:
            for stale in [k for k, (_, exp) in self._leases.items() if exp < now - 60.0]:
                del self._leases[stale]
            self._leases[wire_id] = (lease.lease_id, lease.expires_at)
        return wire_id

    def lease_of(self, wire_id: str) -> Any:
        with self._lock:
            entry = self._leases.get(wire_id)
        if entry is None:
            raise LeaseExpired(f"lease {wire_id!r} is unknown or already released")
        return entry[0]

    def forget_lease(self, wire_id: str) -> Any:
        with self._lock:
            entry = self._leases.pop(wire_id, None)
        return None if entry is None else entry[0]
