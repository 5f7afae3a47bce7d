"""The connector's figures in vLLM's own statistics: its periodic log line and its /metrics.

vLLM carries each step's ``TransferTally`` sums from the workers to the scheduler's process
in a ``KVStoreTransferStats``, adds them up over workers and over its log interval
(``aggregate``), then prints ``KV Transfer metrics: loaded_blocks=..., ...`` (``reduce``) and
adds them to the ``vllm:kvstore_*`` counters of the engine that moved them
(``KVStorePromMetrics``): an operator watching vLLM sees how much of each prompt came from
kvstore, how much it had to recompute, and what the loads cost, without a second scrape.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

from kvstore.integrations.vllm.transfer_tally import FIGURES

_MIB = float(1 << 20)


@dataclass
class KVStoreTransferStats(KVConnectorStats):
    """``data``: sums of the ``FIGURES`` (absent ones are 0); plain numbers, so vLLM can send
    them between its processes as they are."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVStoreTransferStats:
        for figure, amount in other.data.items():
            if figure in FIGURES:
                self.data[figure] = self.data.get(figure, 0) + amount
        return self

    def reduce(self) -> dict[str, int | float]:
        get = self.data.get
        loaded = int(get("loaded_blocks", 0))
        fetch_s = float(get("fetch_seconds", 0.0))
        return {
            "loaded_blocks": loaded,
            "loaded_MiB": round(get("loaded_bytes", 0) / _MIB, 1),
            "load_failed_blocks": int(get("load_failed_blocks", 0)),
            "fetch_ms_per_block": round(1e3 * fetch_s / loaded, 3) if loaded else 0.0,
            "saved_blocks": int(get("saved_blocks", 0)),
            "saved_MiB": round(get("saved_bytes", 0) / _MIB, 1),
        }

    def is_empty(self) -> bool:
        return not any(self.data.get(figure) for figure in FIGURES)


#: The counters on vLLM's /metrics: name, help, and the figure each adds up.
PROM_COUNTERS = (
    ("vllm:kvstore_loaded_blocks", "Blocks loaded from kvstore into the KV cache.",
     "loaded_blocks"),
    ("vllm:kvstore_loaded_bytes", "KV payload bytes loaded from kvstore.", "loaded_bytes"),
    ("vllm:kvstore_load_failed_blocks",
     "Blocks kvstore could not load (missing, rejected, node down): vLLM recomputed them.",
     "load_failed_blocks"),
    ("vllm:kvstore_fetch_seconds", "Seconds spent fetching and verifying blocks from kvstore.",
     "fetch_seconds"),
    ("vllm:kvstore_saved_blocks", "Blocks saved from the KV cache into kvstore.",
     "saved_blocks"),
    ("vllm:kvstore_saved_bytes", "KV payload bytes saved into kvstore.", "saved_bytes"),
)


class KVStorePromMetrics(KVConnectorPromMetrics):
    """The ``PROM_COUNTERS``, one child per engine (vLLM's own labels)."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._children: dict[str, dict[int, Any]] = {}
        for name, documentation, figure in PROM_COUNTERS:
            counter = self._counter_cls(name=name, documentation=documentation,
                                        labelnames=labelnames)
            self._children[figure] = {engine: counter.labels(*values)
                                      for engine, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for figure, amount in transfer_stats_data.items():
            child = self._children.get(figure, {}).get(engine_idx)
            if child is not None and amount > 0:
                child.inc(amount)
