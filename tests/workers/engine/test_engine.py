"""Exact reuse: cached runs are bitwise equal to uncached runs; all against references.

Block size 16 and chunk 32 on the tiny preset, in-process on LocalStore (full verification),
with the default policy (``reuse: exact``; on this CPU the probe finds rows invariant, so hits
are used to the last block). The uncached reference is the same engine with no store; the
independent reference is a plain transformers forward over the whole sequence with no cache.
The other policies are tested in ``tests/workers/engine/test_reuse_policy.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from kvstore import metrics
from kvstore.api import MISS_NODE_UNAVAILABLE, FetchedBlock, Miss, TokenIds
from kvstore.client.local_store import LocalStore
from kvstore.config import WorkerConfig
from kvstore.errors import ConfigError, RequestCancelled
from kvstore.keys import Namespace
from kvstore.workers.engine.prefill_decode import Engine
from kvstore.workers.model.causal_lm import load_model
from kvstore.workers.model.sampling import SamplingParams

BS, CHUNK = 16, 32
SAMPLING = SamplingParams(max_new_tokens=6)


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", seed=0)


def make_config(**kw) -> WorkerConfig:
    return WorkerConfig(model="tiny", block_size=BS, prefill_chunk_tokens=CHUNK, **kw)


def make_prompt(n: int, seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 512, (n,), generator=g).tolist()


def reference(model, prompt: list[int]):
    """Uncached run of the same engine: first-token logits, step logits, tokens."""
    pre, dec = Engine(model, None, make_config()).generate(prompt, sampling=SAMPLING,
                                                          return_logits=True)
    return pre.logits, dec.logits, dec.output_token_ids


def assert_same(model, prompt, pre, dec):
    ref_logits, ref_steps, ref_tokens = reference(model, prompt)
    assert torch.equal(pre.logits, ref_logits)
    assert dec.output_token_ids == ref_tokens
    assert len(dec.logits) == len(ref_steps)
    assert all(torch.equal(a, b) for a, b in zip(dec.logits, ref_steps, strict=True))


def disaggregated(engine_p: Engine, engine_d: Engine, prompt, *, tail=True):
    """A prefill, then a decode that waits for the blocks the prefill queued for publishing
    in the background (as a decode replica elsewhere does)."""
    pre = engine_p.prefill(prompt, sampling=SAMPLING, return_logits=True)
    dec = engine_d.decode(prompt, pre.first_token, tail=pre.tail if tail else None,
                          sampling=SAMPLING, return_logits=True,
                          wait_for_blocks=pre.num_prefix_blocks)
    return pre, dec


class HolderGone:
    """A store whose holder dies mid-fetch: blocks from ``fail_from`` on come back as Miss."""

    def __init__(self, inner: LocalStore, fail_from: int) -> None:
        self.inner, self.fail_from, self.node_id = inner, fail_from, "dying"

    def lookup_prefix(self, namespace: Namespace, keys: Sequence[bytes]):
        return self.inner.lookup_prefix(namespace, keys)

    def batch_get(self, namespace: Namespace, keys: Sequence[bytes],
                  token_ids: Sequence[TokenIds], **kwargs) -> list[FetchedBlock | Miss]:
        got = self.inner.batch_get(namespace, keys, token_ids, **kwargs)
        return [r if i < self.fail_from else Miss(r.key, MISS_NODE_UNAVAILABLE, "node died")
                for i, r in enumerate(got)]

    def batch_put(self, namespace, blocks) -> None:
        self.inner.batch_put(namespace, blocks)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("n", [20, 32, 48, 64, 77, 96, 130])
def test_cold_then_warm_equals_uncached(model, n):
    store = LocalStore()
    engine = Engine(model, store, make_config())
    pre, dec = disaggregated(engine, Engine(model, store, make_config()), make_prompt(n))
    assert pre.cached_tokens == 0
    assert_same(model, make_prompt(n), pre, dec)
    # Every full block is published, the partial last chunk's included.
    assert len(store.blocks) == n // BS
    # Warm: same prompt again, hit up to the last block boundary strictly before the end.
    pre2, dec2 = disaggregated(engine, engine, make_prompt(n))
    assert pre2.cached_tokens == (n - 1) // BS * BS
    assert pre2.unreused_shared_tokens == n // BS * BS - (n - 1) // BS * BS
    assert_same(model, make_prompt(n), pre2, dec2)
    assert dec2.recomputed_tokens == 0 and dec2.fetched_tokens == n // BS * BS


@pytest.mark.parametrize("shared", [16, 40, 64, 75])
def test_partial_hit_is_used_to_the_last_shared_block(model, shared):
    store = LocalStore()
    engine = Engine(model, store, make_config())
    base = make_prompt(100, seed=1)
    engine.prefill(base)
    prompt = base[:shared] + make_prompt(50, seed=2)
    pre, dec = disaggregated(engine, engine, prompt, tail=False)
    assert pre.cached_tokens == shared // BS * BS and pre.unreused_shared_tokens == 0
    assert_same(model, prompt, pre, dec)


@pytest.mark.parametrize("n", [96, 100, 75])
def test_published_kv_is_bitwise_the_canonical_whole_chunks(model, n):
    """Every published block, those of a partial last chunk too, equals the same block computed
    inside whole chunks of a longer prompt: the reference is the plain chunk loop."""
    store = LocalStore()
    engine = Engine(model, store, make_config())
    longer = make_prompt(128)
    pre = engine.prefill(longer[:n])
    engine.wait_published()
    cache = model.new_cache()
    for pos in range(0, 128, CHUNK):
        model.forward(longer[pos:pos + CHUNK], cache, pad_keys_to=pos + CHUNK)
    expected = model.export_blocks(cache, 0, n // BS, BS)
    got = store.batch_get(engine.namespace, pre.block_keys,
                          [longer[i * BS:(i + 1) * BS] for i in range(n // BS)])
    assert len(got) == n // BS
    assert all(isinstance(r, FetchedBlock) and torch.equal(r.payload, e)
               for r, e in zip(got, expected, strict=True))


def test_close_to_a_plain_transformers_forward(model):
    checked = 0
    for seed in range(4):
        prompt = make_prompt(70, seed=seed)
        store = LocalStore()
        engine = Engine(model, store, make_config())
        engine.prefill(prompt[:64])
        pre, dec = disaggregated(engine, engine, prompt)
        seq = list(prompt)
        gaps = []
        with torch.inference_mode():
            for step in range(SAMPLING.max_new_tokens):
                ref = model.model(torch.tensor([seq]), use_cache=False).logits[0, -1]
                ours = pre.logits if step == 0 else dec.logits[step - 1]
                assert torch.allclose(ours, ref, atol=1e-4, rtol=0)
                top2 = torch.topk(ref, 2).values
                gaps.append(float(top2[0] - top2[1]))
                seq.append(int(torch.argmax(ref)))
        if min(gaps) > 1e-3:  # tokens are only comparable when the argmax is not a near-tie
            assert dec.output_token_ids == seq[len(prompt):]
            checked += 1
    assert checked >= 1


def test_corrupted_block_in_the_middle_is_recomputed(model):
    store = LocalStore()
    engine = Engine(model, store, make_config())
    prompt = make_prompt(110, seed=3)
    first = engine.prefill(prompt)
    engine.wait_published()
    store.corrupt(first.block_keys[3])
    pre = engine.prefill(prompt, sampling=SAMPLING, return_logits=True)
    assert pre.cached_tokens == 3 * BS and "corrupted" in pre.misses
    assert pre.unreused_shared_tokens == (110 // BS - 3) * BS
    # The prefill re-offers blocks 3.. (the store keeps its first, corrupted copy of block 3):
    # while queued, this engine reads its own recomputed copies; from the store, block 3 is
    # still rejected.
    queued = engine.decode(prompt, pre.first_token, sampling=SAMPLING, return_logits=True)
    assert queued.fetched_tokens == 110 // BS * BS or "corrupted" in queued.misses
    assert_same(model, prompt, pre, queued)
    engine.wait_published()
    dec = engine.decode(prompt, pre.first_token, sampling=SAMPLING, return_logits=True)
    assert dec.fetched_tokens == 3 * BS and "corrupted" in dec.misses
    assert_same(model, prompt, pre, dec)


def test_two_system_prompts_each_reused(model):
    store = LocalStore()
    engine = Engine(model, store, make_config())
    sys_a, sys_b = make_prompt(64, seed=10), make_prompt(64, seed=11)
    engine.prefill(sys_a + [1])
    engine.prefill(sys_b + [1])
    for sys_prompt, suffix_seed in ((sys_a, 20), (sys_b, 21), (sys_a, 22)):
        prompt = sys_prompt + make_prompt(23, seed=suffix_seed)
        pre, dec = disaggregated(engine, engine, prompt)
        assert pre.cached_tokens == 64
        assert_same(model, prompt, pre, dec)


def test_tenants_with_different_salts_share_nothing(model):
    store = LocalStore()
    a = Engine(model, store, make_config(cache_salt="tenant-a"))
    b = Engine(model, store, make_config(cache_salt="tenant-b"))
    prompt = make_prompt(80, seed=4)
    a.prefill(prompt)
    assert store.lookup_prefix(b.namespace, b.hasher.block_keys(prompt)).num_blocks == 0
    pre = b.prefill(prompt)
    assert pre.cached_tokens == 0 and pre.bytes_fetched == 0


def test_a_second_replica_hits_the_first_ones_blocks(model):
    store = LocalStore(node_id="node-a")
    first = Engine(model, store, make_config())
    second = Engine(load_model("tiny", seed=0), store, make_config())
    prompt = make_prompt(90, seed=5)
    first.prefill(prompt)
    first.wait_published()  # another replica reads the store, not first's queue
    pre, dec = disaggregated(second, second, prompt)
    assert pre.cached_tokens == 80 and pre.sources == {"node-a": 5}
    assert pre.bytes_fetched == 5 * second.namespace.payload_nbytes
    assert_same(model, prompt, pre, dec)


@pytest.mark.parametrize("fail_from", [0, 1, 3])
def test_decode_survives_a_holder_dying_mid_fetch(model, fail_from):
    store = LocalStore()
    prompt = make_prompt(100, seed=6)
    writer = Engine(model, store, make_config())
    pre = writer.prefill(prompt, sampling=SAMPLING, return_logits=True)
    writer.wait_published()
    dying = Engine(model, HolderGone(store, fail_from), make_config())
    dec = dying.decode(prompt, pre.first_token, tail=pre.tail, sampling=SAMPLING,
                       return_logits=True)
    assert dec.fetched_tokens == fail_from * BS
    assert MISS_NODE_UNAVAILABLE in dec.misses
    assert_same(model, prompt, pre, dec)


def test_sampling_is_seeded_and_replica_independent(model):
    store = LocalStore()
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, top_k=50, sampling_seed=7)
    prompt = make_prompt(70, seed=8)
    _, ref = Engine(model, None, make_config()).generate(prompt, sampling=sampling)
    engine = Engine(model, store, make_config())
    engine.prefill(prompt)
    pre = engine.prefill(prompt, sampling=sampling)
    dec = engine.decode(prompt, pre.first_token, tail=pre.tail, sampling=sampling)
    assert dec.output_token_ids == ref.output_token_ids


def test_stop_token_ends_generation(model):
    prompt = make_prompt(40, seed=9)
    _, full = Engine(model, None, make_config()).generate(prompt, sampling=SAMPLING)
    stop = full.output_token_ids[2]
    sampling = SamplingParams(max_new_tokens=6, stop_token_ids=(stop,))
    _, dec = Engine(model, None, make_config()).generate(prompt, sampling=sampling)
    assert dec.output_token_ids == full.output_token_ids[:full.output_token_ids.index(stop) + 1]


def test_cancel_releases_the_request(model):
    store = LocalStore()
    engine = Engine(model, store, make_config())
    prompt = make_prompt(96, seed=12)
    engine.prefill(prompt)
    engine.wait_published()  # the decode below must fetch, not use the queued blocks

    class CancelDuringFetch(HolderGone):
        def batch_get(self, namespace, keys, token_ids, **kwargs):
            engine.cancel("r1")
            return self.inner.batch_get(namespace, keys, token_ids, **kwargs)

    engine.store = CancelDuringFetch(store, 0)
    with pytest.raises(RequestCancelled, match="cancelled"):
        engine.decode(prompt, 1, request_id="r1")
    assert engine.num_active == 0
    engine.store = store
    assert engine.decode(prompt, 1, request_id="r1").output_token_ids  # the id is reusable


def test_timeout_raises_request_cancelled(model):
    engine = Engine(model, None, make_config(request_timeout_s=1e-9))
    with pytest.raises(RequestCancelled, match="timed out"):
        engine.prefill(make_prompt(40))
    assert engine.num_active == 0


@pytest.mark.parametrize("prompt, match", [([], "empty"), ([1, 512], "vocabulary"),
                                           ([-1], "vocabulary")])
def test_bad_prompts_are_config_errors(model, prompt, match):
    with pytest.raises(ConfigError, match=match):
        Engine(model, LocalStore(), make_config()).prefill(prompt)


def test_decode_without_a_prefill_computes_the_first_token(model):
    store = LocalStore()
    prompt = make_prompt(96, seed=13)
    writer = Engine(model, store, make_config())
    writer.prefill(prompt)
    writer.wait_published()
    dec = Engine(model, store, make_config()).decode(prompt, None, sampling=SAMPLING)
    assert dec.fetched_tokens == 80 and dec.recomputed_tokens == 16
    assert dec.output_token_ids == reference(model, prompt)[2]


def test_an_unreachable_store_degrades_to_recompute(model):
    from kvstore.errors import NodeUnavailable

    class Down(HolderGone):
        def lookup_prefix(self, namespace, keys):
            raise NodeUnavailable("index down")

        def batch_get(self, namespace, keys, token_ids, **kwargs):
            raise NodeUnavailable("holder down")

        def batch_put(self, namespace, blocks):
            raise NodeUnavailable("holder down")

    prompt = make_prompt(80, seed=14)
    engine = Engine(model, Down(LocalStore(), 0), make_config(publish_backlog_blocks=0))
    pre, dec = disaggregated(engine, engine, prompt, tail=False)
    assert pre.cached_tokens == 0 and pre.num_published_blocks == 0
    assert "publish failed" in pre.misses[-1]
    assert dec.recomputed_tokens == 80
    assert_same(model, prompt, pre, dec)


def test_a_failed_background_publish_is_counted_and_recomputed(model):
    """The publish runs after the request: its failure cannot reach the result, so it is
    counted (kvstore_worker_publish_blocks_total{outcome="failed"}) and the blocks recomputed."""
    from kvstore.errors import NodeUnavailable

    class PutDown(HolderGone):
        def batch_put(self, namespace, blocks):
            raise NodeUnavailable("holder down")

    failed = metrics.PUBLISH_BLOCKS.labels(outcome="failed")
    before = failed._value.get()
    prompt = make_prompt(80, seed=14)
    engine = Engine(model, PutDown(LocalStore(), 0), make_config())
    pre = engine.prefill(prompt, sampling=SAMPLING)
    assert pre.num_published_blocks == 80 // BS  # queued: the request did not wait for it
    engine.wait_published()
    assert failed._value.get() - before == 80 // BS
    assert engine.publisher is not None and engine.publisher.backlog_blocks == 0
    again = engine.prefill(prompt, sampling=SAMPLING)
    assert again.cached_tokens == 0 and again.first_token == pre.first_token


class EarlyLiar(LocalStore):
    """Hands every block over early, block ``bad`` with wrong bytes, and only the verdicts
    say it was corrupted: what a same-node GPU read does when verification rejects a block
    the model already computed on."""

    def __init__(self, bad: int) -> None:
        super().__init__()
        self.bad = bad
        self.early_calls = 0

    def batch_get_early(self, namespace, keys, token_ids, *, device):
        self.early_calls += 1
        got = self.batch_get(namespace, keys, token_ids, device=device)
        store = self

        class Handle:
            def leading(self, by_layer=False):
                payloads = [g.payload.clone() for g in got]
                payloads[store.bad].fill_(7.0)
                return payloads, False

            def result(self):
                return [Miss(k, "corrupted") if i == store.bad else g
                        for i, (k, g) in enumerate(zip(keys, got, strict=True))]

        return Handle()


@pytest.mark.parametrize("bad", [0, 2, 5])
def test_a_block_rejected_after_the_model_used_it_is_recomputed(model, bad):
    """The prefill computes on blocks offered early; when the verdicts reject one it used,
    that work is thrown away and the prompt recomputed from the last good block: the first
    token's logits equal the uncached run's, bitwise."""
    store = EarlyLiar(bad)
    prompt = make_prompt(110, seed=4)
    writer = Engine(model, store, make_config())
    writer.prefill(prompt)
    writer.wait_published()
    engine = Engine(model, store, make_config())
    pre = engine.prefill(prompt, sampling=SAMPLING, return_logits=True)
    assert store.early_calls == 1
    assert pre.cached_tokens == bad * BS and "corrupted" in pre.misses
    ref_logits, _, _ = reference(model, prompt)
    assert torch.equal(pre.logits, ref_logits)
