"""A reader's finished leases on one node, released without costing the reader a call.

A same-node read leases its blocks, copies them and is done: waiting for the release would add
a call (CPU in both processes) to every read. So a finished lease is queued here; the reader's
next ``Lease`` carries the queued ids (``LeaseRequest.release_lease_ids``), and a reader that
reads nothing more within ``delay_s()`` has them sent by one long-lived thread (cheaper than a
gRPC future or a blocking call per release). A release that fails costs nothing but the lease
running to its TTL.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable

from kvstore.errors import KVStoreError


class LeaseReleases:
    """Finished lease ids waiting to be released, and the thread that sends stragglers."""

    def __init__(self, send: Callable[[str], None], delay_s: Callable[[], float]) -> None:
        """``send(lease_id)`` releases one lease (a blocking call); ``delay_s()``: how long a
        queued release waits for a read to carry it before the thread sends it."""
        self._send = send
        self._delay_s = delay_s
        self._wakeups: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._pending: list[str] = []  # finished leases not yet sent
        self._thread: threading.Thread | None = None  # started by the first add
        self._lock = threading.Lock()

    def add(self, lease_id: str) -> None:
        """Queue a finished lease."""
        with self._lock:
            self._pending.append(lease_id)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name="kvstore-release")
                self._thread.start()
        self._wakeups.put(lease_id)

    def take(self) -> list[str]:
        """The queued ids, for a ``Lease`` call to carry (``put_back`` them if it fails)."""
        with self._lock:
            done, self._pending = self._pending, []
        return done

    def put_back(self, lease_ids: list[str]) -> None:
        if lease_ids:
            with self._lock:
                self._pending.extend(lease_ids)

    def close(self) -> None:
        """Send what is queued (rather than leave leases to expire) and stop the thread."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._wakeups.put(None)
            thread.join(timeout=2.0)

    def _loop(self) -> None:
        stop = False
        while not stop:
            stop = self._wakeups.get() is None
            if not stop:
                time.sleep(self._delay_s())  # a read in the meantime carries them
            while True:  # one wake-up per batch, however many releases queued meanwhile
                try:
                    stop = self._wakeups.get_nowait() is None or stop
                except queue.Empty:
                    break
            for lease_id in self.take():
                with contextlib.suppress(KVStoreError):  # the lease expires on its own anyway
                    self._send(lease_id)
