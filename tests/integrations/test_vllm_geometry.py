"""The KV geometry the connector reads off vLLM's config: one rank's heads under tensor
parallelism, and a clear refusal for what kvstore cannot hold."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from kvstore.errors import ConfigError

if os.environ.get("KVSTORE_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

from kvstore.integrations.vllm.connector import geometry_of  # noqa: E402 - after the skip


def config(tp: int = 1, pp: int = 1, dcp: int = 1, kv_heads: int = 2, mla: bool = False,
           cache_dtype: str = "auto") -> SimpleNamespace:
    """The fields of vLLM's config that ``geometry_of`` reads, with vLLM's rule for a rank's
    KV heads (at least one: heads replicate when there are more ranks)."""
    parallel = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                               decode_context_parallel_size=dcp,
                               prefill_context_parallel_size=1)
    model = SimpleNamespace(
        model="/ck", dtype="torch.bfloat16", use_mla=mla,
        get_num_kv_heads=lambda p: 1 if mla else max(1, kv_heads // p.tensor_parallel_size),
        get_total_num_kv_heads=lambda: kv_heads, get_num_layers=lambda p: 4,
        get_head_size=lambda: 64)
    return SimpleNamespace(model_config=model, parallel_config=parallel,
                           cache_config=SimpleNamespace(cache_dtype=cache_dtype, block_size=16))


def test_a_tensor_parallel_rank_holds_its_share_of_the_kv_heads() -> None:
    geometry = geometry_of(config(tp=4, kv_heads=8))
    assert (geometry.num_kv_heads, geometry.total_kv_heads, geometry.num_shards) == (2, 8, 4)
    replicated = geometry_of(config(tp=4, kv_heads=2))
    assert replicated.num_kv_heads == 1 and replicated.num_shards == 2
    assert geometry_of(config(tp=2, mla=True)).num_shards == 1  # the latent: every rank's
    assert geometry_of(config()).shard_label(0) == ""


@pytest.mark.parametrize(("settings", "message"), [
    ({"pp": 2}, "pipeline parallel size 1"),
    ({"dcp": 2}, "context parallel size 1"),
    ({"cache_dtype": "fp8"}, "kv_cache_dtype auto"),
])
def test_what_kvstore_cannot_hold_is_refused(settings: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        geometry_of(config(**settings))
