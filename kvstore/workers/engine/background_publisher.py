"""Publishing a prefill's blocks off the request's critical path.

Publishing a prompt's blocks (device to host, encode, put) takes longer than computing them,
so the request only makes a block-major copy of the new KV on the device (no host sync) and
records a stream event after it; a background thread waits for that event on a side stream,
copies the blocks into reused pinned host memory (DMA), encodes them and puts them. So:

- TTFT never includes the publish, and the next request never waits for it (while the backlog
  has room; ``worker.publish_backlog_blocks`` and ``worker.publish_backlog_bytes`` (device
  memory the queued copies hold) bound it, and ``worker.publish_when_full`` says
  whether a request then waits for room or drops its blocks, counted in metrics either way);
- a block is put only after its bytes are final (the event), so no reader sees a half-copied
  block, and the store's own put path verifies what it stores;
- until its put returns, a queued block is still readable by this engine (``pending``), so a
  follow-up request on the same worker hits it without waiting and without a fetch;
- another worker that must see the blocks (a decode worker after a disaggregated prefill) waits
  for them by key (``Engine.decode(wait_for_blocks=...)``); a caller in this process can also
  wait for one request's blocks (``wait``) or for all (``flush``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore import metrics
from kvstore.api import BlockPut, KVStore
from kvstore.config import PublishWhenFull
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace

log = logging.getLogger(__name__)

#: Seconds the publisher thread waits for work before it ends (the next submit restarts it).
IDLE_EXIT_S = 5.0


@dataclass(slots=True)
class PublishBatch:
    """One request's new blocks: their keys, parents, tokens and KV (``[nb, L, 2, bs, H, D]``,
    the engine's own copy on its device, made after the compute that produced it)."""

    request_id: str
    namespace: Namespace
    keys: list[bytes]
    parents: list[bytes]
    tokens: list[list[int]]
    blocks: torch.Tensor
    ready: Any = None  # a torch.cuda.Event recorded after ``blocks`` was written; None on CPU
    queued_at: float = field(default_factory=time.perf_counter)
    done: threading.Event = field(default_factory=threading.Event)
    published: int = 0
    error: str | None = None

    @property
    def nbytes(self) -> int:
        """Device memory the queued copy holds."""
        return self.blocks.numel() * self.blocks.element_size()


