"""A store node's gRPC server: put/get, leases for same-node readers, admin calls.

Errors leave as gRPC status codes here (the table is in ``kvstore.node.grpc_status``). Every call
passes the credential check first (``kvstore.node.auth``); then reads (Get, Exists, Lease)
see only the blocks of the namespace they name, if the credential grants its tenant
(``kvstore.node.access``), and ListKeys, Delete, Evict, Stats and ReportReads are admin calls.
The write path (the Put stream and the unary PutBatch: two-phase per block, returning only
after ``on_publish`` made the keys visible in the index) is ``kvstore.node.put_path``, mixed
into the servicer. Leases are ``kvstore.node.leases``; the bounds on stalled streams are
``kvstore.node.limits``. Remote bulk reads go through ``kvstore.node.bulk_server`` instead of
``Get`` when the client has its address (see that module for why).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import grpc

from kvstore import metrics
from kvstore.config import ServerConfig
from kvstore.errors import (
    BlockNotFound,
    ConfigError,
    KVStoreError,
    LeaseExpired,
    PermissionDenied,
    Unauthenticated,
)
from kvstore.index.base import IndexEntry
from kvstore.node.access import ReadScope, RootCache, read_scope, spec_of
from kvstore.node.auth import AuthGate
from kvstore.node.block_pool import ServedPool
from kvstore.node.bulk_server import BulkServer
from kvstore.node.grpc_setup import start_grpc_server
from kvstore.node.leases import LeaseTable, clamp_ttl
from kvstore.node.limits import PutLimits, StreamWatchdog
from kvstore.node.meta import BlockMeta
from kvstore.node.proto_forms import tally_from_proto
from kvstore.node.publish_batcher import CoalescingPublisher
from kvstore.node.put_path import PutPath, abort_with, check_keys
from kvstore.protos import kvstore_pb2 as pb
from kvstore.protos import kvstore_pb2_grpc as pb_grpc
from kvstore.security.grants import Grant

#: Bytes of unfinished Put blocks a node buffers at most: this share of its capacity ...
_PENDING_SHARE = 4
#: ... but never less than this (a small test pool still takes a few MiB-sized blocks).
_MIN_PENDING_BYTES = 64 << 20


class _Servicer(PutPath, pb_grpc.StoreNodeServicer):
    def __init__(self, server: StoreServer) -> None:
        self.s = server
        self.pool = server.pool

    # -- who is calling ---------------------------------------------------------------------
    def grant(self, context: grpc.ServicerContext) -> Grant:
        try:
            return self.s.gate.grant_of(context)
        except Unauthenticated as exc:
            abort_with(context, exc)
            raise  # unreachable: abort raises

    def _admin(self, context: grpc.ServicerContext, call: str) -> Grant:
        grant = self.grant(context)
        try:
            grant.check_admin(call)
        except PermissionDenied as exc:
            abort_with(context, exc)
        return grant

    def _scope(self, request: pb.KeysRequest, context: grpc.ServicerContext) -> ReadScope:
        try:
            return self._read_scope(self.grant(context), request)
        except (PermissionDenied, ConfigError) as exc:
            abort_with(context, exc)
            raise  # unreachable

    def _read_scope(self, grant: Grant, request: pb.KeysRequest | pb.LeaseRequest) -> ReadScope:
        """What ``grant`` may read in the namespace ``request`` names (PermissionDenied,
        ConfigError otherwise)."""
        return read_scope(grant, spec_of(request), self.s.roots, request.reader_node_id)

    # -- data: Put and PutBatch are PutPath's (kvstore.node.put_path) ----------------
    def Get(self, request: pb.KeysRequest, context: grpc.ServicerContext) -> Iterator[pb.GetChunk]:
        scope = self._scope(request, context)
        try:
            keys = check_keys(request.keys)
        except ValueError as exc:
            abort_with(context, exc)
        return self.s.watchdog.responses(context, self._get(keys, scope))

    def _get(self, keys: list[bytes], scope: ReadScope) -> Iterator[pb.GetChunk]:
        chunk = self.s.chunk_bytes
        for key, visible in zip(keys, self.s.visible(keys, scope.root), strict=True):
            try:
                if not visible:
                    raise BlockNotFound(key.hex())
                with self.pool.read(key) as view:
                    total = len(view)
                    parts = [bytes(view[off : off + chunk]) for off in range(0, total, chunk)]
            except BlockNotFound:
                yield pb.GetChunk(key=key, found=False)
                continue
            self.s.record_reads([key], scope.reader_node_id)
            metrics.record_served("grpc", 1, total)
            for i, data in enumerate(parts):
                yield pb.GetChunk(key=key, found=True, total_nbytes=total, offset=i * chunk,
                                  data=data)

    # -- leases for same-node readers -------------------------------------------------------
    def Lease(self, request: pb.LeaseRequest, context: grpc.ServicerContext) -> pb.LeaseResponse:
        grant = self.grant(context)
        try:
            return self.lease_for(grant, request)
        except (KVStoreError, ValueError) as exc:
            abort_with(context, exc)
            raise  # unreachable: abort raises

    def lease_for(self, grant: Grant, request: pb.LeaseRequest) -> pb.LeaseResponse:
        """A lease for an authenticated caller, by gRPC or the bulk channel; raises the
        KVStoreError (or ValueError: bad keys) that refuses it."""
        for wire_id in request.release_lease_ids:  # the reader's finished leases, first
            self._release(wire_id, grant)
        scope = self._read_scope(grant, request)
        keys = check_keys(request.keys)
        ttl = self.s.lease_ttl(request.ttl_s)
        if not grant.admin:
            self.s.leases.check_room(grant.subject)
        wanted = [k for k, ok in zip(keys, self.s.visible(keys, scope.root), strict=True)
                  if ok]
        # absent keys are left out of the lease; disk blocks are checked in the namespace
        lease = self.pool.lease(wanted, ttl, namespace=scope.namespace,
                                files=request.accept_files)
        lease_id = self.s.leases.track(lease.lease_id, lease.expires_at, grant.subject)
        got = {loc.key for loc in lease.locations}
        metrics.record_served("shm", len(got), sum(loc.nbytes for loc in lease.locations))
        self.s.record_reads([k for k in keys if k in got], scope.reader_node_id)
        # Packed: the arena's blocks as three columns, the files (if any) as messages.
        arena = [loc for loc in lease.locations if not loc.path] if request.packed else []
        listed = [loc for loc in lease.locations if loc.path] if request.packed \
            else lease.locations
        return pb.LeaseResponse(
            lease_id=lease_id,
            locations=[pb.BlockLocation(key=loc.key, offset=loc.offset, nbytes=loc.nbytes,
                                        file=loc.path) for loc in listed],
            held_keys=b"".join(loc.key for loc in arena),
            offsets=[loc.offset for loc in arena],
            sizes=[loc.nbytes for loc in arena],
            missing=[k for k in keys if k not in got],
            expires_at=time.time() + ttl,  # the pool's clock is monotonic: send wall time
            shm_path=self.pool.path,
        )

    def RenewLease(self, request: pb.RenewLeaseRequest, context: grpc.ServicerContext
                   ) -> pb.RenewLeaseResponse:
        grant = self.grant(context)
        try:
            ttl = self.s.lease_ttl(request.ttl_s)
            pool_id = self.s.leases.for_renew(request.lease_id, grant.subject)
            if not self.pool.renew(pool_id, ttl):
                raise LeaseExpired(f"lease {request.lease_id!r} ended before it was renewed")
        except (KVStoreError, ValueError) as exc:
            abort_with(context, exc)
        self.s.leases.renewed(request.lease_id, time.monotonic() + ttl)
        return pb.RenewLeaseResponse(expires_at=time.time() + ttl)

    def ReleaseLease(self, request: pb.ReleaseLeaseRequest, context: grpc.ServicerContext
                     ) -> pb.Empty:
        self._release(request.lease_id, self.grant(context))
        return pb.Empty()

    def _release(self, wire_id: str, grant: Grant) -> None:
        """End the caller's own lease; another credential's id is ignored, quietly."""
        pool_id = self.s.leases.take(wire_id, grant.subject)
        if pool_id is not None:
            self.pool.release(pool_id)

    # -- presence and admin -----------------------------------------------------------------
    def Exists(self, request: pb.KeysRequest, context: grpc.ServicerContext) -> pb.ExistsResponse:
        grant = self.grant(context)
        try:
            return self.exists_for(grant, request)
        except KVStoreError as exc:
            abort_with(context, exc)
            raise  # unreachable: abort raises

    def exists_for(self, grant: Grant, request: pb.KeysRequest) -> pb.ExistsResponse:
        """Which keys the caller may see here, by gRPC or the bulk channel; raises the
        KVStoreError that refuses the call."""
        scope = self._read_scope(grant, request)
        keys = list(request.keys)
        present, sizes = [], []
        for key, visible in zip(keys, self.s.visible(keys, scope.root), strict=True):
            nbytes = self.pool.nbytes_of(key) if visible else None
            present.append(nbytes is not None)
            sizes.append(nbytes or 0)  # evicted since: 0, as if absent
        return pb.ExistsResponse(present=present, nbytes=sizes)

    def Delete(self, request: pb.KeysRequest, context: grpc.ServicerContext) -> pb.DeleteResponse:
        self._admin(context, "Delete")
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
        self._admin(context, "Evict")
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
        self._admin(context, "Stats")
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
        self.grant(context)  # any valid credential
        grpc_addr, bulk_addr = self.s.addresses
        return pb.HealthResponse(node_id=self.s.node_id, serving=True, grpc_address=grpc_addr,
                                 bulk_address=bulk_addr or "", shm_path=self.pool.path)

    def ReportReads(self, request: pb.ReaderReport, context: grpc.ServicerContext) -> pb.Empty:
        """A reader's metrics since its last report: served from this node's /metrics."""
        self._admin(context, "ReportReads")
        try:
            metrics.apply_reader_tally(tally_from_proto(request))
        except ValueError as exc:
            abort_with(context, exc)
        return pb.Empty()

    def ListKeys(self, request: pb.ListKeysRequest, context: grpc.ServicerContext
                 ) -> Iterator[pb.KeyPage]:
        self._admin(context, "ListKeys")
        return self.s.watchdog.responses(context, self._list_keys(request.page_size or 1024))

    def _list_keys(self, page_size: int) -> Iterator[pb.KeyPage]:
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
                 on_read: Callable[[list[bytes], str], None] | None = None,
                 data_key: bytes | None = None) -> None:
        """``on_read(keys, reader_node_id)`` hears of every block served (Get, Lease, bulk),
        with the reader's Ray node id ("" when the client did not say, or is a tenant): LRU
        touches and per-reader remote-read counts for hot-prefix replication come from it.
        ``data_key``: the cluster's data secret (``security.data_key``), with which writers
        and readers compute namespace roots; the node needs it to verify Puts and to know
        which blocks belong to the namespace a reader names."""
        self.pool = pool
        self.node_id = node_id
        self.config = config
        self.on_publish = on_publish
        # Concurrent Puts share one index call; each still returns only once it is visible.
        self.publisher = CoalescingPublisher(on_publish) if on_publish is not None else None
        self.on_read = on_read
        self.data_key = data_key
        self.gate = AuthGate.from_config(config)
        self.roots = RootCache(data_key)
        self.max_lease_ttl_s = config.max_lease_ttl_s
        self.default_lease_ttl_s = min(default_lease_ttl_s, config.max_lease_ttl_s)
        self.leases = LeaseTable()
        self.put_limits = PutLimits(config.max_concurrent_puts, max(
            pool.capacity_bytes // _PENDING_SHARE, _MIN_PENDING_BYTES))
        self.watchdog = StreamWatchdog(config.put_idle_timeout_s)
        # Headroom for the protobuf framing around one chunk of block bytes.
        self.chunk_bytes = config.max_message_bytes - (64 << 10)
        self.max_block_bytes = min(config.max_block_bytes, int(pool.capacity_bytes or 1 << 62))
        self.meta = BlockMeta(pool)
        self._grpc: grpc.Server | None = None
        self._bulk = BulkServer(pool, config, on_read=self.record_reads, data_key=data_key,
                                root_of=self.meta.cached_root) if bulk else None
        self._ports: tuple[int, int | None] = (0, None)

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> tuple[int, int | None]:
        """Bind and serve; returns ``(grpc_port, bulk_port)`` (bulk_port None if disabled).

        The worker pool has ``server.max_workers`` threads for reads and admin calls on top
        of the ``server.max_concurrent_puts`` that Put streams may hold while their clients
        send (or stall): stalled writers never take the last worker from readers."""
        cfg = self.config
        servicer = _Servicer(self)
        if self._bulk is not None:  # a same-node reader's calls on every warm read, faster
            self._bulk.calls = {
                "Lease": _on_bytes(pb.LeaseRequest, servicer.lease_for),
                "Exists": _on_bytes(pb.KeysRequest, servicer.exists_for)}
        self._grpc, port = start_grpc_server(
            cfg, cfg.port, lambda server: pb_grpc.add_StoreNodeServicer_to_server(
                servicer, server),
            max_workers=cfg.max_workers + cfg.max_concurrent_puts,
            thread_prefix=f"kvstore-grpc-{self.node_id}",
            max_message_bytes=cfg.max_message_bytes, what="server.port", gate=self.gate)
        self.watchdog.start()
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
        self.watchdog.stop()

    def set_auth_tokens(self, auth_token: str | None, previous_auth_token: str | None = None
                        ) -> None:
        """Accept ``auth_token`` (and, while a rotation hands it out, ``previous_auth_token``)
        on gRPC and the bulk channel from the next call on; blocks and leases are kept."""
        self.gate.set_tokens(auth_token, previous_auth_token)
        if self._bulk is not None:
            self._bulk.set_tokens(auth_token, previous_auth_token)

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

    def lease_ttl(self, ttl_s: float) -> float:
        """The TTL a lease asked for with ``ttl_s`` gets (``kvstore.node.leases.clamp_ttl``)."""
        return clamp_ttl(ttl_s, self.default_lease_ttl_s, self.max_lease_ttl_s)

    def lease_of(self, wire_id: str) -> object:
        """The pool's lease behind a wire lease id (LeaseExpired if unknown or released)."""
        return self.leases.pool_id(wire_id)

    def visible(self, keys: Sequence[bytes], root: bytes | None) -> list[bool]:
        """Whether each key is a held block of namespace ``root`` (None: any held block)."""
        if root is None:
            return [True] * len(keys)
        return [r == root for r in self.meta.roots_of(keys)]

    def remember(self, key: bytes, parent_key: bytes, namespace_root: bytes) -> None:
        self.meta.remember(key, parent_key, namespace_root)

    def remember_many(self, keys_and_parents: list[tuple[bytes, bytes]], namespace_root: bytes
                      ) -> None:
        self.meta.remember_many(keys_and_parents, namespace_root)

    def forget(self, key: bytes) -> None:
        self.meta.forget(key)

    def forget_many(self, keys: Sequence[bytes]) -> None:
        self.meta.forget_many(keys)

    def key_info(self, key: bytes) -> pb.KeyInfo | None:
        """What the index needs about a held block (header read once if not cached)."""
        meta = self.meta.get(key)
        nbytes = self.pool.nbytes_of(key) if meta is not None else None
        if meta is None or nbytes is None:  # not held, or evicted since it was read
            return None
        return pb.KeyInfo(key=key, nbytes=nbytes, parent_key=meta[0], namespace_root=meta[1])


def _on_bytes(request_type: Any, answer: Callable[[Grant, Any], Any]
              ) -> Callable[[Grant, bytes], bytes]:
    """``answer`` for the bulk channel's call frames: serialized request in, response out."""
    def call(grant: Grant, payload: bytes) -> bytes:
        try:
            request = request_type.FromString(payload)
        except Exception as exc:  # DecodeError: the client's fault
            raise ValueError(f"not a {request_type.__name__}: {exc}") from None
        return answer(grant, request).SerializeToString()

    return call
