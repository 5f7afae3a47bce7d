"""A store node's gRPC server: streamed put/get, leases for same-node readers, admin calls.

Errors leave as gRPC status codes here (the table is in ``kvstore.node.wire``). Put is two-phase
per block (reserve arena space -> copy the chunks in -> verify header and checksum -> commit),
and the Put call returns only after ``on_publish`` made the keys visible in the index, so a
reader that asks after ``put`` returned finds them (concurrent Puts share one ``on_publish``
call: ``kvstore.node.publisher``). Small blocks arrive many to a message (``PutChunk.keys``),
verified as a batch before they are copied in, and a Put that fits one message comes as the
unary ``PutBatch`` (same rules as the stream).
Remote bulk reads go through ``kvstore.node.bulk`` instead of ``Get`` when the client has its
address (see that module for why).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import numpy as np

from kvstore import metrics
from kvstore.block import read_header, verify_block
from kvstore.block_batch import verify_blocks
from kvstore.config import ServerConfig
from kvstore.constants import KEY_NBYTES
from kvstore.errors import (
    BlockCorrupted,
    BlockMismatch,
    BlockNotFound,
    ConfigError,
    KVStoreError,
    LeaseExpired,
    NamespaceMismatch,
    PoolFull,
    RequestTooLarge,
)
from kvstore.index.base import IndexEntry
from kvstore.keys import Namespace
from kvstore.node.bulk import BulkServer
from kvstore.node.pool import ServedPool
from kvstore.node.publisher import CoalescingPublisher
from kvstore.node.wire import (
    AuthInterceptor,
    grpc_options,
    namespace_from_spec,
    status_for,
    tally_from_proto,
)
from protos import kvstore_pb2 as pb
from protos import kvstore_pb2_grpc as pb_grpc


def _abort(context: grpc.ServicerContext, exc: BaseException) -> None:
    context.abort(status_for(exc), f"{type(exc).__name__}: {exc}")


def _check_keys(keys: Any) -> list[bytes]:
    keys = list(keys)
    for key in keys:
        if len(key) != KEY_NBYTES:
            raise ValueError(f"block keys are {KEY_NBYTES}-byte sha256 digests, got {len(key)}")
    return keys


class _PutBlock:
    """One block being received: its reservation and how many bytes have arrived."""

    __slots__ = ("key", "total", "received", "reservation")

    def __init__(self, key: bytes, total: int, reservation: Any) -> None:
        self.key = key
        self.total = total
        self.received = 0
        self.reservation = reservation  # None when the block is already held: drain only


class _Servicer(pb_grpc.StoreNodeServicer):
    def __init__(self, server: StoreServer) -> None:
        self.s = server
        self.pool = server.pool

    # -- data -----------------------------------------------------------------------------
    def Put(self, request_iterator: Iterator[pb.PutChunk], context: grpc.ServicerContext
            ) -> pb.PutResponse:
        started = time.perf_counter()
        entries: list[IndexEntry] = []
        num_existing = 0
        current: _PutBlock | None = None
        namespace: Namespace | None = None
        try:
            for msg in request_iterator:
                if namespace is None:
                    if not msg.HasField("namespace"):
                        raise ValueError("the first Put message must carry the namespace")
                    namespace = namespace_from_spec(msg.namespace)
                if msg.keys:
                    if current is not None:
                        raise ValueError("a Put batch message arrived inside a chunked block")
                    num_existing += self._put_batch(msg, namespace, entries)
                    continue
                if current is None:
                    current = self._begin_block(msg.key, msg.total_nbytes)
                elif msg.key and msg.key != current.key:
                    raise ValueError("a Put block ended early: its chunks stopped before "
                                     f"total_nbytes={current.total}")
                if msg.offset != current.received:
                    raise ValueError(f"Put chunk offset {msg.offset} != expected "
                                     f"{current.received} (chunks must be in order)")
                n = len(msg.data)
                if current.received + n > current.total:
                    raise ValueError("Put chunk runs past the block's total_nbytes")
                if current.reservation is not None:
                    current.reservation.view[current.received : current.received + n] = msg.data
                current.received += n
                if current.received == current.total:
                    entry = self._finish_block(current, namespace)
                    if entry is None:
                        num_existing += 1
                    else:
                        entries.append(entry)
                    current = None
            if current is not None:
                raise ValueError(f"Put stream ended inside block {current.key.hex()[:16]} "
                                 f"({current.received}/{current.total} bytes)")
        except (KVStoreError, ValueError) as exc:
            metrics.record_rejected(_reject_reason(exc))
            if current is not None and current.reservation is not None:
                self.pool.abort(current.reservation)
            self._publish(entries, context)  # the blocks verified before the bad one are good
            count_stored(entries)
            _abort(context, exc)
        self._publish(entries, context)
        count_stored(entries)
        metrics.observe_put(time.perf_counter() - started)
        return pb.PutResponse(num_stored=len(entries), num_existing=num_existing)

    def PutBatch(self, request: pb.PutBatchRequest, context: grpc.ServicerContext
                 ) -> pb.PutResponse:
        """A whole Put in one message: the same checks, verdicts and visibility as ``Put``."""
        return self.Put(iter(request.chunks), context)

    def _put_batch(self, msg: pb.PutChunk, namespace: Namespace, entries: list[IndexEntry]
                   ) -> int:
        """Store the whole blocks of one batch message (appending to ``entries`` as each one
        commits, so a failure keeps the good ones before it); returns how many were held.

        The batch is verified in the message buffer first (``verify_blocks``: the per-block
        verdicts in a few array passes), then each good block is reserved, copied and
        committed: the bytes copied are the bytes verified, since the message is immutable.
        """
        total = msg.total_nbytes
        n = len(msg.keys)
        if len(msg.data) != total * n:
            raise ValueError(f"a Put batch of {n} blocks of {total} bytes carries "
                             f"{len(msg.data)} bytes")
        self._check_total(total)
        keys = [bytes(k) for k in msg.keys]
        rows = np.frombuffer(msg.data, dtype=np.uint8).reshape(n, total)
        verdicts = verify_blocks(rows, namespace, keys)
        num_existing = 0
        done = 0
        while done < n:
            # The run of blocks up to the next bad one is stored in one go; then the bad one
            # is drained if the node holds its key already, else it fails the Put (the good
            # blocks before it are kept), exactly as block by block.
            bad = next((i for i in range(done, n) if len(keys[i]) != KEY_NBYTES
                        or isinstance(verdicts[i], Exception)), n)
            if bad > done:
                num_existing += self._store_run(keys[done:bad], rows[done:bad],
                                                verdicts[done:bad], namespace, entries)
            if bad == n:
                break
            if len(keys[bad]) != KEY_NBYTES:
                _check_keys([keys[bad]])  # raises the same error as per block
            if not self.pool.contains(keys[bad]):
                raise verdicts[bad]  # type: ignore[misc]
            num_existing += 1  # held already: its bytes are drained, as per block
            done = bad + 1
        return num_existing

    def _store_run(self, keys: list[bytes], rows: np.ndarray, parents: list[Any],
                   namespace: Namespace, entries: list[IndexEntry]) -> int:
        """Reserve, copy and commit verified blocks (``parents``: their parent keys), one pool
        lock hold per step; returns how many the node held already. A pool that runs out of
        room part way keeps (and publishes) the blocks committed before."""
        total = rows.shape[1]
        node_id, root = self.s.node_id, namespace.root
        num_existing = pos = 0
        while pos < len(keys):
            reservations = self.pool.reserve_many(keys[pos:], total)
            mine = [r for r in reservations if r is not None]
            try:
                for res, row in zip(reservations, rows[pos:], strict=False):
                    if res is not None:
                        res.view[:total] = row.data
            except BaseException:
                for res in mine:
                    self.pool.abort(res)
                raise
            committed = iter(self.pool.commit_many(mine))
            stored = [(key, parent) for key, parent, res in zip(keys[pos:], parents[pos:],
                                                                reservations, strict=False)
                      if res is not None and next(committed)]
            self.s.remember_many(stored, root)
            entries.extend(IndexEntry(key, node_id, total, parent, root)
                           for key, parent in stored)
            num_existing += len(reservations) - len(stored)
            pos += len(reservations)
        return num_existing

    def _check_total(self, total: int) -> None:
        if total <= 0:
            raise ValueError("Put block total_nbytes must be > 0")
        if total > self.s.max_block_bytes:
            raise RequestTooLarge(f"block of {total} bytes exceeds the node's limit of "
                                  f"{self.s.max_block_bytes} bytes")

    def _begin_block(self, key: bytes, total: int) -> _PutBlock:
        key = bytes(key)
        _check_keys([key])
        self._check_total(total)
        if self.pool.contains(key):
            return _PutBlock(key, total, None)
        return _PutBlock(key, total, self.pool.reserve(key, total))

    def _finish_block(self, block: _PutBlock, namespace: Namespace) -> IndexEntry | None:
        res = block.reservation
        if res is None:
            return None
        block.reservation = None  # from here on this function owns it: commit or abort
        try:
            header = verify_block(res.view[: block.total], namespace, block.key)
        except BaseException:
            self.pool.abort(res)
            raise
        if not self.pool.commit(res):
            return None  # a concurrent writer committed the same immutable block first
        self.s.remember(block.key, header.parent_key, header.namespace_root)
        return IndexEntry(block.key, self.s.node_id, block.total, header.parent_key,
                          header.namespace_root)

    def _publish(self, entries: list[IndexEntry], context: grpc.ServicerContext) -> None:
        if entries and self.s.publisher is not None:
            try:
                self.s.publisher.publish(entries)
            except Exception as exc:  # the index is down: the caller must not think it's visible
                context.abort(grpc.StatusCode.UNAVAILABLE, f"blocks stored but the index "
                              f"did not accept them: {type(exc).__name__}: {exc}")

    def Get(self, request: pb.KeysRequest, context: grpc.ServicerContext) -> Iterator[pb.GetChunk]:
        try:
            keys = _check_keys(request.keys)
        except ValueError as exc:
            _abort(context, exc)
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
        try:
            keys = _check_keys(request.keys)
            ttl = request.ttl_s if request.ttl_s > 0 else self.s.default_lease_ttl_s
            lease = self.pool.lease(keys, ttl)  # absent keys are left out of the lease
        except (KVStoreError, ValueError) as exc:
            _abort(context, exc)
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
            _abort(context, exc)
        return pb.RenewLeaseResponse(expires_at=time.time() + ttl)

    def ReleaseLease(self, request: pb.ReleaseLeaseRequest, context: grpc.ServicerContext
                     ) -> pb.Empty:
        lease_id = self.s.forget_lease(request.lease_id)
        if lease_id is not None:
            self.pool.release(lease_id)
        return pb.Empty()

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
                _abort(context, exc)
            self.s.forget(key)
        return pb.DeleteResponse(num_deleted=n)

    def Evict(self, request: pb.KeysRequest, context: grpc.ServicerContext) -> pb.EvictResponse:
        keys = list(request.keys)
        held = [k for k in keys if self.pool.contains(k)]
        try:
            freed = self.pool.evict(keys)
        except KVStoreError as exc:
            _abort(context, exc)
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
            _abort(context, exc)
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


def _reject_reason(exc: BaseException) -> str:
    if isinstance(exc, NamespaceMismatch):
        return "namespace"
    if isinstance(exc, BlockMismatch):
        return "mismatch"
    if isinstance(exc, BlockCorrupted):
        return "corrupted"
    if isinstance(exc, RequestTooLarge):
        return "too_large"
    if isinstance(exc, PoolFull):
        return "pool_full"
    return "malformed"


def count_stored(entries: list[IndexEntry]) -> None:
    """Count the blocks a Put stored (not the ones the node already held)."""
    if entries:
        metrics.record_stored("put", len(entries), sum(e.nbytes for e in entries))


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
        interceptors = [AuthInterceptor(cfg.auth_token)] if cfg.auth_token else []
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=cfg.max_workers,
                                       thread_name_prefix=f"kvstore-grpc-{self.node_id}"),
            interceptors=interceptors, options=grpc_options(cfg.max_message_bytes),
        )
        pb_grpc.add_StoreNodeServicer_to_server(_Servicer(self), server)
        bind = f"{cfg.host}:{cfg.port}"
        if cfg.tls_cert_file and cfg.tls_key_file:
            with open(cfg.tls_key_file, "rb") as f:
                key = f.read()
            with open(cfg.tls_cert_file, "rb") as f:
                cert = f.read()
            port = server.add_secure_port(bind, grpc.ssl_server_credentials([(key, cert)]))
        else:
            port = server.add_insecure_port(bind)
        if port == 0:
            raise ConfigError(f"cannot bind the gRPC server to {bind}; pick a free server.port")
        server.start()
        self._grpc = server
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
