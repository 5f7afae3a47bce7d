"""What a stalled or hostile writer may hold on a store node, and the watchdog that ends
streams that stop moving (docs/security.md §Bounds).

A Put stream is paced by its client: between two messages it holds a gRPC worker thread and
whatever it sent of an unfinished block. So the node bounds both. ``PutLimits`` admits at most
``server.max_concurrent_puts`` streams at once (past that a stream is refused at once with
``Overloaded``, never queued behind stalled ones, so the rest of the worker pool stays free
for reads) and caps the bytes of unfinished blocks they buffer. ``StreamWatchdog`` cancels a
stream silent for ``server.put_idle_timeout_s`` (or a block that is still not whole after ten
times that: a drip of tiny chunks is a stall too), which frees its worker and its bytes. A
streamed response (Get, ListKeys) to a reader that stops reading is cancelled the same way.

An unfinished block is buffered in the stream's own messages, not reserved in the pool: the
pool only ever reserves space for bytes already in hand, so a stalled Put can neither fill
the pool nor make the node evict committed blocks to make room for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from kvstore.errors import Overloaded, RequestTooLarge

T = TypeVar("T")
#: A block not whole after this many idle timeouts is a drip: the stream is cancelled.
BLOCK_TIMEOUT_FACTOR = 10


class PutLimits:
    """Put streams in flight and the bytes their unfinished blocks hold, both capped."""

    def __init__(self, max_streams: int, max_pending_bytes: int) -> None:
        self.max_streams = max_streams
        self.max_pending_bytes = max_pending_bytes
        self._lock = threading.Lock()
        self._streams = 0
        self._pending = 0

    def enter_stream(self) -> None:
        """Admit one more Put stream, or raise Overloaded at once."""
        with self._lock:
            if self._streams >= self.max_streams:
                raise Overloaded(f"{self._streams} Put streams are in flight, the node's limit "
                                 "(server.max_concurrent_puts): retry shortly")
            self._streams += 1

    def exit_stream(self) -> None:
        with self._lock:
            self._streams -= 1

    def hold(self, nbytes: int) -> None:
        """Count ``nbytes`` of an unfinished block; Overloaded past the cap."""
        if nbytes > self.max_pending_bytes:
            raise RequestTooLarge(f"a block of {nbytes} bytes exceeds the {self.max_pending_bytes}"
                                  " bytes unfinished Puts may hold on this node (a quarter of "
                                  "pool.capacity_bytes, at least 64 MiB): raise the capacity")
        with self._lock:
            if self._pending + nbytes > self.max_pending_bytes:
                raise Overloaded(f"unfinished Puts hold {self._pending} bytes of the node's "
                                 f"{self.max_pending_bytes}: retry shortly")
            self._pending += nbytes

    def release(self, nbytes: int) -> None:
        with self._lock:
            self._pending -= nbytes

    @property
    def streams(self) -> int:
        with self._lock:
            return self._streams

    @property
    def pending_bytes(self) -> int:
        with self._lock:
            return self._pending


class Watch:
    """One watched stream: when it last moved, since when its current block is open."""

    __slots__ = ("cancel", "last", "block_since", "expired")

    def __init__(self, cancel: Callable[[], None]) -> None:
        self.cancel = cancel
        self.last = time.monotonic()
        self.block_since: float | None = None
        self.expired = ""  # why the watchdog cancelled it ("" while it has not)

    def touch(self) -> None:
        self.last = time.monotonic()

    def block_started(self) -> None:
        self.block_since = time.monotonic()

    def block_done(self) -> None:
        self.block_since = None


class StreamWatchdog:
    """One thread per server that cancels streams idle past ``idle_s``."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self._watches: dict[int, Watch] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="kvstore-stream-watchdog")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def watch(self, context: grpc.ServicerContext) -> Watch:
        w = Watch(context.cancel)
        with self._lock:
            self._watches[id(w)] = w
        return w

    def done(self, w: Watch) -> None:
        with self._lock:
            self._watches.pop(id(w), None)

    def requests(self, requests: Iterator[T], w: Watch) -> Iterator[T]:
        """``requests`` with each arrival counted as progress."""
        for msg in requests:
            w.touch()
            yield msg

    def responses(self, context: grpc.ServicerContext, responses: Iterator[T]) -> Iterator[T]:
        """``responses`` watched: a reader that stops taking them is cancelled (gRPC asks for
        the next one only after the last was sent)."""
        w = self.watch(context)
        try:
            for msg in responses:
                yield msg
                w.touch()
        finally:
            self.done(w)

    def check(self, now: float | None = None) -> list[Watch]:
        """Cancel every stream past its deadline now; returns them (tests call this)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            late = [w for w in self._watches.values() if not w.expired and (
                now - w.last > self.idle_s or (
                    w.block_since is not None
                    and now - w.block_since > BLOCK_TIMEOUT_FACTOR * self.idle_s))]
            for w in late:
                w.expired = ("idle" if now - w.last > self.idle_s else "slow block")
        for w in late:
            _cancel_quietly(w.cancel)
        return late

    def _run(self) -> None:
        interval = min(1.0, self.idle_s / 4)
        while not self._stop.wait(interval):
            self.check()


def _cancel_quietly(cancel: Callable[[], Any]) -> None:
    try:
        cancel()
    except Exception:  # the call ended on its own meanwhile
        pass
