"""``benchmarks/baselines/copy_floor_connector.py`` moves exactly a load's bytes, layer by layer,
and never touches vLLM's caches: its figure in ``bench_vllm`` is the cost of those bytes alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="the connector subclasses vLLM's KVConnectorBase_V1")

from benchmarks.baselines.copy_floor_connector import (  # noqa: E402
    CopyFloorConnector,
    CopyFloorMetadata,
)

BLOCK_SIZE, LAYERS, HEADS, HEAD_SIZE, NUM_BLOCKS = 4, 3, 2, 8, 6


def make_connector() -> tuple[CopyFloorConnector, dict[str, torch.Tensor]]:
    config = SimpleNamespace(cache_config=SimpleNamespace(block_size=BLOCK_SIZE),
                             model_config=SimpleNamespace(max_model_len=6 * BLOCK_SIZE),
                             kv_transfer_config=SimpleNamespace())
    connector = CopyFloorConnector(config, role=None)
    caches = {f"model.layers.{i}.self_attn.attn":  # the CPU backend's layout
              torch.randn(NUM_BLOCKS, HEADS, BLOCK_SIZE, 2 * HEAD_SIZE) for i in range(LAYERS)}
    connector.register_kv_caches(caches)
    return connector, caches


def test_the_scheduler_side_counts_each_new_requests_local_hit_in_blocks() -> None:
    connector, _ = make_connector()
    new = [SimpleNamespace(req_id=f"r{n}", num_computed_tokens=n) for n in (0, 3, 8, 12, 16)]
    connector.get_num_new_matched_tokens(  # the paired floor's request: moves nothing
        SimpleNamespace(request_id="r16", kv_transfer_params={"kvstore_bypass": True}), 16)
    connector.get_num_new_matched_tokens(SimpleNamespace(request_id="r8",
                                                         kv_transfer_params=None), 8)
    meta = connector.build_connector_meta(SimpleNamespace(scheduled_new_reqs=new))
    assert isinstance(meta, CopyFloorMetadata)
    assert meta.hit_blocks == [2, 3]  # no hit, less than a block, or bypassed: nothing


def test_each_layer_gets_every_hits_blocks_and_vllms_caches_stay_as_they_were() -> None:
    connector, caches = make_connector()
    before = {name: cache.clone() for name, cache in caches.items()}
    assert connector.source is not None and connector.dest is not None
    connector.source.copy_(torch.randint(0, 256, connector.source.shape, dtype=torch.uint8))
    connector.bind_connector_metadata(CopyFloorMetadata([2, 3]))
    connector.start_load_kv(None)
    for name in sorted(caches, reverse=True):  # each layer's wait returns once it is moved
        connector.wait_for_layer_load(name)
    connector.wait_for_save()
    chunk = HEADS * BLOCK_SIZE * 2 * HEAD_SIZE * 4  # one block of one layer, float32
    assert connector.dest.shape == (LAYERS, 6, chunk)
    for layer in range(LAYERS):  # the destination as vLLM's caches: layer-major
        assert torch.equal(connector.dest[layer, :5], connector.source[:5, layer])
    assert not connector.dest[:, 5:].any()  # the sixth block: no hit reached it
    for name, cache in caches.items():
        assert torch.equal(cache, before[name])
    connector.shutdown()


def test_a_step_without_a_hit_moves_nothing() -> None:
    connector, caches = make_connector()
    connector.bind_connector_metadata(CopyFloorMetadata([]))
    connector.start_load_kv(None)
    connector.wait_for_layer_load(next(iter(caches)))
    connector.wait_for_save()
    assert connector.dest is not None and not connector.dest.any()
    connector.shutdown()
