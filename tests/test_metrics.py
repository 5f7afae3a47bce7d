"""Metrics: counters move by what was recorded, labels are checked, reader tallies travel whole,
the HTTP endpoint serves."""

from __future__ import annotations

import importlib
import urllib.request

import pytest

from kvstore import metrics, reader_metrics
from kvstore.api import MISS_CORRUPTED, MISS_NOT_FOUND, PoolStats
from kvstore.node.proto_forms import tally_from_proto, tally_to_proto
from kvstore.reader_metrics import ReaderTally


def value(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


def make_stats(used: int = 400, blocks: int = 4) -> PoolStats:
    return PoolStats(capacity_bytes=1000, used_bytes=used, num_blocks=blocks, num_pinned=1,
                     num_leased=2, hits=0, misses=0, evictions=0)


def test_node_side_counts_served_stored_and_put_latency() -> None:
    before = {p: (value("kvstore_served_blocks_total", path=p),
                  value("kvstore_served_bytes_total", path=p)) for p in metrics.PATHS}
    stored = value("kvstore_stored_bytes_total", source="replica")
    puts = value("kvstore_put_latency_seconds_count")
    metrics.record_served("shm", 3, 3000)
    metrics.record_served("grpc", 1, 10)
    metrics.record_stored("replica", 2, 200)
    metrics.observe_put(0.002)
    assert value("kvstore_served_blocks_total", path="shm") == before["shm"][0] + 3
    assert value("kvstore_served_bytes_total", path="shm") == before["shm"][1] + 3000
    assert value("kvstore_served_bytes_total", path="grpc") == before["grpc"][1] + 10
    assert value("kvstore_served_bytes_total", path="bulk") == before["bulk"][1]
    assert value("kvstore_stored_bytes_total", source="replica") == stored + 200
    assert value("kvstore_put_latency_seconds_count") == puts + 1


def test_reader_figures_stay_out_of_the_registry_until_applied() -> None:
    reader_metrics.take_pending()  # whatever earlier tests left
    hits = value("kvstore_hits_total")
    miss = value("kvstore_misses_total", reason=MISS_NOT_FOUND)
    bad = value("kvstore_rejected_blocks_total", reason=MISS_CORRUPTED)
    fetched = value("kvstore_fetched_bytes_total", path="shm")
    count = value("kvstore_fetch_latency_seconds_count", path="shm")
    reader_metrics.record_hits(5)
    reader_metrics.record_miss(MISS_NOT_FOUND, 2)
    reader_metrics.record_rejected(MISS_CORRUPTED)
    reader_metrics.record_fetch("shm", 5, 5000, 0.0003)
    assert value("kvstore_hits_total") == hits  # a reader's process serves nothing
    tally = reader_metrics.take_pending()
    assert reader_metrics.take_pending().empty()
    metrics.apply_reader_tally(tally_from_proto(tally_to_proto(tally)))  # as the node gets it
    assert value("kvstore_hits_total") == hits + 5
    assert value("kvstore_misses_total", reason=MISS_NOT_FOUND) == miss + 2
    assert value("kvstore_rejected_blocks_total", reason=MISS_CORRUPTED) == bad + 1
    assert value("kvstore_fetched_bytes_total", path="shm") == fetched + 5000
    assert value("kvstore_fetch_latency_seconds_count", path="shm") == count + 1
    assert value("kvstore_fetch_latency_seconds_bucket", path="shm", le="0.0005") >= 1


def test_a_failed_push_is_merged_back_whole() -> None:
    reader_metrics.take_pending()
    reader_metrics.record_fetch("bulk", 2, 64, 0.01)
    reader_metrics.record_prefill_tokens(16, 0, 4)
    lost = reader_metrics.take_pending()
    reader_metrics.record_fetch("bulk", 1, 32, 0.02)
    reader_metrics.restore_pending(lost)
    got = reader_metrics.take_pending()
    assert got.fetched_blocks["bulk"] == 3 and got.fetched_bytes["bulk"] == 96
    assert sorted(got.fetch_seconds["bulk"]) == [0.01, 0.02]
    assert dict(got.prefill_tokens) == {"cached": 16, "computed": 4}


@pytest.mark.parametrize(
    "call",
    [lambda: metrics.record_served("tcp", 1, 1), lambda: reader_metrics.record_miss("gone"),
     lambda: metrics.record_rejected("ugly"), lambda: reader_metrics.record_fetch("x", 1, 1, 1.0),
     lambda: metrics.record_evictions("n", "boredom", 1),
     lambda: metrics.record_stored("thin-air", 1, 1)],
)
def test_unknown_labels_are_rejected(call) -> None:
    with pytest.raises(ValueError, match="use one of"):
        call()


def test_a_pushed_tally_with_an_unknown_label_records_nothing() -> None:
    hits = value("kvstore_hits_total")
    tally = ReaderTally(hits=3)
    tally.fetched_blocks["carrier-pigeon"] = 1
    with pytest.raises(ValueError, match="use one of"):
        metrics.apply_reader_tally(tally)
    assert value("kvstore_hits_total") == hits


def test_pool_gauges_follow_the_pool_and_forget_node() -> None:
    current = [make_stats()]
    metrics.watch_pool("node-a", lambda: current[0])
    metrics.record_evictions("node-a", "capacity", 3)
    assert value("kvstore_pool_used_bytes", node_id="node-a") == 400
    assert value("kvstore_pool_capacity_bytes", node_id="node-a") == 1000
    current[0] = make_stats(used=700, blocks=7)  # read at scrape time, not at the last beat
    assert value("kvstore_pool_used_bytes", node_id="node-a") == 700
    assert value("kvstore_pool_blocks", node_id="node-a") == 7
    assert value("kvstore_pool_leased_blocks", node_id="node-a") == 2
    assert value("kvstore_evictions_total", node_id="node-a", cause="capacity") == 3
    metrics.forget_node("node-a")
    assert metrics.REGISTRY.get_sample_value("kvstore_pool_used_bytes", {"node_id": "node-a"}) \
        is None
    assert metrics.REGISTRY.get_sample_value(
        "kvstore_evictions_total", {"node_id": "node-a", "cause": "capacity"}) is None
    metrics.forget_node("never-seen")


def test_reimport_does_not_duplicate_series() -> None:
    import kvstore.metrics as again

    assert again.REGISTRY is metrics.REGISTRY
    importlib.import_module("kvstore.metrics")  # a second component importing it is harmless


def test_metrics_server_serves_the_registry_on_loopback() -> None:
    metrics.record_served("bulk", 1, 1)
    address = metrics.serve_metrics(0, "127.0.0.1", "192.0.2.1", "test")
    try:
        assert address is not None and address.startswith("127.0.0.1:")
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
            body = resp.read().decode()
        assert "kvstore_served_blocks_total" in body and "kvstore_hits_total" in body
        assert metrics.serve_metrics(None, "127.0.0.1", "x", "test") is None  # off
        taken = int(address.rsplit(":", 1)[1])
        assert metrics.serve_metrics(taken, "127.0.0.1", "x", "test") is None  # logged, no crash
    finally:
        metrics.stop_metrics_servers()


def test_a_wildcard_bind_advertises_the_node_ip() -> None:
    try:
        address = metrics.serve_metrics(0, "0.0.0.0", "192.0.2.1", "test")
        assert address is not None and address.startswith("192.0.2.1:")
    finally:
        metrics.stop_metrics_servers()
