"""What the connector's worker side moved, counted for vLLM's own statistics.

vLLM asks each worker's connector after every step for the figures since the last step
(``get_kv_connector_stats``), carries them to the scheduler's process with the step's output,
sums them over workers and log intervals, and prints them in its periodic log line and on its
``/metrics`` (``kvstore.integrations.vllm.transfer_stats``). The counting itself lives here,
free of vLLM, so the worker side and its tests need no engine: loads and saves run on
several threads (the spare core's, the asynchronous loads', the puts'), hence the lock.
"""

from __future__ import annotations

import threading

#: The figures, each a sum since the last ``take``: blocks and payload bytes written into
#: vLLM's caches, blocks vLLM was told to recompute (a miss, a failed check, a dead node),
#: seconds spent fetching and verifying, blocks and payload bytes published.
FIGURES = ("loaded_blocks", "loaded_bytes", "load_failed_blocks", "fetch_seconds",
           "saved_blocks", "saved_bytes")


class TransferTally:
    """Running sums of ``FIGURES``: ``take`` hands out those since the last take, ``total``
    those since the start."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since_take: dict[str, float] = {}
        self._total: dict[str, float] = {}

    def add(self, figure: str, amount: float) -> None:
        if figure not in FIGURES:
            raise ValueError(f"unknown transfer figure {figure!r}; one of {FIGURES}")
        if not amount:
            return
        with self._lock:
            self._since_take[figure] = self._since_take.get(figure, 0) + amount
            self._total[figure] = self._total.get(figure, 0) + amount

    def take(self) -> dict[str, float]:
        """The sums since the last take (only those that moved), and start again."""
        with self._lock:
            taken, self._since_take = self._since_take, {}
        return taken

    def total(self, figure: str) -> float:
        with self._lock:
            return self._total.get(figure, 0)
