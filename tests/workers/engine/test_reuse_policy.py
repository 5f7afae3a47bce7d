"""Block-granular reuse: every policy against the same engine with the store bypassed.

Random prompt pairs share 16-2048 tokens at random cut points; in the default ``exact`` policy
the second prompt must reuse every shared full block (up to the block holding its last token)
and give bitwise the logits and tokens of ``--no-cache``, on the tiny and small presets and on
a checkpoint saved in transformers' own format. The probe's verdicts are forced both ways, and
shown able to fail on a model whose small-row results differ.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvstore.client.local_store import LocalStore
from kvstore.config import WorkerConfig
from kvstore.workers.engine import reuse_policy as reuse
from kvstore.workers.engine.prefill_decode import Engine
from kvstore.workers.model.causal_lm import load_model
from kvstore.workers.model.sampling import SamplingParams

SAMPLING = SamplingParams(max_new_tokens=4)


def perturbed_deep(model, below_rows: int, past: int):
    """``model`` off in the last bits for pieces of fewer than ``below_rows`` rows that run on
    top of at least ``past`` cached tokens: a backend whose kernels change with the key
    length as well as the row count (what cuBLAS's split-K heuristics may do on a GPU)."""
    state = {"past": 0}

    def before(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        state["past"] = cache.get_seq_length() if cache is not None else 0

    def hook(module, inputs, output):
        deep = state["past"] >= past and output.shape[-2] < below_rows
        return output + 1e-3 if deep else output

    model.model.register_forward_pre_hook(before, with_kwargs=True)
    model.model.model.layers[0].self_attn.k_proj.register_forward_hook(hook)
    return model


def test_sizes_exact_over_one_chunk_of_keys_are_tried_again_over_a_long_prompt():
    """A size that passes over one chunk of keys but not at the end of a long prompt is
    dropped (on an accelerator the probe tries both; ``long_keys`` forces it here)."""
    clean = reuse._probe(load_model("tiny", seed=3), 16, 64)  # this CPU's sizes
    assert {16, 32, 48, 64} <= set(clean)
    assert reuse._probe(load_model("tiny", seed=3), 16, 64, long_keys=256) == clean
    model = perturbed_deep(load_model("tiny", seed=3), below_rows=48, past=128)
    assert reuse._probe(model, 16, 64) == clean  # one chunk of keys: the change is unseen
    assert reuse._probe(model, 16, 64, long_keys=256) == (48, 64)
    assert reuse.long_probe_tokens(model, 64) == 0  # on the CPU: one chunk of keys only


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny", seed=0)


def make_config(**kw) -> WorkerConfig:
    """Publishing on the request's thread: these tests look at which blocks a prefill
    publishes right after it (the background publisher has tests of its own)."""
    return WorkerConfig(**{"model": "tiny", "publish_backlog_blocks": 0, **kw})


def make_prompt(n: int, seed: int, vocab: int = 512) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def check_pair(model, config: WorkerConfig, first: list[int], second: list[int]):
    """Prefill ``first``, then run ``second`` cached and uncached; both must agree bitwise."""
    store = LocalStore()
    engine = Engine(model, store, config)
    engine.prefill(first)
    pre, dec = engine.generate(second, sampling=SAMPLING, return_logits=True)
    ref_pre, ref_dec = Engine(model, None, config).generate(second, sampling=SAMPLING,
                                                           return_logits=True)
    assert torch.equal(pre.logits, ref_pre.logits)
    assert dec.output_token_ids == ref_dec.output_token_ids
    assert all(torch.equal(a, b) for a, b in zip(dec.logits, ref_dec.logits, strict=True))
    return engine, pre


def shared_pair(n_shared: int, n_first: int, n_second: int, seed: int, vocab: int = 512):
    common = make_prompt(n_shared, seed, vocab)
    return (common + make_prompt(n_first, seed + 1, vocab),
            common + make_prompt(n_second, seed + 2, vocab))


def test_random_pairs_reuse_every_shared_block_bitwise(tiny):
    rng = random.Random(16)
    bs, chunk = 16, 256
    for case in range(12):
        n_shared = rng.choice([16, 17, 31, 48, 100, 208, 255, 256, 257, 300, 511, 777, 1024,
                               2048])
        first, second = shared_pair(n_shared, rng.randint(1, 40), rng.randint(1, 40), case)
        engine, pre = check_pair(tiny, make_config(), first, second)
        shared = min(n_shared // bs * bs, (len(second) - 1) // bs * bs)
        # Resumed at the last shared block, or where the first piece's size reaches back to
        # (at most half a piece, never past the chunk's start).
        start = engine.resume_point(shared, len(second))
        assert pre.cached_tokens == start, (case, n_shared)
        assert shared // chunk * chunk <= start <= shared
        assert pre.unreused_shared_tokens == shared - start


def test_small_preset_reuses_a_short_system_prompt_bitwise():
    """A system prompt shorter than one chunk (242 tokens here) was never reused before."""
    small = load_model("small", seed=0)
    for n_shared, seed in ((242, 1), (300, 2)):
        first, second = shared_pair(n_shared, 12, 9, seed, vocab=32000)
        engine, pre = check_pair(small, make_config(model="small"), first, second)
        assert engine.policy.resume == "block"
        assert pre.cached_tokens == n_shared // 16 * 16


def test_a_saved_checkpoint_reuses_bitwise(tmp_path, tiny):
    tiny.model.save_pretrained(tmp_path / "ckpt")
    saved = load_model(str(tmp_path / "ckpt"))
    assert saved.fingerprint == tiny.fingerprint
    for n_shared, seed in ((40, 3), (260, 4)):
        first, second = shared_pair(n_shared, 20, 7, seed)
        _, pre = check_pair(saved, make_config(model=str(tmp_path / "ckpt")), first, second)
        assert pre.cached_tokens == n_shared // 16 * 16


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_probe_finds_the_piece_sizes_of_this_cpu(attn, threads):
    """Measured on the machines this ran on: every multiple of a block agrees with the whole
    chunk, with 1 thread or 2; pieces below a block depend on the CPU's matmul kernels (4 and 8
    rows agreed on one machine, only 8 on another, 1 and 2 on neither), so for those the
    engine's policy must use exactly what the probe found, smallest fitting size first."""
    model = load_model("tiny", seed=0, attn_implementation=attn, num_threads=threads)
    try:
        probed = reuse.probe_piece_sizes(model, 16, 64)
        policy = Engine(model, None, make_config(prefill_chunk_tokens=64,
                                                 num_threads=threads)).policy
    finally:
        torch.set_num_threads(1)
    assert {16, 32, 48, 64} <= set(probed) and set(probed) <= {1, 2, 4, 8, 16, 32, 48, 64}
    assert 1 not in probed and 2 not in probed  # the kernel switch every CPU so far showed
    assert (policy.resume, policy.publish, policy.pad_keys) == ("block", "block", True)
    assert policy.exact and policy.as_dict()["piece_sizes"] == list(probed)
    for n in (1, 3, 4, 5, 31, 33, 64):
        assert policy.piece_size(n) == min(s for s in probed if s >= n)


def perturbed(model, below_rows: int):
    """``model`` whose first layer's K projection is off in the last bits when it runs fewer
    than ``below_rows`` rows: a backend whose kernels differ for small row counts."""

    def hook(module, inputs, output):
        return output + 1e-3 if output.shape[-2] < below_rows else output

    model.model.model.layers[0].self_attn.k_proj.register_forward_hook(hook)
    return model


def test_the_probe_finds_the_sizes_of_a_backend_and_can_fail():
    model = perturbed(load_model("tiny", seed=1), below_rows=16)
    assert reuse.probe_piece_sizes(model, 16, 64) == (16, 32, 48, 64)
    model = perturbed(load_model("tiny", seed=2), below_rows=64)  # only whole chunks agree
    assert reuse.probe_piece_sizes(model, 16, 64) == (64,)


@pytest.fixture
def probe_fails(monkeypatch):
    """Force the fallback: only whole chunks agree (as on some GPU GEMM libraries)."""
    monkeypatch.setattr(reuse, "probe_piece_sizes", lambda model, bs, chunk: (chunk,))


def test_fallback_resumes_at_chunks_pads_rows_and_still_publishes_every_block(tiny, probe_fails):
    config = make_config(prefill_chunk_tokens=32)
    engine = Engine(tiny, None, config)
    assert (engine.policy.resume, engine.policy.publish, engine.policy.piece_sizes) == \
        ("chunk", "block", (32,))
    assert engine.policy.exact
    first, second = shared_pair(56, 30, 20, seed=5)
    engine, pre = check_pair(tiny, config, first, second)
    assert pre.cached_tokens == 32 and pre.unreused_shared_tokens == 16
    # Every full block of the first prompt was published, its partial last chunk's included.
    assert len(engine.store.blocks) >= len(first) // 16


def test_row_padding_gives_the_partial_chunk_the_whole_chunks_blocks(tiny, probe_fails):
    config = make_config(prefill_chunk_tokens=32)
    longer = make_prompt(64, seed=6)
    store = LocalStore()
    Engine(tiny, store, config).prefill(longer[:50])  # blocks 0-1 whole chunk, block 2 partial
    assert len(store.blocks) == 3
    whole = LocalStore()
    Engine(tiny, whole, config).prefill(longer)
    assert set(store.blocks) <= set(whole.blocks)
    assert all(store.blocks[k] == whole.blocks[k] for k in store.blocks)


def test_chunk_policy_is_the_previous_behaviour(tiny):
    config = make_config(prefill_chunk_tokens=32, reuse="chunk")
    engine = Engine(tiny, None, config)
    assert engine.policy.as_dict() == {"mode": "chunk", "resume": "chunk", "piece_sizes": [32],
                                       "publish": "chunk", "pad_keys": False, "exact": True}
    first, second = shared_pair(56, 30, 20, seed=7)
    store = LocalStore()
    Engine(tiny, store, config).prefill(first)
    assert len(store.blocks) == len(first) // 32 * 2  # blocks of whole chunks only
    _, pre = check_pair(tiny, config, first, second)
    assert pre.cached_tokens == 32 and pre.unreused_shared_tokens == 16


def test_block_policy_keeps_an_approximate_cache_apart(tiny, probe_fails):
    exact = Engine(tiny, None, make_config(prefill_chunk_tokens=32))
    approx = Engine(tiny, None, make_config(prefill_chunk_tokens=32, reuse="block"))
    assert approx.policy.resume == "block" and not approx.policy.exact
    assert approx.namespace.root != exact.namespace.root
    store = LocalStore()
    approx.store = store
    first, second = shared_pair(56, 30, 20, seed=8)
    approx.prefill(first)
    assert approx.prefill(second).cached_tokens == 48


def test_block_policy_shares_the_exact_namespace_where_every_size_passes(tiny, monkeypatch):
    monkeypatch.setattr(reuse, "probe_piece_sizes",
                        lambda model, bs, chunk: reuse.candidate_sizes(bs, chunk))
    exact = Engine(tiny, None, make_config())
    approx = Engine(tiny, None, make_config(reuse="block"))
    assert approx.policy.exact and approx.namespace == exact.namespace


def test_unknown_reuse_mode_is_a_config_error():
    from kvstore.errors import ConfigError

    with pytest.raises(ConfigError, match="worker.reuse"):
        WorkerConfig(reuse="sometimes")  # type: ignore[arg-type]


def test_the_probe_view_runs_the_first_layers_and_changes_nothing():
    """The probe runs a view of the model's first layers: the same KV as the full model's
    first layers, and the model itself untouched."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvstore.workers.model.causal_lm import PRESETS, CausalLM

    torch.manual_seed(0)
    model = CausalLM(LlamaForCausalLM(LlamaConfig(**{**PRESETS["tiny"], "num_hidden_layers": 3})),
                     "float32", "three-layers")
    view = reuse._first_layers(model, 2)
    assert view.shape.num_layers == 2 and view.config.num_hidden_layers == 2
    assert model.shape.num_layers == 3 and model.config.num_hidden_layers == 3
    assert len(model.model.model.layers) == 3
    tokens = make_prompt(24, seed=9)
    short, full = view.new_cache(), model.new_cache()
    view.forward(tokens, short, pad_keys_to=32)
    model.forward(tokens, full, pad_keys_to=32)
    assert len(short.layers) == 2
    assert torch.equal(view.export_kv(short, 0, 24), model.export_kv(full, 0, 24)[:2])