class BackgroundPublisher:
    """A bounded queue of publish batches and the one thread that drains it into a store."""

    def __init__(self, store: KVStore, *, max_backlog_blocks: int,
                 max_backlog_bytes: int | None = None, when_full: PublishWhenFull = "wait"
                 ) -> None:
        self.store = store
        self.max_backlog_blocks = max_backlog_blocks
        #: The backlog holds device memory, which a block count alone does not bound: bytes too.
        self.max_backlog_bytes = max_backlog_bytes
        self._backlog_bytes = 0
        self.when_full = when_full
        self._cond = threading.Condition()
        self._queue: deque[PublishBatch] = deque()
        self._backlog = 0
        self._pending: dict[tuple[bytes, bytes], tuple[PublishBatch, int]] = {}
        self._by_request: dict[str, PublishBatch] = {}
        self._closed = False
        self._staging: torch.Tensor | None = None  # pinned, reused: grown, never shrunk
        self._stream: Any = None
        # Started by the first submit and gone after IDLE_EXIT_S without work, so an engine
        # nobody uses any more (and its store) can be collected.
        self._thread: threading.Thread | None = None

    # -- the request's side -------------------------------------------------------------------

    def submit(self, batch: PublishBatch) -> int:
        """Queue a batch; returns the blocks accepted (0 when dropped for a full backlog)."""
        n = len(batch.keys)
        if n == 0:
            return 0
        nbytes = batch.nbytes
        waited = 0.0
        with self._cond:
            if self._closed:
                raise KVStoreError("the publisher is closed")
            # A batch larger than the whole backlog still goes in once the backlog is empty.
            while self._backlog and self._full(n, nbytes):
                if self.when_full == "drop":
                    metrics.record_publish("dropped", n)
                    log.warning("publish backlog full (%d blocks): dropped %d blocks of %s",
                                self._backlog, n, batch.request_id)
                    return 0
                t0 = time.perf_counter()
                self._cond.wait(1.0)
                waited += time.perf_counter() - t0
            self._queue.append(batch)
            self._backlog += n
            self._backlog_bytes += nbytes
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                name="kvstore-publisher")
                self._thread.start()
            root = batch.namespace.root
            for i, key in enumerate(batch.keys):
                self._pending[(root, key)] = (batch, i)
            self._by_request[batch.request_id] = batch
            metrics.PUBLISH_BACKLOG.set(self._backlog)
            self._cond.notify_all()
        if waited:
            metrics.PUBLISH_WAIT.inc(waited)
        return n

    def _full(self, num_blocks: int, nbytes: int) -> bool:
        """Whether ``num_blocks`` more blocks (``nbytes``) would overfill the backlog."""
        return self._backlog + num_blocks > self.max_backlog_blocks or (
            self.max_backlog_bytes is not None
            and self._backlog_bytes + nbytes > self.max_backlog_bytes)

    def pending(self, namespace: Namespace, keys: list[bytes]) -> dict[int, torch.Tensor]:
        """The payloads (on the engine's device) of those ``keys`` still queued, by index."""
        out: dict[int, torch.Tensor] = {}
        root = namespace.root
        with self._cond:
            for i, key in enumerate(keys):
                hit = self._pending.get((root, key))
                if hit is not None:
                    out[i] = hit[0].blocks[hit[1]]
        return out

    def wait(self, request_id: str, timeout: float | None = None) -> int:
        """Wait for a request's queued blocks to be put (at once if none are queued); the
        number put (0: none were queued, or they were put already, or the put failed)."""
        with self._cond:
            batch = self._by_request.get(request_id)
        if batch is None:
            return 0
        if not batch.done.wait(timeout):
            raise TimeoutError(f"the blocks of {request_id!r} were not published in {timeout}s")
        return batch.published

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far is put (or failed); False on a timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._backlog:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left if left is not None else 1.0)
        return True

    @property
    def backlog_blocks(self) -> int:
        """Blocks queued and not yet put (or failed)."""
        with self._cond:
            return self._backlog

    def close(self, timeout: float = 30.0) -> None:
        """Publish what is queued (up to ``timeout``), then stop the thread."""
        self.flush(timeout)
        with self._cond:
            self._closed = True
            thread = self._thread
            self._cond.notify_all()
        if thread is not None:
            thread.join(timeout=5.0)

    # -- the publisher thread -------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._queue and not self._closed:
                    self._cond.wait(IDLE_EXIT_S)
                if not self._queue:
                    self._thread = None  # idle or closed: the next submit starts another
                    return
                batch = self._queue[0]
            try:
                batch.published = self._publish(batch)
                metrics.record_publish("published", batch.published,
                                       time.perf_counter() - batch.queued_at)
            except Exception as exc:  # the store is a cache: a failed publish is recomputed
                batch.error = str(exc)
                metrics.record_publish("failed", len(batch.keys))
                log.warning("publishing %d blocks of %s failed: %s", len(batch.keys),
                            batch.request_id, exc)
            with self._cond:
                self._queue.popleft()
                self._backlog -= len(batch.keys)
                self._backlog_bytes -= batch.nbytes
                root = batch.namespace.root
                for key in batch.keys:
                    if self._pending.get((root, key), (None,))[0] is batch:
                        del self._pending[(root, key)]
                if self._by_request.get(batch.request_id) is batch:
                    del self._by_request[batch.request_id]
                metrics.PUBLISH_BACKLOG.set(self._backlog)
                self._cond.notify_all()
            batch.blocks = batch.blocks.new_empty(0)  # free the device copy now
            batch.done.set()

    def _publish(self, batch: PublishBatch) -> int:
        host = self._to_host(batch)
        self.store.batch_put(batch.namespace, [
            BlockPut(key, parent, tokens, host[i])
            for i, (key, parent, tokens) in enumerate(
                zip(batch.keys, batch.parents, batch.tokens, strict=True))])
        return len(batch.keys)

    def _to_host(self, batch: PublishBatch) -> torch.Tensor:
        """The batch's blocks in host memory: the tensor itself on the CPU; from a device, one
        DMA on a side stream (after the producer's event) into reused pinned memory."""
        blocks = batch.blocks
        if blocks.device.type == "cpu":
            return blocks
        if blocks.device.type != "cuda":  # another accelerator: its own synchronous copy
            return blocks.to("cpu")
        # This thread's current device is the blocks' own: the stream, the pinned staging and
        # the event wait never create a context on (or order against) another GPU.
        torch.cuda.set_device(blocks.device)
        if self._stream is None or self._stream.device != blocks.device:
            self._stream = torch.cuda.Stream(device=blocks.device)
        nbytes = blocks.numel() * blocks.element_size()
        if self._staging is None or self._staging.numel() < nbytes:
            self._staging = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        host = self._staging[:nbytes].view(blocks.dtype).view(blocks.shape)
        with torch.cuda.stream(self._stream):
            if batch.ready is not None:
                self._stream.wait_event(batch.ready)
            host.copy_(blocks, non_blocking=True)
        self._stream.synchronize()
        return host
