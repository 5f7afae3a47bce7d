"""Namespaces and chained block keys (docs/design.md §3.1): deterministic, chained, namespaced."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import pickle
import subprocess
import sys
import textwrap

import msgpack
import numpy as np
import pytest
import torch

from kvstore.errors import ConfigError
from kvstore.keys import BlockHasher, Namespace, dtype_name, tokens_to_bytes
from kvstore.security.data_keys import mac_key, parse_data_key, root_key, tenant_key, tenant_of

# Pinned literals. Changing the namespace encoding or the key chain changes these, and every
# published block would silently stop matching: such a change requires bumping
# kvstore.keys.SCHEMA_VERSION (and then updating these literals on purpose).
PINNED_ROOT = "9496777b5ce6e64b85a5fdd23167ebd570ed45e6a96d25807ada01a97dea2101"
PINNED_KEYS = [
    "e72d1979b3137cb77a266f46160fa2ff4aa5eb27c399dc0922401d920fff93b1",
    "9d32304e64c1dc215e6644be5f0107c5873efc08ae654f27a33e53e74d75916a",
]


def make_namespace(**over: object) -> Namespace:
    fields: dict[str, object] = dict(model_fingerprint="test-model-fp", dtype="float16",
                                     block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)
    fields.update(over)
    return Namespace(**fields)  # type: ignore[arg-type]


def ref_keys(root: bytes, tokens: list[int], block_size: int) -> list[bytes]:
    """The design's formula, spelled out: key[i] = sha256(key[i-1] || tokens as int64 LE)."""
    keys, parent = [], root
    for i in range(len(tokens) // block_size):
        chunk = b"".join(t.to_bytes(8, "little", signed=True)
                         for t in tokens[i * block_size:(i + 1) * block_size])
        parent = hashlib.sha256(parent + chunk).digest()
        keys.append(parent)
    return keys


def test_pinned_root_and_block_keys():
    ns = make_namespace()
    assert ns.root.hex() == PINNED_ROOT
    keys = BlockHasher(ns).block_keys(list(range(10)))
    assert [k.hex() for k in keys] == PINNED_KEYS


def test_root_is_sha256_of_the_msgpack_field_list():
    ns = make_namespace(cache_salt="tenant-a")
    encoding = msgpack.packb([1, "test-model-fp", "float16", 4, 2, 2, 8, "tenant-a"])
    assert ns.encode() == encoding
    assert ns.root == hashlib.sha256(encoding).digest()


@pytest.mark.parametrize("tokens", [list(range(10)), [0, -1, 2**40, 7] * 5, []])
def test_keys_follow_the_reference_chain(tokens):
    ns = make_namespace()
    got = BlockHasher(ns).block_keys(tokens)
    assert got == ref_keys(ns.root, tokens, 4)
    assert all(len(k) == 32 for k in got)


def test_same_keys_in_another_process_with_another_hash_seed():
    ns = make_namespace(cache_salt="s")
    tokens = [int(x) for x in np.random.default_rng(0).integers(0, 50_000, 37)]
    script = textwrap.dedent(f"""
        import json
        from kvstore.keys import BlockHasher, Namespace
        ns = Namespace(**{ns.to_dict()!r})
        keys = BlockHasher(ns).block_keys({tokens!r})
        print(json.dumps([ns.root.hex(), [k.hex() for k in keys]]))
    """)
    here = [ns.root.hex(), [k.hex() for k in BlockHasher(ns).block_keys(tokens)]]
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", script], env=env, check=True,
                             capture_output=True, text=True, timeout=120).stdout
        assert json.loads(out.strip().splitlines()[-1]) == here


def test_token_containers_give_the_same_keys():
    ns = make_namespace()
    tokens = list(range(100, 113))
    hasher = BlockHasher(ns)
    want = hasher.block_keys(tokens)
    assert hasher.block_keys(np.array(tokens, dtype=np.int32)) == want
    assert hasher.block_keys(torch.tensor(tokens)) == want
    assert hasher.block_keys(torch.tensor(tokens, dtype=torch.int32)) == want
    assert tokens_to_bytes(tokens) == np.array(tokens, dtype="<i8").tobytes()


def test_only_full_blocks_get_keys():
    hasher = BlockHasher(make_namespace())
    assert hasher.block_keys([1, 2, 3]) == []
    assert len(hasher.block_keys(list(range(8)))) == 2
    assert len(hasher.block_keys(list(range(11)))) == 2
    # the partial tail does not change the full blocks' keys
    assert hasher.block_keys(list(range(11))) == hasher.block_keys(list(range(8)))


def test_chain_continues_from_a_parent():
    hasher = BlockHasher(make_namespace())
    tokens = list(range(16))
    whole = hasher.block_keys(tokens)
    tail = hasher.block_keys(tokens[8:], parent=whole[1])
    assert whole[2:] == tail


