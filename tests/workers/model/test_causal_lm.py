"""The model adapter: presets, fingerprints, namespaces and the block export layout."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from kvstore.errors import ConfigError
from kvstore.workers.model.causal_lm import PRESETS, load_model


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=0)


def make_prompt(n: int, seed: int = 0, vocab: int = 512) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def test_small_preset_has_the_required_shape():
    cfg = LlamaConfig(**PRESETS["small"])
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
            cfg.num_key_value_heads, cfg.intermediate_size, cfg.vocab_size) == (
        1024, 12, 16, 4, 2816, 32000)


def test_fingerprint_is_deterministic_and_covers_weights(tiny):
    again = load_model("tiny", seed=0)
    other = load_model("tiny", seed=1)
    assert again.fingerprint == tiny.fingerprint
    assert other.fingerprint != tiny.fingerprint
    # One changed weight must change the fingerprint: it hashes bytes, not the preset name.
    with torch.no_grad():
        again.model.lm_head.weight[0, 0] += 1.0
    from kvstore.workers.model.causal_lm import CausalLM
    assert CausalLM(again.model, "float32", "tiny").fingerprint != tiny.fingerprint


def test_fingerprint_survives_save_and_load_from_a_directory(tiny, tmp_path):
    tiny.model.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path))
    assert loaded.fingerprint == tiny.fingerprint
    assert loaded.namespace(16).root == tiny.namespace(16).root


def test_namespace_fields_and_salt(tiny):
    ns = tiny.namespace(16, "tenant-a")
    assert (ns.dtype, ns.block_size, ns.num_layers, ns.num_kv_heads, ns.head_dim) == (
        "float32", 16, 2, 2, 16)
    assert ns.root != tiny.namespace(16, "tenant-b").root
    assert ns.root != tiny.namespace(32, "tenant-a").root


def test_bad_model_spec_is_a_config_error():
    with pytest.raises(ConfigError, match="neither a preset"):
        load_model("/no/such/dir")
    with pytest.raises(ConfigError, match="dtype"):
        load_model("tiny", dtype="int8")


def test_chunked_forward_matches_a_plain_forward(tiny):
    prompt = make_prompt(75)
    cache = tiny.new_cache()
    for pos in range(0, len(prompt), 32):
        logits = tiny.forward(prompt[pos:pos + 32], cache)
    with torch.inference_mode():
        ref = tiny.model(torch.tensor([prompt]), use_cache=False).logits[0, -1]
    assert torch.allclose(logits, ref, atol=1e-4, rtol=0)


def test_export_blocks_layout_matches_the_cache(tiny):
    prompt = make_prompt(40)
    cache = tiny.new_cache()
    tiny.forward(prompt, cache)
    blocks = tiny.export_blocks(cache, 16, 1, 16)
    assert blocks[0].shape == tiny.namespace(16).payload_shape
    layer = cache.layers[1]
    assert torch.equal(blocks[0][1, 0], layer.keys[0, :, 16:32].transpose(0, 1))
    assert torch.equal(blocks[0][1, 1], layer.values[0, :, 16:32].transpose(0, 1))
    # Round trip: a cache rebuilt from exported K/V continues exactly like the original.
    kv = tiny.export_kv(cache, 0, 40)
    rebuilt = tiny.cache_from_kv([kv[i, 0] for i in range(2)], [kv[i, 1] for i in range(2)])
    assert torch.equal(tiny.forward([7], rebuilt), tiny.forward([7], cache))


def test_a_cache_that_is_not_plain_full_attention_is_refused_at_load():
    # Llama ignores attention_chunk_size, but the cache transformers builds for it would keep a
    # window per layer: the structural check sees that whatever the model's code does.
    model = load_model("tiny").model
    model.config.attention_chunk_size = 8
    from kvstore.workers.model.causal_lm import CausalLM
    with pytest.raises(ConfigError, match="DynamicSlidingWindowLayer, not full attention"):
        CausalLM(model, "float32", "chunked")


class _LatentAttention(torch.nn.Module):
    """A stand-in for an MLA model: K and V of one layer cached with different head dims."""

    def __init__(self) -> None:
        super().__init__()
        self.config = LlamaConfig(**PRESETS["tiny"])
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, past_key_values, **kwargs):
        from types import SimpleNamespace

        n = input_ids.shape[1]
        for layer in range(self.config.num_hidden_layers):
            past_key_values.update(torch.zeros(1, 2, n, 16), torch.zeros(1, 2, n, 8), layer)
        return SimpleNamespace(logits=torch.zeros(1, n, self.config.vocab_size))


def test_different_k_and_v_head_dims_are_refused_at_load():
    from kvstore.workers.model.causal_lm import CausalLM

    with pytest.raises(ConfigError, match=r"'mla'.*different K and V head dims \(MLA\)"):
        CausalLM(_LatentAttention(), "float32", "mla")


def test_layer_types_other_than_full_attention_are_refused():
    from transformers import LlamaForCausalLM

    from kvstore.workers.model.causal_lm import CausalLM

    cfg = LlamaConfig(**PRESETS["tiny"], layer_types=["full_attention", "chunked_attention"])
    with pytest.raises(ConfigError, match="layer_types"):
        CausalLM(LlamaForCausalLM(cfg), "float32", "chunked")


def test_forward_uses_the_current_cache_keyword_and_warns_nothing(tiny):
    """transformers renamed ``forward``'s ``past_key_values`` to ``cache`` and warns on the old
    name; the adapter passes whichever name the loaded model's ``forward`` takes."""
    import warnings

    import transformers
    from packaging.version import Version

    from kvstore.workers.model.causal_lm import cache_keyword

    # the rename landed in transformers 5.24; vLLM pins an older one, so both are installed
    renamed = Version(transformers.__version__) >= Version("5.24")
    assert tiny.cache_keyword == ("cache" if renamed else "past_key_values")
    assert cache_keyword(_LatentAttention()) == "past_key_values"  # written before the rename
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = load_model("tiny", seed=0)  # the load runs one token to check the cache layout
        model.forward(make_prompt(20), model.new_cache(), pad_keys_to=32, pad_rows_to=32)
