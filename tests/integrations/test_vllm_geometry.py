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
from kvstore.integrations.vllm.namespace import namespace  # noqa: E402


def config(tp: int = 1, pp: int = 1, dcp: int = 1, kv_heads: int = 2, mla: bool = False,
           cache_dtype: str = "auto", skip_layers: tuple[str, ...] = (),
           dtype: str = "bfloat16") -> SimpleNamespace:
    """The fields of vLLM's config that ``geometry_of`` reads, with vLLM's rule for a rank's
    KV heads (at least one: heads replicate when there are more ranks)."""
    parallel = SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                               decode_context_parallel_size=dcp,
                               prefill_context_parallel_size=1)
    model = SimpleNamespace(
        model="/ck", dtype=f"torch.{dtype}", use_mla=mla,
        get_num_kv_heads=lambda p: 1 if mla else max(1, kv_heads // p.tensor_parallel_size),
        get_total_num_kv_heads=lambda: kv_heads, get_num_layers=lambda p: 4,
        get_head_size=lambda: 64)
    return SimpleNamespace(model_config=model, parallel_config=parallel,
                           cache_config=SimpleNamespace(
                               cache_dtype=cache_dtype, block_size=16,
                               kv_cache_dtype_skip_layers=list(skip_layers)))


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
    ({"cache_dtype": "int8_per_token_head"}, "not 'int8_per_token_head'"),
    ({"cache_dtype": "nvfp4"}, "kv_cache_dtype auto, float16, bfloat16, fp8"),
    ({"cache_dtype": "fp8", "skip_layers": ("0",)}, "kv_cache_dtype_skip_layers must be empty"),
])
def test_what_kvstore_cannot_hold_is_refused(settings: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        geometry_of(config(**settings))


def test_an_fp8_cache_is_held_as_its_bytes_in_a_namespace_of_its_format() -> None:
    """vLLM stores fp8 KV as bytes: kvstore holds them as uint8, in a namespace whose numerics
    name the format and the model's dtype it was quantized from ("fp8" is e4m3)."""
    def ns(**settings):
        return namespace(geometry_of(config(**settings)), "f" * 64, "cpu|tag", None)

    fp8 = geometry_of(config(cache_dtype="fp8"))
    assert (fp8.dtype, fp8.kv_cache_format) == ("uint8", "fp8_e4m3 of bfloat16")
    assert ns(cache_dtype="fp8").numerics == "cpu|tag|kv cache fp8_e4m3 of bfloat16"
    assert ns(cache_dtype="fp8").payload_nbytes * 2 == ns().payload_nbytes
    assert ns(cache_dtype="fp8") == ns(cache_dtype="fp8_e4m3")
    roots = {ns(cache_dtype=c, dtype=d).root for c, d in [
        ("fp8", "bfloat16"), ("fp8_e5m2", "bfloat16"), ("fp8", "float32"),
        ("auto", "bfloat16"), ("bfloat16", "float32"), ("auto", "float32")]}
    assert len(roots) == 6  # no two formats, nor one format of two models' dtypes, share


def test_a_cache_in_the_models_own_dtype_is_the_plain_namespace() -> None:
    assert ns_numerics("bfloat16") == ns_numerics("auto") == "cpu|tag"
    assert geometry_of(config(cache_dtype="bfloat16", dtype="float32")).dtype == "bfloat16"


def ns_numerics(cache_dtype: str) -> str:
    return namespace(geometry_of(config(cache_dtype=cache_dtype)), "f" * 64, "cpu|tag",
                     None).numerics
