"""Blocks on their way from the arena to the disk tier: a bounded queue and one writer thread.

Demotion runs where eviction runs (a Put making room, the evictor thread, a heartbeat's
orders), and a disk write can take milliseconds or hang on a sick device, so eviction only
copies the block out of the arena into this queue and the writer thread does the file work.
The queue is bounded in bytes: when it is full the block is dropped, counted as
``queue_full``, never waited for. A queued block is still the node's: ``pending`` serves it to
a read (and a promotion) until its file is whole.

A failing disk never stops the node: ENOSPC first drops the tier's oldest files and retries
once (the filesystem, not the configured capacity, was the limit); what still fails is
dropped with its reason (``no_space``, ``read_only``, ``io_error``) and one log line per
reason and minute, so a dead disk does not flood the log.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.node.disk_tier import DiskTier

log = logging.getLogger(__name__)

_LOG_EVERY_S = 60.0


def drop_reason(exc: OSError) -> str:
    """The drop reason an OSError stands for."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return "no_space"
    if exc.errno == errno.EROFS:
        return "read_only"
    return "io_error"


@dataclass(slots=True)
class Pending:
    """A block copied out of the arena, waiting for its file."""

    data: bytes
    parent_key: bytes
    namespace_root: bytes


class DemotionQueue:
    """Bounded bytes in flight to ``disk``, written in order by one daemon thread."""

    def __init__(self, disk: DiskTier, max_bytes: int,
                 on_dropped: Callable[[list[bytes], str], None],
                 on_written: Callable[[bytes], None] | None = None) -> None:
        self.disk = disk
        self.max_bytes = max_bytes
        self._on_dropped = on_dropped
        self._on_written = on_written
        self._cond = threading.Condition()
        self._queue: OrderedDict[bytes, Pending] = OrderedDict()
        self._queued_bytes = 0
        self._writing: bytes | None = None
        self._closed = False
        self._last_log: dict[str, float] = {}
        self.num_written = 0
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="kvstore-demotion")
        self._thread.start()

    def offer(self, key: bytes, data: bytes, parent_key: bytes, namespace_root: bytes) -> bool:
        """Queue a block; False (and nothing queued) when the queue has no room for it."""
        with self._cond:
            if self._closed or key in self._queue:
                return key in self._queue
            if self._queued_bytes + len(data) > self.max_bytes:
                return False
            self._queue[key] = Pending(data, parent_key, namespace_root)
            self._queued_bytes += len(data)
            self._cond.notify()
        return True

    def pending(self, key: bytes) -> Pending | None:
        """The queued block ``key`` (also while its file is being written), or None."""
        with self._cond:
            return self._queue.get(key)

    def cancel(self, key: bytes) -> bool:
        """Take a block out of the queue (it was deleted); False if it was not queued or is
        being written now (the caller deletes the file after ``flush``)."""
        with self._cond:
            if key == self._writing or key not in self._queue:
                return False
            self._queued_bytes -= len(self._queue.pop(key).data)
            return True

    def keys(self) -> list[bytes]:
        """The queued blocks' keys, oldest first."""
        with self._cond:
            return list(self._queue)

    @property
    def queued_bytes(self) -> int:
        with self._cond:
            return self._queued_bytes

    def __len__(self) -> int:
        with self._cond:
            return len(self._queue)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued block is written or dropped; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the writer; blocks still queued are lost (the arena copy is gone already)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=timeout_s)

    # -- the writer thread --------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                key, item = next(iter(self._queue.items()))
                self._writing = key
            reason = self._write(key, item)
            with self._cond:
                self._writing = None
                if self._queue.pop(key, None) is not None:
                    self._queued_bytes -= len(item.data)
                self._cond.notify_all()
            if reason is not None:
                self._on_dropped([key], reason)

    def _write(self, key: bytes, item: Pending) -> str | None:
        """Write one block; the drop reason if it could not be written."""
        for attempt in range(2):
            try:
                dropped = self.disk.write(key, item.data, item.parent_key, item.namespace_root)
            except OSError as exc:
                reason = drop_reason(exc)
                if reason == "no_space" and attempt == 0 and len(self.disk):
                    self._report_lru(self.disk.make_room(len(item.data)))
                    continue
                self._log(reason, exc)
                return reason
            self._report_lru(dropped)
            self.num_written += 1
            if self._on_written is not None:
                self._on_written(key)
            return None
        return "no_space"

    def _report_lru(self, keys: list[bytes]) -> None:
        if keys:
            self._on_dropped(keys, "lru")

    def _log(self, reason: str, exc: OSError) -> None:
        now = time.monotonic()
        if now - self._last_log.get(reason, -_LOG_EVERY_S) >= _LOG_EVERY_S:
            self._last_log[reason] = now
            log.error("kvstore disk tier %s: a block could not be written (%s: %s); such "
                      "blocks are dropped and counted (kvstore_tier_drops{reason=%r}), the "
                      "node keeps serving from its arena", self.disk.directory, reason, exc,
                      reason)
