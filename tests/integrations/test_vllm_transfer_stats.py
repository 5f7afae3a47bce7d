"""The connector's figures in vLLM's statistics: the worker side counts what it moved, and
vLLM's own log line and Prometheus metrics (its real classes, which find the connector class
from the kv-transfer config) add them up per interval and per engine."""

from __future__ import annotations

import functools
import os

import pytest

if os.environ.get("KVSTORE_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvstore.integrations.vllm.transfer_stats import KVStoreTransferStats
from kvstore.integrations.vllm.transfer_tally import TransferTally

CONFIG = {"kv_connector": "KVStoreConnector",
          "kv_connector_module_path": "kvstore.integrations.vllm", "kv_role": "kv_both"}


def test_the_tally_hands_out_what_moved_since_the_last_take() -> None:
    tally = TransferTally()
    tally.add("loaded_blocks", 3)
    tally.add("loaded_blocks", 2)
    tally.add("saved_blocks", 0)
    assert tally.take() == {"loaded_blocks": 5}
    assert tally.take() == {}
    assert tally.total("loaded_blocks") == 5
    with pytest.raises(ValueError, match="unknown transfer figure"):
        tally.add("loaded_tokens", 1)


def test_vllms_log_line_sums_the_steps_of_an_interval() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging

    logging = KVConnectorLogging(KVTransferConfig(**CONFIG))
    logging.observe(KVStoreTransferStats(data={"loaded_blocks": 4, "loaded_bytes": 3 << 20,
                                               "fetch_seconds": 0.002}).to_dict())
    logging.observe({"loaded_blocks": 4, "loaded_bytes": 3 << 20, "fetch_seconds": 0.002,
                     "load_failed_blocks": 1, "saved_blocks": 2, "saved_bytes": 1 << 20})
    lines: list[str] = []
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert lines == ["KV Transfer metrics: loaded_blocks=8, loaded_MiB=6.0, "
                     "load_failed_blocks=1, fetch_ms_per_block=0.5, saved_blocks=2, "
                     "saved_MiB=1.0"]
    logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1  # the interval was reset: nothing new, no line
    assert KVStoreTransferStats(data={}).is_empty()


def test_vllms_prometheus_counters_add_up_per_engine() -> None:
    from vllm.config import KVTransferConfig, VllmConfig

    from kvstore.integrations.vllm.connector import KVStoreConnector

    registry = CollectorRegistry()
    types = {kind: functools.partial(kind, registry=registry)
             for kind in (Gauge, Counter, Histogram)}
    prom = KVStoreConnector.build_prom_metrics(
        VllmConfig(kv_transfer_config=KVTransferConfig(**CONFIG)), types,
        ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
    prom.observe({"loaded_blocks": 4, "load_failed_blocks": 1}, engine_idx=1)
    prom.observe({"loaded_blocks": 2, "saved_bytes": 4096}, engine_idx=1)

    def value(name: str, engine: str) -> float | None:
        return registry.get_sample_value(f"vllm:kvstore_{name}_total",
                                         {"model_name": "m", "engine": engine})

    assert value("loaded_blocks", "1") == 6 and value("load_failed_blocks", "1") == 1
    assert value("saved_bytes", "1") == 4096 and value("loaded_blocks", "0") == 0
