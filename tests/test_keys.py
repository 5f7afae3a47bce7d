"""Namespaces and chained block keys (docs/design.md §3.1): deterministic, chained, namespaced."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import msgpack
import numpy as np
import pytest
import torch

from kvstore.errors import ConfigError
from kvstore.keys import BlockHasher, Namespace, dtype_name, tokens_to_bytes

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