def test_keys_depend_on_the_whole_prefix():
    hasher = BlockHasher(make_namespace())
    a = hasher.block_keys([1, 2, 3, 4, 5, 6, 7, 8])
    b = hasher.block_keys([9, 2, 3, 4, 5, 6, 7, 8])
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different prefix


@pytest.mark.parametrize("chunks", [[1] * 13, [3, 10], [13], [0, 4, 0, 9], [5, 5, 3]])
def test_incremental_sequence_equals_one_shot(chunks):
    ns = make_namespace()
    tokens = list(range(1000, 1013))
    seq = BlockHasher(ns).sequence()
    completed = []
    pos = 0
    for n in chunks:
        completed += seq.extend(tokens[pos:pos + n])
        pos += n
    assert seq.num_tokens == 13
    assert completed == seq.keys == BlockHasher(ns).block_keys(tokens)


@pytest.mark.parametrize(
    "over",
    [{"cache_salt": "tenant-b"}, {"model_fingerprint": "other-model"}, {"dtype": "bfloat16"},
     {"block_size": 8}, {"num_layers": 3}, {"num_kv_heads": 4}, {"head_dim": 16},
     {"schema_version": 2}],
)
def test_every_namespace_field_changes_the_root(over):
    base = make_namespace()
    other = make_namespace(**over)
    assert other.root != base.root
    tokens = list(range(8))
    assert set(BlockHasher(base).block_keys(tokens)).isdisjoint(
        BlockHasher(other).block_keys(tokens))


def test_namespace_round_trips_through_a_dict():
    ns = make_namespace(cache_salt="x")
    assert Namespace.from_dict(ns.to_dict()) == ns
    assert Namespace.from_dict(ns.to_dict()).root == ns.root


@pytest.mark.parametrize(
    ("over", "name"),
    [({"dtype": "float64"}, "dtype"), ({"block_size": 0}, "block_size"),
     ({"num_layers": -1}, "num_layers"), ({"num_kv_heads": 1.5}, "num_kv_heads"),
     ({"head_dim": 0}, "head_dim"), ({"model_fingerprint": ""}, "model_fingerprint")],
)
def test_namespace_validation_names_the_field(over, name):
    with pytest.raises(ConfigError, match=name):
        make_namespace(**over)


def test_dtype_names():
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert make_namespace(dtype="int8").torch_dtype == torch.int8
    with pytest.raises(ConfigError, match="float64"):
        dtype_name(torch.float64)


@pytest.mark.parametrize("bad", [[[1, 2], [3, 4]], [1.5, 2.0]])
def test_bad_token_ids_are_rejected(bad):
    with pytest.raises(ValueError, match="token_ids"):
        BlockHasher(make_namespace()).block_keys(np.array(bad))


# -- keyed namespaces (docs/design.md §3.1, kvstore.security.data_keys) ------------------------

DATA_KEY = bytes.fromhex("00112233445566778899aabbccddeeff")
#: The root of make_namespace(cache_salt="tenant-a") under DATA_KEY (pinned like PINNED_ROOT).
PINNED_KEYED_ROOT = "97eb8547408949d5f4abc253325bb06d2ab39a06faaf1c7f63d812a0f4674a71"


def ref_keyed_root(data_key: bytes, salt: str, encoding: bytes) -> bytes:
    """The derivation spelled out with the standard library: tenant key, root key, root."""
    tenant = hmac.new(data_key, b"kvstore tenant key v1\x00" + salt.encode(),
                      hashlib.sha256).digest()
    root_key = hmac.new(tenant, b"kvstore namespace root v1", hashlib.sha256).digest()
    return hmac.new(root_key, encoding, hashlib.sha256).digest()


def test_keyed_root_is_the_hmac_chain_and_pinned():
    ns = make_namespace(cache_salt="tenant-a", data_key=DATA_KEY)
    assert ns.root == ref_keyed_root(DATA_KEY, "tenant-a", ns.encode())
    assert ns.root.hex() == PINNED_KEYED_ROOT
    # The encoding is the public one: the key changes the root, never the encoded fields.
    assert ns.encode() == make_namespace(cache_salt="tenant-a").encode()
    keys = BlockHasher(ns).block_keys(list(range(10)))
    assert keys == ref_keys(ns.root, list(range(10)), 4)


def test_keyed_roots_differ_from_public_and_other_tenants_roots():
    public = make_namespace(cache_salt="tenant-a")
    a = make_namespace(cache_salt="tenant-a", data_key=DATA_KEY)
    b = make_namespace(cache_salt="tenant-b", data_key=DATA_KEY)
    other_cluster = make_namespace(cache_salt="tenant-a", data_key=DATA_KEY[::-1])
    roots = {public.root, a.root, b.root, other_cluster.root,
             make_namespace(data_key=DATA_KEY).root, make_namespace().root}
    assert len(roots) == 6
    tokens = list(range(8))
    assert set(BlockHasher(a).block_keys(tokens)).isdisjoint(BlockHasher(public).block_keys(tokens))
    assert a != public and a != b and a != other_cluster


