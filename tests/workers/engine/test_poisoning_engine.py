"""The planting attack, end to end through the real engine (tiny preset).

An attacker who can Put computes the keys of a public system prompt under the default (empty)
salt, as anyone can in an unkeyed namespace, and publishes fake KV under them first. A
victim whose engine has no data key (the control) gets a verified hit with that KV and its
output changes: the attack is real here. With the cluster's data key the victim's keys are
keyed, so it misses the planted blocks; and when the attacker somehow has the victim's exact
keys and tokens but not the tenant key and writes forged bytes straight into the store,
bypassing any node check, the MAC rejects them. Either way the victim's output equals the
same engine's run with the cache bypassed (the ``--no-cache`` path, ``use_cache=False``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import xxhash

from kvstore.api import BlockPut, FetchedBlock
from kvstore.block import BlockHeader, read_header
from kvstore.client.local_store import LocalStore
from kvstore.config import WorkerConfig
from kvstore.constants import align_up
from kvstore.errors import PermissionDenied
from kvstore.keys import BlockHasher, Namespace
from kvstore.security.data_keys import block_tag, tenant_key
from kvstore.workers.engine.prefill_decode import Engine
from kvstore.workers.model.causal_lm import load_model
from kvstore.workers.model.sampling import SamplingParams

BS, CHUNK = 16, 32
SAMPLING = SamplingParams(max_new_tokens=16)
DATA_KEY = b"engine-poisoning-tests-data-key!"
SYSTEM = 64  # tokens of the public system prompt: 4 blocks


@pytest.fixture(scope="module")
def model():
    return load_model("tiny", seed=0)


def config() -> WorkerConfig:
    return WorkerConfig(model="tiny", block_size=BS, prefill_chunk_tokens=CHUNK)


def prompt(seed: int) -> list[int]:
    """The public system prompt followed by a user's own suffix."""
    g = torch.Generator().manual_seed(1234)
    system = torch.randint(0, 512, (SYSTEM,), generator=g).tolist()
    suffix = torch.randint(0, 512, (21,), generator=torch.Generator().manual_seed(seed)).tolist()
    return system + suffix


def no_cache(model, tokens: list[int]) -> list[int]:
    """The reference: the same engine with the cache bypassed."""
    _, dec = Engine(model, LocalStore(), config()).generate(tokens, sampling=SAMPLING,
                                                            use_cache=False)
    return dec.output_token_ids


def fake_kv(ns: Namespace, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + i)
    return (torch.randn(ns.payload_shape, generator=g) * 4).to(ns.torch_dtype)


def plant_public(model, store: LocalStore, tokens: list[int]) -> list[bytes]:
    """The attacker's Put: the old, public namespace of the default tenant, fake KV."""
    public = Engine(model, None, config()).namespace  # no data key: what anyone can compute
    assert not public.keyed and public.cache_salt == ""
    keys = BlockHasher(public).block_keys(tokens[:SYSTEM])
    store.batch_put(public, [BlockPut(k, keys[i - 1] if i else public.root,
                                      tokens[i * BS:(i + 1) * BS], fake_kv(public, i))
                             for i, k in enumerate(keys)])
    return keys


def test_control_without_a_data_key_the_planted_kv_is_used(model):
    """The attack works on a victim without keys: a hit, and outputs that differ."""
    store = LocalStore()
    tokens = prompt(seed=1)
    plant_public(model, store, tokens)
    pre, dec = Engine(model, store, config()).generate(tokens, sampling=SAMPLING)
    assert pre.cached_tokens == SYSTEM and not pre.misses  # "verified" hit with fake KV
    assert dec.output_token_ids != no_cache(model, tokens)


@pytest.mark.parametrize("salt", ["", "tenant-a"])
def test_keyed_victim_misses_planted_public_blocks(model, salt):
    store = LocalStore()
    tokens = prompt(seed=2)
    planted = plant_public(model, store, tokens)
    victim = Engine(model, store, config(), data_key=DATA_KEY)
    assert victim.namespace.keyed
    pre, dec = victim.generate(tokens, sampling=SAMPLING, cache_salt=salt)
    assert pre.cached_tokens == 0 and not set(pre.block_keys) & set(planted)
    assert dec.output_token_ids == no_cache(model, tokens)
    # The victim published its own blocks beside the planted ones; a second victim (another
    # replica with the same data key) reuses them, and still matches the reference.
    again_pre, again = Engine(model, store, config(), data_key=DATA_KEY).generate(
        prompt(seed=3), sampling=SAMPLING, cache_salt=salt)
    assert again_pre.cached_tokens >= SYSTEM - BS
    assert again.output_token_ids == no_cache(model, prompt(seed=3))


