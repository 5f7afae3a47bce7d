"""Metrics: counters move by what was recorded, labels are checked, the HTTP endpoint serves."""

from __future__ import annotations

import importlib
import urllib.request

import pytest

from kvstore import metrics
from kvstore.api import MISS_CORRUPTED, MISS_NOT_FOUND, PoolStats


def value(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def test_transfers_count_blocks_and_bytes_per_path() -> None:
    before = {p: (value("kvstore_blocks_in_total", path=p), value("kvstore_bytes_in_total", path=p))
              for p in metrics.PATHS}
    metrics.record_in("shm", 3, 3000)
    metrics.record_in("grpc", 1, 10)
    assert value("kvstore_blocks_in_total", path="shm") == before["shm"][0] + 3
    assert value("kvstore_bytes_in_total", path="shm") == before["shm"][1] + 3000
    assert value("kvstore_bytes_in_total", path="grpc") == before["grpc"][1] + 10
    assert value("kvstore_bytes_in_total", path="bulk") == before["bulk"][1]
    out = value("kvstore_bytes_out_total", path="bulk")
    metrics.record_out("bulk", 2, 4096)
    assert value("kvstore_bytes_out_total", path="bulk") == out + 4096


def test_hits_misses_rejections_and_latency() -> None:
    hits = value("kvstore_hits_total")
    miss = value("kvstore_misses_total", reason=MISS_NOT_FOUND)
    bad = value("kvstore_rejected_blocks_total", reason=MISS_CORRUPTED)
    count = value("kvstore_fetch_latency_seconds_count", path="shm")
    metrics.record_hits(5)
    metrics.record_miss(MISS_NOT_FOUND, 2)
    metrics.record_rejected(MISS_CORRUPTED)
    metrics.observe_fetch("shm", 0.0003)
    assert value("kvstore_hits_total") == hits + 5
    assert value("kvstore_misses_total", reason=MISS_NOT_FOUND) == miss + 2
    assert value("kvstore_rejected_blocks_total", reason=MISS_CORRUPTED) == bad + 1
    assert value("kvstore_fetch_latency_seconds_count", path="shm") == count + 1
    assert value("kvstore_fetch_latency_seconds_bucket", path="shm", le="0.0005") >= 1


@pytest.mark.parametrize(
    "call",
    [lambda: metrics.record_in("tcp", 1, 1), lambda: metrics.record_miss("gone"),
     lambda: metrics.record_rejected("ugly"), lambda: metrics.observe_fetch("x", 1.0)],
)
def test_unknown_labels_are_rejected(call) -> None:
    with pytest.raises(ValueError, match="use one of"):
        call()


def test_pool_gauges_and_forget_node() -> None:
    stats = PoolStats(capacity_bytes=1000, used_bytes=400, num_blocks=4, num_pinned=1,
                      num_leased=2, hits=0, misses=0, evictions=0)
    metrics.observe_pool("node-a", stats)
    metrics.record_evictions("node-a", 3)
    assert value("kvstore_pool_used_bytes", node_id="node-a") == 400
    assert value("kvstore_pool_capacity_bytes", node_id="node-a") == 1000
    assert value("kvstore_pool_blocks", node_id="node-a") == 4
    assert value("kvstore_pool_leased_blocks", node_id="node-a") == 2
    assert value("kvstore_evictions_total", node_id="node-a") == 3
    metrics.forget_node("node-a")
    assert metrics.REGISTRY.get_sample_value("kvstore_pool_used_bytes", {"node_id": "node-a"}) \
        is None
    metrics.forget_node("never-seen")


def test_reimport_does_not_duplicate_series() -> None:
    import kvstore.metrics as again

    assert again.REGISTRY is metrics.REGISTRY
    importlib.import_module("kvstore.metrics")  # a second component importing it is harmless


def test_metrics_server_serves_the_registry() -> None:
    metrics.record_hits(1)
    port = metrics.start_metrics_server(0, addr="127.0.0.1")
    try:
        assert port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            body = resp.read().decode()
        assert "kvstore_hits_total" in body and "kvstore_pool_used_bytes" in body
    finally:
        metrics.stop_metrics_servers()
