"""What the prefill and decode workers of a cluster say about themselves, for ``kvstore status``.

Workers are not store nodes: they hold no blocks and the coordinator plans nothing for them. A
worker reports once when it starts (its model, device and reuse policy: how fine-grained its
cache hits can be, and whether bitwise) and is forgotten when it closes, so an operator sees in
one place which replicas give up hit rate, and why.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

#: A report is a few fields; anything larger is a caller bug, not something to keep.
MAX_REPORT_BYTES = 4096


class WorkerTable:
    """The latest report of each live worker, by worker id."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reports: dict[str, dict[str, Any]] = {}

    def report(self, worker_id: str, info: dict[str, Any]) -> None:
        """Record (or replace) a worker's report; it must be a small json-able dict."""
        if not isinstance(worker_id, str) or not worker_id:
            raise ValueError(f"worker_id must be a non-empty str, got {worker_id!r}")
        if not isinstance(info, dict):
            raise TypeError(f"a worker report is a dict, got {type(info).__name__}")
        size = len(json.dumps(info, default=str))
        if size > MAX_REPORT_BYTES:
            raise ValueError(f"worker report of {size} bytes exceeds {MAX_REPORT_BYTES}")
        with self._lock:
            self._reports[worker_id] = {**info, "worker_id": worker_id,
                                        "reported_at": time.time()}

    def forget(self, worker_id: str) -> bool:
        """Drop a worker that closed; True if it was known."""
        with self._lock:
            return self._reports.pop(worker_id, None) is not None

    def as_list(self) -> list[dict[str, Any]]:
        """Every report, sorted by worker id."""
        with self._lock:
            return [dict(self._reports[k]) for k in sorted(self._reports)]