def test_tenant_keys_are_independent_and_build_the_same_namespace():
    ka, kb = tenant_key(DATA_KEY, "tenant-a"), tenant_key(DATA_KEY, "tenant-b")
    assert len(ka) == len(kb) == 32 and ka != kb and DATA_KEY not in (ka, kb)
    assert ka == hmac.new(DATA_KEY, b"kvstore tenant key v1\x00tenant-a", hashlib.sha256).digest()
    by_data = make_namespace(cache_salt="tenant-a", data_key=DATA_KEY)
    by_tenant = make_namespace(cache_salt="tenant-a", tenant_key=ka)
    assert by_tenant == by_data and hash(by_tenant) == hash(by_data)
    assert by_tenant.root == by_data.root and by_tenant.mac_key == by_data.mac_key
    # Tenant B's key in tenant A's namespace is another namespace: other root, other MAC key.
    wrong = make_namespace(cache_salt="tenant-a", tenant_key=kb)
    assert wrong != by_data and wrong.root != by_data.root and wrong.mac_key != by_data.mac_key
    assert mac_key(ka) == by_data.mac_key != root_key(ka)


def test_keys_are_never_encoded_shown_or_sent():
    ns = make_namespace(cache_salt="tenant-a", data_key=DATA_KEY)
    secrets = [DATA_KEY, tenant_key(DATA_KEY, "tenant-a"), ns.mac_key]
    for text in (repr(ns), str(ns), repr(ns.to_dict())):
        assert not any(s.hex() in text or repr(s) in text for s in secrets), text
    assert not any(s in ns.encode() for s in secrets)
    assert "data_key" not in ns.to_dict() and "tenant_key" not in ns.to_dict()
    assert ns.public() == make_namespace(cache_salt="tenant-a") and not ns.public().keyed
    assert ns.keyed and ns.tag_nbytes == 16 and make_namespace().tag_nbytes == 8


def test_keyed_namespace_survives_pickle_as_ray_sends_it():
    ns = make_namespace(cache_salt="t", tenant_key=tenant_key(DATA_KEY, "t"))
    back = pickle.loads(pickle.dumps(ns))
    assert back == ns and back.root == ns.root and back.mac_key == ns.mac_key


def test_same_keyed_root_in_another_process():
    ns = make_namespace(cache_salt="s", data_key=DATA_KEY)
    script = textwrap.dedent(f"""
        from kvstore.keys import Namespace
        from kvstore.security.data_keys import tenant_key
        fields = {ns.to_dict()!r}
        a = Namespace(**fields, data_key={DATA_KEY!r})
        b = Namespace(**fields, tenant_key=tenant_key({DATA_KEY!r}, "s"))
        print(a.root.hex(), b.root.hex())
    """)
    env = {**os.environ, "PYTHONHASHSEED": "777"}
    out = subprocess.run([sys.executable, "-c", script], env=env, check=True,
                         capture_output=True, text=True, timeout=120).stdout
    assert out.split() == [ns.root.hex(), ns.root.hex()]


@pytest.mark.parametrize(
    ("over", "match"),
    [({"data_key": DATA_KEY, "tenant_key": bytes(32)}, "not both"),
     ({"data_key": b"short"}, "at least 16"), ({"data_key": DATA_KEY.hex()}, "bytes"),
     ({"tenant_key": bytes(16)}, "32 bytes"), ({"tenant_key": "00" * 32}, "32 bytes")],
)
def test_bad_keys_are_config_errors(over, match):
    with pytest.raises(ConfigError, match=match):
        make_namespace(**over)


def test_data_key_hex_parsing():
    assert parse_data_key(None) is None
    assert parse_data_key(DATA_KEY.hex()) == DATA_KEY
    for bad in ("zz" * 16, "00" * 15, ""):
        with pytest.raises(ConfigError, match="security.data_key"):
            parse_data_key(bad)


def test_a_salt_with_a_suffix_is_its_tenants_namespace():
    """The engine's approximate-reuse namespace (salt + NUL + suffix) belongs to the same
    tenant: one tenant key builds it, and its root is still its own."""
    assert tenant_of("tenant-a\x00reuse=block") == "tenant-a" == tenant_of("tenant-a")
    assert tenant_key(DATA_KEY, "tenant-a\x00reuse=block") == tenant_key(DATA_KEY, "tenant-a")
    salt = "tenant-a\x00reuse=block"
    by_data = make_namespace(cache_salt=salt, data_key=DATA_KEY)
    by_tenant = make_namespace(cache_salt=salt, tenant_key=tenant_key(DATA_KEY, "tenant-a"))
    assert by_data == by_tenant
    assert by_data.root != make_namespace(cache_salt="tenant-a", data_key=DATA_KEY).root
    assert by_data.root == ref_keyed_root(DATA_KEY, "tenant-a", by_data.encode())
