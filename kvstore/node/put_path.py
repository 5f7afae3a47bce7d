"""A store node's write path: the Put stream and the unary PutBatch, block by block or a batch
message at a time, each Put returning only after its keys are visible in the index.

Kept apart from ``kvstore.node.store_server`` (which serves reads, leases and admin calls and mixes
this in as ``PutPath``) because it is the one path with its own rules: the credential must
grant the namespace's tenant before anything is read, every block must be exactly the
namespace's block size (itself at most ``server.max_block_bytes``), two-phase per block
(the chunks of a block buffered until it is whole -> reserve arena space -> copy -> verify ->
commit), a batch message verified in its buffer and stored a run at a time, the good blocks
before a bad one kept, and the publish (``on_publish``, coalesced by
``kvstore.node.publish_batcher``) before the call returns.

Space in the pool is reserved only for bytes in hand: a chunked block waits in its own
messages (capped, ``kvstore.node.limits``) until its last chunk arrived, so a stalled Put
never holds pool space, and making room for a reservation (the store node may evict then)
is only ever done for a block that is complete. Put streams are capped and watched for
silence; a PutBatch arrives whole, so it holds no worker while its client is slow.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import grpc
import numpy as np

from kvstore import metrics
from kvstore.block import block_nbytes, verify_block
from kvstore.block_batch import verify_blocks
from kvstore.constants import KEY_NBYTES
from kvstore.errors import (
    BlockCorrupted,
    BlockMismatch,
    KVStoreError,
    NamespaceMismatch,
    Overloaded,
    PermissionDenied,
    PoolFull,
    RequestTooLarge,
)
from kvstore.index.base import IndexEntry
from kvstore.keys import Namespace
from kvstore.node.grpc_status import status_for
from kvstore.node.limits import Watch
from kvstore.node.proto_forms import namespace_from_spec
from kvstore.protos import kvstore_pb2 as pb
from kvstore.security.grants import Grant


def abort_with(context: grpc.ServicerContext, exc: BaseException) -> NoReturn:
    """End the call with the status ``exc`` travels as; the client rebuilds it by name."""
    context.abort(status_for(exc), f"{type(exc).__name__}: {exc}")
    raise AssertionError("context.abort returned")  # it raises


def check_keys(keys: Any) -> list[bytes]:
    """``keys`` as a list, each a 32-byte key (ValueError names the wrong length)."""
    keys = list(keys)
    for key in keys:
        if len(key) != KEY_NBYTES:
            raise ValueError(f"block keys are {KEY_NBYTES}-byte sha256 digests, got {len(key)}")
    return keys


class _PutBlock:
    """One chunked block being received: its chunks so far (None when the node holds the key
    already: its bytes are drained) and how many bytes have arrived."""

    __slots__ = ("key", "total", "received", "chunks")

    def __init__(self, key: bytes, total: int, buffered: bool) -> None:
        self.key = key
        self.total = total
        self.received = 0
        self.chunks: list[bytes] | None = [] if buffered else None


class PutPath:
    """The servicer's Put and PutBatch; the servicer sets ``s`` (its ``StoreServer``: node id,
    publisher, metadata cache, data key, limits) and ``pool``, and has ``grant(context)``."""

    s: Any
    pool: Any
    grant: Callable[[grpc.ServicerContext], Grant]

    def Put(self, request_iterator: Iterator[pb.PutChunk], context: grpc.ServicerContext
            ) -> pb.PutResponse:
        """A Put stream: admitted only under ``server.max_concurrent_puts`` (Overloaded at
        once otherwise) and cancelled by the watchdog when it goes silent."""
        grant = self.grant(context)
        try:
            self.s.put_limits.enter_stream()
        except Overloaded as exc:
            abort_with(context, exc)
        watchdog = self.s.watchdog
        watch = watchdog.watch(context)
        try:
            return self._put(watchdog.requests(request_iterator, watch), context, grant, watch)
        finally:
            watchdog.done(watch)
            self.s.put_limits.exit_stream()

    def PutBatch(self, request: pb.PutBatchRequest, context: grpc.ServicerContext
                 ) -> pb.PutResponse:
        """A whole Put in one message: the same checks, verdicts and visibility as ``Put``."""
        return self._put(iter(request.chunks), context, self.grant(context), None)

    def _put(self, messages: Iterator[pb.PutChunk], context: grpc.ServicerContext,
             grant: Grant, watch: Watch | None) -> pb.PutResponse:
        started = time.perf_counter()
        entries: list[IndexEntry] = []
        num_existing = 0
        current: _PutBlock | None = None
        namespace: Namespace | None = None
        block = 0  # the namespace's block size: every block of the Put has exactly this many
        try:
            for msg in messages:
                if namespace is None:
                    if not msg.HasField("namespace"):
                        raise ValueError("the first Put message must carry the namespace")
                    namespace, block = self._writable(msg.namespace, grant)
                if msg.keys:
                    if current is not None:
                        raise ValueError("a Put batch message arrived inside a chunked block")
                    num_existing += self._put_batch(msg, namespace, block, entries)
                    continue
                if current is None:
                    current = self._begin_block(msg.key, msg.total_nbytes, block)
                    if watch is not None:
                        watch.block_started()
                elif msg.key and msg.key != current.key:
                    raise ValueError("a Put block ended early: its chunks stopped before "
                                     f"total_nbytes={current.total}")
                if msg.offset != current.received:
                    raise ValueError(f"Put chunk offset {msg.offset} != expected "
                                     f"{current.received} (chunks must be in order)")
                data = msg.data
                if current.received + len(data) > current.total:
                    raise ValueError("Put chunk runs past the block's total_nbytes")
                if current.chunks is not None:
                    current.chunks.append(data)
                current.received += len(data)
                if current.received == current.total:
                    done, current = current, None
                    if watch is not None:
                        watch.block_done()
                    entry = self._finish_block(done, namespace)
                    if entry is None:
                        num_existing += 1
                    else:
                        entries.append(entry)
            if current is not None:
                raise ValueError(f"Put stream ended inside block {current.key.hex()[:16]} "
                                 f"({current.received}/{current.total} bytes)")
        except (KVStoreError, ValueError) as exc:
            err: BaseException = exc
            if watch is not None and watch.expired:  # the watchdog ended it: say so
                err = Overloaded(f"Put stream cancelled: {watch.expired} for longer than "
                                 "server.put_idle_timeout_s")
            reason = _reject_reason(err)
            if reason is not None:
                metrics.record_rejected(reason)
            self._publish(entries, context)  # the blocks verified before the bad one are good
            count_stored(entries)
            abort_with(context, err)
        except BaseException:  # cancelled (the watchdog, the client): keep what was stored
            self._publish_quietly(entries)
            raise
        finally:
            if current is not None and current.chunks is not None:
                self.s.put_limits.release(current.total)
        self._publish(entries, context)
        count_stored(entries)
        metrics.observe_put(time.perf_counter() - started)
        return pb.PutResponse(num_stored=len(entries), num_existing=num_existing)

    def _writable(self, spec: pb.NamespaceSpec, grant: Grant) -> tuple[Namespace, int]:
        """The namespace a Put writes and its block size, once the credential may write its
        tenant and its blocks fit ``server.max_block_bytes`` (checked from the dimensions
        before anything is sized by them: a small request declaring huge dimensions allocates
        nothing)."""
        grant.check_write(spec.cache_salt)
        namespace = namespace_from_spec(spec, data_key=self.s.data_key)
        limit = self.s.max_block_bytes
        # The payload plus the header's token ids bound the block from below.
        if namespace.payload_nbytes + 8 * namespace.block_size > limit:
            raise RequestTooLarge(f"the namespace's blocks ({namespace.payload_nbytes} payload "
                                  f"bytes) exceed the node's limit of {limit} bytes "
                                  "(server.max_block_bytes, at most pool.capacity_bytes)")
        block = block_nbytes(namespace)
        if block > limit:
            raise RequestTooLarge(f"the namespace's blocks of {block} bytes exceed the node's "
                                  f"limit of {limit} bytes (server.max_block_bytes)")
        return namespace, block

    def _put_batch(self, msg: pb.PutChunk, namespace: Namespace, block: int,
                   entries: list[IndexEntry]) -> int:
        """Store the whole blocks of one batch message (appending to ``entries`` as each one
        commits, so a failure keeps the good ones before it); returns how many were held.

        The batch is verified in the message buffer first (``verify_blocks``: the per-block
        verdicts in a few array passes), then each good block is reserved, copied and
        committed: the bytes copied are the bytes verified, since the message is immutable.
        """
        total = msg.total_nbytes
        n = len(msg.keys)
        _check_total(total, block, self.s.max_block_bytes)
        if len(msg.data) != total * n:
            raise ValueError(f"a Put batch of {n} blocks of {total} bytes carries "
                             f"{len(msg.data)} bytes")
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
                check_keys([keys[bad]])  # raises the same error as per block
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
            self.s.forget_many([r.key for r in mine])  # see kvstore.node.meta: before commit
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

    def _begin_block(self, key: bytes, total: int, block: int) -> _PutBlock:
        key = bytes(key)
        check_keys([key])
        _check_total(total, block, self.s.max_block_bytes)
        if self.pool.contains(key):
            return _PutBlock(key, total, buffered=False)
        self.s.put_limits.hold(total)  # Overloaded past the bytes unfinished Puts may hold
        return _PutBlock(key, total, buffered=True)

    def _finish_block(self, block: _PutBlock, namespace: Namespace) -> IndexEntry | None:
        """Store a block whose chunks have all arrived (None: the node held it already)."""
        chunks, block.chunks = block.chunks, None
        if chunks is None:
            return None
        try:
            res = self.pool.reserve(block.key, block.total)
            try:
                off = 0
                for data in chunks:
                    res.view[off : off + len(data)] = data
                    off += len(data)
                del chunks[:]
                header = verify_block(res.view[: block.total], namespace, block.key)
            except BaseException:
                self.pool.abort(res)
                raise
        finally:
            self.s.put_limits.release(block.total)
        self.s.forget(block.key)  # see kvstore.node.meta: before commit
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

    def _publish_quietly(self, entries: list[IndexEntry]) -> None:
        """Publish what a cancelled Put stored (no one hears the answer; a node re-announces
        what it holds when it registers again anyway)."""
        if entries and self.s.publisher is not None:
            try:
                self.s.publisher.publish(entries)
            except Exception:  # noqa: S110 - the next registration re-announces them
                pass
            count_stored(entries)


def _check_total(total: int, block: int, limit: int) -> None:
    """A block's declared size must be its namespace's block size, exactly: no larger block
    is buffered and no junk after a valid block is stored."""
    if total > limit:
        raise RequestTooLarge(f"block of {total} bytes exceeds the node's limit of {limit} "
                              "bytes (server.max_block_bytes, at most pool.capacity_bytes)")
    if total != block:
        raise ValueError(f"Put block total_nbytes={total} is not the namespace's block size "
                         f"of {block} bytes")


def _reject_reason(exc: BaseException) -> str | None:
    if isinstance(exc, (Overloaded, PermissionDenied)):
        return None  # the call was refused, not a block
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