def forged_block(ns: Namespace, key: bytes, parent: bytes, tokens: list[int],
                 payload: torch.Tensor, tag: bytes) -> bytearray:
    """Bytes in the block format with the victim's root, key and tokens and any tag."""
    header = BlockHeader(ns.schema_version, ns.root, key, parent,
                         np.asarray(tokens, dtype="<i8").tobytes(), ns.dtype, ns.num_layers,
                         ns.block_size, ns.num_kv_heads, ns.head_dim, tag).pack()
    off = align_up(4 + len(header))
    out = bytearray(off) + bytearray(payload.contiguous().view(torch.uint8).numpy().tobytes())
    out[:4] = len(header).to_bytes(4, "little")
    out[4:4 + len(header)] = header
    return out


@pytest.mark.parametrize("forgery", ["xxh3", "tenant-b-mac", "zero-tag", "moved-tag"])
def test_forged_blocks_under_the_victims_exact_keys_are_rejected(model, forgery):
    """The attacker knows the victim's keys and tokens (not its tenant key) and writes forged
    blocks straight into the store (no node in the way): every one is a miss, recomputed."""
    store = LocalStore()
    tokens = prompt(seed=4)
    ns = Engine(model, None, config(), data_key=DATA_KEY).namespace
    keys = BlockHasher(ns).block_keys(tokens[:SYSTEM])
    b_mac = Namespace(**ns.to_dict(), tenant_key=tenant_key(DATA_KEY, "tenant-b")).mac_key
    assert b_mac is not None
    honest_tag = None
    if forgery == "moved-tag":  # a real tag of this tenant, from another (honest) block
        other = list(reversed(prompt(seed=5)))  # shares no block with the victim's prompt
        Engine(model, store, config(), data_key=DATA_KEY).generate(
            other, sampling=SamplingParams(max_new_tokens=0))
        honest_tag = read_header(next(iter(store.blocks.values()))).checksum
        assert len(honest_tag) == 16
    for i, k in enumerate(keys):
        fake = fake_kv(ns, i)
        raw = fake.contiguous().view(torch.uint8).numpy().tobytes()
        tag = {"xxh3": xxhash.xxh3_64_digest(raw),
               "tenant-b-mac": block_tag(b_mac, ns.root, k, raw),
               "zero-tag": bytes(16),
               "moved-tag": honest_tag}[forgery]
        assert tag is not None
        store.blocks[k] = forged_block(ns, k, keys[i - 1] if i else ns.root,
                                       tokens[i * BS:(i + 1) * BS], fake, tag)
    victim = Engine(model, store, config(), data_key=DATA_KEY)
    pre, dec = victim.generate(tokens, sampling=SAMPLING)
    assert pre.cached_tokens == 0 and any("corrupted" in m for m in pre.misses), pre.misses
    assert dec.output_token_ids == no_cache(model, tokens)
    # Disaggregated: a decode replica fetching the same prefix rejects them too.
    pre2 = victim.prefill(tokens, sampling=SAMPLING)
    dec2 = Engine(model, store, config(), data_key=DATA_KEY).decode(
        tokens, pre2.first_token, tail=pre2.tail, sampling=SAMPLING)
    assert pre2.cached_tokens == 0
    assert dec2.output_token_ids == no_cache(model, tokens)


@pytest.mark.parametrize("reuse", ["exact", "block"])
def test_a_tenant_key_client_and_the_cluster_share_blocks(model, reuse):
    """A tenant's own client holds only its tenant key; the cluster's workers hold the data
    key: same namespaces (the approximate-reuse one too), so each reuses the other's blocks,
    and outputs match no-cache. Another tenant's salt is refused, never served unkeyed."""
    store = LocalStore()
    cfg = dataclasses.replace(config(), cache_salt="tenant-a", reuse=reuse)
    cluster = Engine(model, store, cfg, data_key=DATA_KEY)
    client = Engine(model, store, cfg, tenant_key=tenant_key(DATA_KEY, "tenant-a"))
    assert client.namespace == cluster.namespace and client.namespace.keyed
    assert (client.namespace.cache_salt == "tenant-a") == (reuse == "exact")
    cluster.generate(prompt(seed=6), sampling=SamplingParams(max_new_tokens=0))
    tokens = prompt(seed=7)
    keys = BlockHasher(client.namespace).block_keys(tokens[:SYSTEM])
    got = store.batch_get(client.namespace, keys,
                          [tokens[i * BS:(i + 1) * BS] for i in range(4)])
    assert all(isinstance(g, FetchedBlock) for g in got)
    pre, dec = client.generate(tokens, sampling=SAMPLING)
    assert pre.cached_tokens > 0 and not pre.misses
    ref = Engine(model, None, cfg).generate(tokens, sampling=SAMPLING, use_cache=False)[1]
    assert dec.output_token_ids == ref.output_token_ids
    with pytest.raises(PermissionDenied, match="tenant-a"):
        client.generate(tokens, sampling=SAMPLING, cache_salt="tenant-b")
