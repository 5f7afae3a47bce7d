"""A client of one store node: gRPC for control, the bulk channel or shared memory for bytes.

One channel per client, reused for every call; every call has a deadline; UNAVAILABLE is
retried with exponential backoff (every call here is idempotent: blocks are immutable); a
``grpc.RpcError`` never leaves this module, it becomes the ``kvstore.errors`` class the server
raised. A fetch either returns whole blocks or raises: a node that dies mid-stream gives
``NodeUnavailable`` and no partial block.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np

from kvstore.client.arena_populate import Populator
from kvstore.client.bulk_client import BulkClient
from kvstore.client.device_copy import DeviceRows, StagingPool
from kvstore.client.device_reads import shm_into_device, staged_into_device
from kvstore.client.file_reads import read_leased
from kvstore.client.lease_releases import LeaseReleases
from kvstore.client.leased_reads import HeldLease, Read, read_under_lease
from kvstore.client.replies import (
    HeldBlock,
    LeaseInfo,
    NodeHealth,
    NodeStats,
    PutResult,
    blocks_of_get_stream,
    lease_info,
)
from kvstore.client.shm_reader import byte_view
from kvstore.client.verify_pool import verify_landed
from kvstore.config import ClientConfig
from kvstore.errors import (
    KVStoreError,
    NodeUnavailable,
    Overloaded,
)
from kvstore.keys import Namespace
from kvstore.node.auth import AUTH_HEADER
from kvstore.node.grpc_setup import open_channel
from kvstore.node.grpc_status import error_from_rpc
from kvstore.node.proto_forms import spec_from_namespace, tally_to_proto
from kvstore.node.put_wire import BATCH_BYTES, UNARY_PUT_BYTES, encode_put_batch, put_messages
from kvstore.protos import kvstore_pb2 as pb
from kvstore.protos import kvstore_pb2_grpc as pb_grpc
from kvstore.reader_metrics import ReaderTally
from kvstore.security.tls import client_ssl_context

T = TypeVar("T")
Buffer = bytearray | memoryview | Any  # anything ShmReader / recv_into can write into

class StoreNodeClient:
    """Talks to one store node; thread-safe (gRPC channels and the bulk pool are)."""

    def __init__(self, grpc_address: str, *, bulk_address: str | None = None,
                 shm_path: str | None = None, same_node: bool = False,
                 config: ClientConfig | None = None, tls_server_name: str | None = None,
                 lease_ttl_s: float = 30.0, reader_node_id: str | None = None) -> None:
        """``reader_node_id``: the Ray node this reader runs on (default ``config.node_id``),
        sent with every read so the node can count remote reads per reader node."""
        self.config = config or ClientConfig()
        self.reader_node_id = reader_node_id or self.config.node_id or ""
        self.address = grpc_address
        self.same_node = same_node and shm_path is not None
        self.shm_path = shm_path
        self.lease_ttl_s = lease_ttl_s
        cfg = self.config
        self._channel = open_channel(grpc_address, cfg, cfg.max_message_bytes,
                                     tls_server_name)
        self._stub = pb_grpc.StoreNodeStub(self._channel)
        # PutBatch with the request already serialized (``encode_put_batch``).
        self._put_batch = self._channel.unary_unary(
            f"/{pb.DESCRIPTOR.services_by_name['StoreNode'].full_name}/PutBatch",
            request_serializer=None,
            response_deserializer=pb.PutResponse.FromString)
        self._metadata = ((AUTH_HEADER, f"Bearer {cfg.auth_token}"),) if cfg.auth_token else None
        self._chunk = cfg.max_message_bytes - (64 << 10)
        self._bulk = BulkClient(bulk_address, auth_token=cfg.auth_token,
                                ssl_context=client_ssl_context(cfg), timeout_s=cfg.timeout_s,
                                server_hostname=tls_server_name,
                                reader_node_id=self.reader_node_id,
                                request_blocks=cfg.bulk_request_blocks,
                                pipeline_depth=cfg.bulk_pipeline_depth,
                                streams=cfg.bulk_streams) if bulk_address else None
        self._shm: Any = None
        self._shm_lock = threading.Lock()
        self._staging = StagingPool()  # host rows remote blocks land in on their way to a device
        # Finished leases, released by the next lease call or soon after (release_nowait).
        self._releases = LeaseReleases(lambda lease_id: self.release(lease_id),
                                       lambda: RELEASE_DELAY_S)

    @property
    def has_bulk(self) -> bool:
        """Whether remote reads use the bulk byte channel (else gRPC Get)."""
        return self._bulk is not None

    # -- plumbing ---------------------------------------------------------------------------
    def _call(self, fn: Callable[[], T]) -> T:
        """Run one call with retries on UNAVAILABLE; map every failure to a kvstore error.

        A node at one of its limits (``Overloaded``: Put streams, open leases) did nothing,
        so that is retried too, with backoff, for up to ``timeout_s``."""
        delay, busy_delay = 0.05, 0.02
        attempt = 0
        give_up_at = time.monotonic() + self.config.timeout_s
        while True:
            try:
                return fn()
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE and attempt < self.config.retries:
                    attempt += 1
                    time.sleep(delay)
                    delay *= 2
                    continue
                err = error_from_rpc(exc, self.address)
                if isinstance(err, Overloaded) and time.monotonic() + busy_delay < give_up_at:
                    time.sleep(busy_delay)
                    busy_delay = min(busy_delay * 2, 1.0)
                    continue
                raise err from None

    def _unary(self, method: Any, request: Any) -> Any:
        return self._call(lambda: method(request, timeout=self.config.timeout_s,
                                         metadata=self._metadata))

    # -- data -------------------------------------------------------------------------------
    def put_blocks(self, namespace: Namespace, blocks: Sequence[tuple[bytes, Buffer]]
                   ) -> PutResult:
        """Store encoded ``(key, block)`` pairs in one call; returns once they're visible.

        Runs of equal-sized blocks that fit travel as batch messages (``PutChunk.keys``, up to
        ``BATCH_BYTES`` each), since a message per small block costs more in gRPC's per-message
        work on both ends than its bytes. A block larger than a batch travels in chunks.
        """
        spec = spec_from_namespace(namespace)
        views = [(bytes(key), memoryview(buf).cast("B")) for key, buf in blocks]
        per_batch = min(self._chunk, BATCH_BYTES)

        def messages() -> Iterator[pb.PutChunk]:
            for i, msg in enumerate(put_messages(views, self._chunk, per_batch)):
                if i == 0:
                    msg.namespace.CopyFrom(spec)
                yield msg

        if not views:
            return PutResult(0, 0)
        size = len(views[0][1])
        if all(len(v) == size for _, v in views) and (size + 64) * len(views) <= per_batch:
            # Fits one message: a unary call (no request-streaming thread per call), its
            # bytes written by hand so the blocks are copied once (protobuf would copy thrice).
            resp = self._unary(self._put_batch, encode_put_batch(
                spec, [k for k, _ in views], size, [v for _, v in views]))
        else:
            resp = self._call(lambda: self._stub.Put(messages(), timeout=self.config.timeout_s,
                                                     metadata=self._metadata))
        return PutResult(resp.num_stored, resp.num_existing)

    def put_rows(self, namespace: Namespace, keys: list[bytes], rows: np.ndarray) -> PutResult:
        """``put_blocks`` for blocks encoded back to back (``rows``: a C-contiguous uint8
        ``[n, block_nbytes]`` array, as ``ClusterStore.batch_put`` encodes a batch): a batch
        of up to ``UNARY_PUT_BYTES`` is one message written from the array as it is."""
        if len(keys) != len(rows):
            raise ValueError(f"{len(keys)} keys for {len(rows)} encoded blocks")
        if not len(keys):
            return PutResult(0, 0)
        if (rows.shape[1] + 64) * len(keys) > min(self._chunk, UNARY_PUT_BYTES) \
                or not rows.flags.c_contiguous:
            return self.put_blocks(namespace, list(zip(keys, rows, strict=True)))
        resp = self._unary(self._put_batch, encode_put_batch(
            spec_from_namespace(namespace), keys, rows.shape[1], [rows]))
        return PutResult(resp.num_stored, resp.num_existing)

    def get_blocks(self, keys: Sequence[bytes], namespace: Namespace | None = None
                   ) -> list[bytes | bytearray | None]:
        """Whole encoded blocks (None where the node does not hold the key), in order.

        ``namespace``: the namespace read in; the node serves only its blocks, to a credential
        granting its tenant. Only the cluster token may leave it out (replication)."""
        keys = [bytes(k) for k in keys]
        if self._bulk is not None:
            out: list[bytes | bytearray | None] = [None] * len(keys)

            def alloc(i: int, nbytes: int) -> memoryview:
                buf = bytearray(nbytes)
                out[i] = buf
                return memoryview(buf)

            sizes = self._bulk.fetch_into(keys, alloc, namespace=namespace)
            return [b if s is not None else None for b, s in zip(out, sizes, strict=True)]
        return self._call(lambda: self._grpc_get(keys, namespace))

    def _keys_request(self, keys: list[bytes], namespace: Namespace | None) -> pb.KeysRequest:
        return pb.KeysRequest(keys=keys, reader_node_id=self.reader_node_id,
                              namespace=None if namespace is None
                              else spec_from_namespace(namespace))

    def _grpc_get(self, keys: list[bytes], namespace: Namespace | None
                  ) -> list[bytes | bytearray | None]:
        stream = self._stub.Get(self._keys_request(keys, namespace),
                                timeout=self.config.timeout_s, metadata=self._metadata)
        return blocks_of_get_stream(stream, keys, self.address)

    def get_blocks_into(self, keys: Sequence[bytes], buffers: Sequence[Buffer],
                        namespace: Namespace | None = None) -> list[int | None]:
        """Copy blocks into the caller's buffers; returns each block's size (None: absent).

        Same node: lease, one copy from the holder's shared memory, release. Otherwise the
        bulk channel (``recv_into`` the buffers), else gRPC. ``namespace``: as in
        ``get_blocks`` (unverified here: ``get_verified_into`` verifies).
        """
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        keys = [bytes(k) for k in keys]
        if self.same_node:
            return self._shm_get_into(keys, buffers, scope=namespace)
        if self._bulk is not None:
            return self._bulk.fetch_into(keys, lambda i, n: byte_view(buffers[i]),
                                         namespace=namespace)
        sizes: list[int | None] = []
        for data, buf in zip(self._call(lambda: self._grpc_get(keys, namespace)), buffers,
                             strict=True):
            if data is None:
                sizes.append(None)
                continue
            dst = byte_view(buf)
            if len(dst) < len(data):
                raise ValueError(f"buffer of {len(dst)} bytes is too small for a "
                                 f"{len(data)}-byte block")
            dst[: len(data)] = data
            sizes.append(len(data))
        return sizes

    def _reader(self) -> Any:
        from kvstore.client.shm_reader import ShmReader

        with self._shm_lock:
            if self._shm is None:
                self._shm = ShmReader(self.shm_path)  # type: ignore[arg-type]
            return self._shm

    def warm_up(self) -> None:
        """Open the channel (one Health round trip) and, on the same node, map the arena, so
        the first read does not pay for them."""
        self.health()
        if self.same_node:
            self._reader()

    def populate_arena(self, cores: set[int] | None = None) -> Populator | None:
        """On the same node, start mapping the whole arena in the background
        (``ShmReader.populate``); None elsewhere."""
        return self._reader().populate(cores) if self.same_node else None

    def prepare_device_reads(self, device: Any, *, wait: bool = False) -> bool:
        """Start page-locking the holder's arena for DMA into ``device`` (same node only), in
        the background: reads stage until it is done (``ShmReader.pin_for_dma``). Whether it
        is page-locked now (with ``wait``: once it is done)."""
        return self.same_node and self._reader().pin_for_dma(device, wait=wait)

    def get_verified_into(self, namespace: Namespace, keys: Sequence[bytes],
                          token_ids: Sequence[Any], buffers: Sequence[Buffer], *,
                          held: HeldLease | None = None) -> list[int | KVStoreError | None]:
        """Fetch and verify blocks into the caller's buffers, in order.

        Per key: the block's size (verified: header, tokens, checksum), the ``BlockCorrupted``
        / ``BlockMismatch`` / ``NamespaceMismatch`` that rejected it, or None (not held).
        Same node each block is copied and its copy hashed while cache-hot, the batch's blocks
        spread over the verify pool's threads; remote blocks are verified after they land
        (over the same threads), a request while the next one streams. ``held``: a same-node
        read's lease, taken by another process's lookup (``leased_reads``).
        """
        if not len(keys) == len(token_ids) == len(buffers):
            raise ValueError(f"{len(keys)} keys, {len(token_ids)} token lists and "
                             f"{len(buffers)} buffers: one of each per block")
        keys = [bytes(k) for k in keys]
        if self.same_node:
            return self._shm_get_into(keys, buffers, namespace, token_ids, held=held)
        out: list[int | KVStoreError | None] = [None] * len(keys)
        views = [byte_view(b) for b in buffers]

        def verify(lo: int, sizes: Sequence[int | None]) -> None:
            hi = lo + len(sizes)
            out[lo:hi] = verify_landed(namespace, keys[lo:hi], token_ids[lo:hi], views[lo:hi],
                                       sizes)

        if self._bulk is not None:
            # Verified request by request, while the node already streams the next one.
            self._bulk.fetch_into(keys, lambda i, n: views[i], verify, namespace=namespace)
        else:
            verify(0, self.get_blocks_into(keys, buffers, namespace))
        return out

    def get_verified_into_device(self, namespace: Namespace, keys: Sequence[bytes],
                                 token_ids: Sequence[Any], sink: DeviceRows, rows: Sequence[int],
                                 *, held: HeldLease | None = None
                                 ) -> list[int | KVStoreError | None]:
        """``get_verified_into`` for a device: block ``i``'s payload goes to row ``rows[i]`` of
        ``sink`` (``kvstore.client.device_reads``: same node straight from the page-locked arena,
        verified beside the copy; otherwise through reused host staging rows, one copy per
        batch). Copies have landed when this returns; a rejected block's row holds no bytes
        of it. Verdicts as ``get_verified_into``'s."""
        if not len(keys) == len(token_ids) == len(rows):
            raise ValueError(f"{len(keys)} keys, {len(token_ids)} token lists and "
                             f"{len(rows)} rows: one of each per block")
        keys = [bytes(k) for k in keys]
        if self.same_node:
            return self._leased(keys, namespace, lambda reader, where, keep_alive: shm_into_device(
                reader, where, keys, token_ids, namespace, sink, rows, keep_alive, self._staging),
                held=held)

        def land(lo: int, hi: int, stage: Any) -> tuple[list[Any], range]:
            return self.get_verified_into(namespace, keys[lo:hi], token_ids[lo:hi],
                                          list(stage.numpy())), range(hi - lo)

        return staged_into_device(land, len(keys), namespace, sink, rows, self._staging)

    def _shm_get_into(self, keys: list[bytes], buffers: Sequence[Buffer],
                      namespace: Namespace | None = None,
                      token_ids: Sequence[Any] | None = None, *,
                      scope: Namespace | None = None, files: bool = True,
                      held: HeldLease | None = None) -> list[Any]:
        """Lease, copy each block once out of the holder's arena or read it from its disk-tier
        file (verified in the same pass when ``namespace`` is given: ``file_reads``), then
        release without waiting for the reply; files gone or unreadable by then are asked
        for once more, without files. ``scope``: the namespace the lease is asked in."""
        again: list[int] = []
        out = self._leased(keys, scope or namespace, lambda reader, where, keep_alive: read_leased(
            reader, where, keys, buffers, namespace, token_ids, keep_alive, again), files=files,
            held=held)
        if again:
            redo = self._shm_get_into([keys[i] for i in again], [buffers[i] for i in again],
                                      namespace, None if token_ids is None else
                                      [token_ids[i] for i in again], scope=scope, files=False)
            for i, verdict in zip(again, redo, strict=True):
                out[i] = verdict
        return out

    def _leased(self, keys: list[bytes], namespace: Namespace | None, read: Read, *,
                files: bool = False, held: HeldLease | None = None) -> list[Any]:
        """``read`` under a lease on ``keys`` (``held``, a fresh one handed over, or asked in
        ``namespace`` now): ``leased_reads.read_under_lease``."""
        return read_under_lease(self, keys, namespace, read, files=files, held=held)

    # -- leases -----------------------------------------------------------------------------
    def lease_here(self, keys: Sequence[bytes], ttl_s: float, *, namespace: Namespace,
                   files: bool = False) -> LeaseInfo | None:
        """``lease`` over the bulk channel only: None when there is none or it failed or the
        node refused (at its lease limit, say), so a lookup never waits on gRPC's retries."""
        try:
            return self.lease(keys, ttl_s, namespace=namespace, files=files, bulk_only=True)
        except (KVStoreError, OSError):
            return None

    def lease(self, keys: Sequence[bytes], ttl_s: float, *,
              namespace: Namespace | None = None, files: bool = False,
              bulk_only: bool = False) -> LeaseInfo:
        """Pin the held ``keys`` on the node for ``ttl_s`` seconds (absent ones are listed;
        the node clamps ``ttl_s`` to ``server.max_lease_ttl_s``). ``namespace``: as in
        ``get_blocks``. ``files``: disk blocks may come back as files (``file_reads``).
        Leases ended with ``release_nowait`` and not sent yet ride along and are released
        first (put back if the call fails: the release thread sends them then). A same-node
        reader asks over the bulk channel (one socket round trip), gRPC if that fails."""
        done = self._releases.take()
        request = pb.LeaseRequest(
            keys=list(keys), ttl_s=ttl_s, reader_node_id=self.reader_node_id,
            release_lease_ids=done, accept_files=files and self.same_node,
            namespace=None if namespace is None else spec_from_namespace(namespace),
            packed=True)
        try:
            resp = self._bulk_call("Lease", request, pb.LeaseResponse)
            if resp is None and bulk_only:
                raise NodeUnavailable(f"{self.address}: no lease on the bulk channel")
            if resp is None:
                resp = self._unary(self._stub.Lease, request)
        except BaseException:
            self._releases.put_back(done)
            raise
        return lease_info(resp)

    def renew(self, lease_id: str, ttl_s: float) -> float:
        """Extend a lease; returns its new wall-clock expiry. LeaseExpired if it already ended."""
        return self._unary(self._stub.RenewLease,
                           pb.RenewLeaseRequest(lease_id=lease_id, ttl_s=ttl_s)).expires_at

    def release(self, lease_id: str) -> None:
        """End a lease (idempotent)."""
        self._unary(self._stub.ReleaseLease, pb.ReleaseLeaseRequest(lease_id=lease_id))

    def release_nowait(self, lease_id: str) -> None:
        """End a lease without waiting: the bytes are already copied, and a release that fails
        costs nothing but the lease running to its TTL.

        The release rides on this reader's next ``lease``, one call fewer per read; a reader
        that reads nothing more within ``RELEASE_DELAY_S`` has it sent by one long-lived
        thread, which costs the reader less than a gRPC future or a blocking call per
        release.
        """
        self._releases.add(lease_id)

    # -- admin ------------------------------------------------------------------------------
    def exists(self, keys: Sequence[bytes], namespace: Namespace | None = None) -> list[bool]:
        """Whether the node holds each key (in ``namespace``: as in ``get_blocks``)."""
        request = self._keys_request([bytes(k) for k in keys], namespace)
        resp = self._bulk_call("Exists", request, pb.ExistsResponse)
        if resp is None:
            resp = self._unary(self._stub.Exists, request)
        return list(resp.present)

    def held_here(self, keys: Sequence[bytes], namespace: Namespace) -> list[bool] | None:
        """``exists`` for a same-node reader on the bulk channel only: None when there is
        none or it failed (a lookup then asks the index, and never waits on gRPC retries)."""
        request = self._keys_request([bytes(k) for k in keys], namespace)
        resp = self._bulk_call("Exists", request, pb.ExistsResponse)
        return None if resp is None else list(resp.present)

    def _bulk_call(self, method: str, request: Any, response_type: Any) -> Any:
        """A same-node reader's ``method`` on the bulk channel (one socket round trip, where
        a gRPC unary costs about a millisecond on a busy host), or None when this client
        has no such channel or the call failed: gRPC asks then."""
        if not (self.same_node and self._bulk is not None):
            return None
        return self._bulk.try_call(method, request, response_type)

    def delete(self, keys: Sequence[bytes]) -> int:
        return self._unary(self._stub.Delete, pb.KeysRequest(keys=list(keys))).num_deleted

    def evict(self, keys: Sequence[bytes]) -> int:
        """Evict unleased, unpinned blocks among ``keys``; returns the bytes freed."""
        return self._unary(self._stub.Evict, pb.KeysRequest(keys=list(keys))).bytes_freed

    def stats(self) -> NodeStats:
        r = self._unary(self._stub.Stats, pb.Empty())
        return NodeStats(r.node_id, r.capacity_bytes, r.used_bytes, r.num_blocks, r.num_leased,
                         r.num_pinned)

    def health(self) -> NodeHealth:
        r = self._unary(self._stub.Health, pb.Empty())
        return NodeHealth(r.node_id, r.serving, r.grpc_address, r.bulk_address or None,
                          r.shm_path)

    def report_reads(self, tally: ReaderTally, timeout_s: float = 2.0) -> None:
        """Push a reader's metrics tally to this node, which serves it on its /metrics.

        One try with a short deadline: a failed push is kept for the next one, and a reader
        closing next to a dead node must not wait ``timeout_s`` times the retries for it.
        """
        message = tally_to_proto(tally)
        try:
            self._stub.ReportReads(message, timeout=min(timeout_s, self.config.timeout_s),
                                   metadata=self._metadata)
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, self.address) from None

    def list_keys(self, page_size: int = 1024) -> list[HeldBlock]:
        def run() -> list[HeldBlock]:
            pages = self._stub.ListKeys(pb.ListKeysRequest(page_size=page_size),
                                        timeout=self.config.timeout_s, metadata=self._metadata)
            return [HeldBlock(k.key, k.nbytes, k.parent_key, k.namespace_root)
                    for page in pages for k in page.keys]

        return self._call(run)

    def close(self) -> None:
        """Close the channel, idle bulk connections and the shared-memory mapping."""
        self._releases.close()  # let queued releases land rather than leave leases to expire
        self._channel.close()
        self._staging.close()
        if self._bulk is not None:
            self._bulk.close()
        with self._shm_lock:
            if self._shm is not None:
                self._shm.close()
                self._shm = None

    def __enter__(self) -> StoreNodeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: How long a finished lease waits for the reader's next ``lease`` to carry its release.
RELEASE_DELAY_S = 0.02
