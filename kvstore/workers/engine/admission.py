"""Admitting requests into an engine: the prompt checked, each id in flight once, and a stop.

A request is admitted with ``InFlightRequests.begin`` and leaves with ``end``, whatever happens
in between; while in flight it may hold KV (``hold``), which is what ``num_active`` counts. It
stops at its next step (a chunk or a token: ``check``) once it is cancelled or its
``worker.request_timeout_s`` has passed, by raising RequestCancelled, so a stopped request
releases its KV the same way a finished one does.
"""

from __future__ import annotations

import threading
import time

from transformers import DynamicCache

from kvstore.api import TokenIds
from kvstore.config import WorkerConfig
from kvstore.errors import ConfigError, RequestCancelled


def prompt_tokens(token_ids: TokenIds, vocab_size: int) -> list[int]:
    """The prompt as plain ints; ConfigError if it is empty or leaves ``[0, vocab_size)``."""
    tokens = [int(t) for t in (token_ids.tolist() if hasattr(token_ids, "tolist")
                               else token_ids)]
    if not tokens:
        raise ConfigError("the prompt is empty; give at least one token")
    bad = [t for t in tokens if not 0 <= t < vocab_size]
    if bad:
        raise ConfigError(f"token id {bad[0]} is outside the model's vocabulary "
                          f"[0, {vocab_size})")
    return tokens


class InFlightRequests:
    """The requests an engine is running, the KV each holds, and those asked to stop.

    Thread-safe: a replica serving several requests calls it from several threads.
    ``config.request_timeout_s`` is read when a request begins and when it is checked.
    """

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._cancelled: set[str] = set()
        self._active: dict[str, DynamicCache | None] = {}

    @property
    def num_active(self) -> int:
        """Requests holding KV right now (0 after every request ends, cancelled or not)."""
        with self._lock:
            return len(self._active)

    def begin(self, request_id: str) -> float:
        """Admit ``request_id``; its deadline (``time.monotonic`` seconds).

        ConfigError if a request of that id is already running: ``cancel`` must name one.
        """
        with self._lock:
            if request_id in self._active:
                raise ConfigError(f"request id {request_id!r} is already running")
            self._active[request_id] = None
        return time.monotonic() + self.config.request_timeout_s

    def hold(self, request_id: str, cache: DynamicCache) -> None:
        """Record the KV a request now holds (released by ``end``)."""
        with self._lock:
            self._active[request_id] = cache

    def end(self, request_id: str) -> None:
        """The request is over: drop its KV and any cancel aimed at it."""
        with self._lock:
            self._active.pop(request_id, None)
            self._cancelled.discard(request_id)

    def cancel(self, request_id: str) -> None:
        """Ask a running request to stop at its next ``check``."""
        with self._lock:
            self._cancelled.add(request_id)

    def check(self, request_id: str, deadline: float) -> None:
        """RequestCancelled if the request was cancelled or is past ``deadline``."""
        with self._lock:
            cancelled = request_id in self._cancelled
        if cancelled:
            raise RequestCancelled(f"request {request_id!r} was cancelled")
        if time.monotonic() > deadline:
            raise RequestCancelled(f"request {request_id!r} timed out after "
                                   f"{self.config.request_timeout_s}s (worker.request_timeout_s)")
