"""A store node's write path: the Put stream and the unary PutBatch, block by block or a batch
message at a time, each Put returning only after its keys are visible in the index.

Kept apart from ``kvstore.node.server`` (which serves reads, leases and admin calls and mixes
this in as ``PutPath``) because it is the one path with its own rules: two-phase per block
(reserve arena space -> copy the chunks in -> verify -> commit), a batch message verified in
its buffer and stored a run at a time, the good blocks before a bad one kept, and the publish
(``on_publish``, coalesced by ``kvstore.node.publisher``) before the call returns.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np

from kvstore import metrics
from kvstore.block import verify_block
from kvstore.block_batch import verify_blocks
from kvstore.constants import KEY_NBYTES
from kvstore.errors import (
    BlockCorrupted,
    BlockMismatch,
    KVStoreError,
    NamespaceMismatch,
    PoolFull,
    RequestTooLarge,
)
from kvstore.index.base import IndexEntry
from kvstore.keys import Namespace
from kvstore.node.wire import namespace_from_spec, status_for
from protos import kvstore_pb2 as pb


def abort_with(context: grpc.ServicerContext, exc: BaseException) -> None:
    """End the call with the status ``exc`` travels as; the client rebuilds it by name."""
    context.abort(status_for(exc), f"{type(exc).__name__}: {exc}")


def check_keys(keys: Any) -> list[bytes]:
    """``keys`` as a list, each a 32-byte key (ValueError names the wrong length)."""
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


class PutPath:
    """The servicer's Put and PutBatch; the servicer sets ``s`` (its ``StoreServer``: node id,
    publisher, metadata cache, block size limit) and ``pool``."""

    s: Any
    pool: Any

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
            abort_with(context, exc)
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
        check_keys([key])
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
