"""The namespace of a vLLM instance: same checkpoint and geometry share, anything else not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvstore.errors import ConfigError
from kvstore.integrations.vllm.namespace import (
    ModelGeometry,
    checkpoint_fingerprint,
    namespace,
    numerics,
)
from kvstore.keys import BlockHasher
from tests.support.checkpoint import build_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("ck")
    a = build_checkpoint(root / "a", seed=0, with_tokenizer=False)
    b = build_checkpoint(root / "b", seed=1, with_tokenizer=False)
    copy = root / "a-copy"
    copy.mkdir()
    for f in a.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    return a, b, copy


def test_the_fingerprint_follows_the_weights_not_the_path(checkpoints) -> None:
    a, b, copy = checkpoints
    assert checkpoint_fingerprint(a) == checkpoint_fingerprint(copy)
    assert checkpoint_fingerprint(a) != checkpoint_fingerprint(b)


def test_one_changed_config_field_changes_the_fingerprint(checkpoints, tmp_path) -> None:
    a, _, _ = checkpoints
    edited = tmp_path / "edited"
    edited.mkdir()
    for f in a.iterdir():
        (edited / f.name).write_bytes(f.read_bytes())
    config = json.loads((edited / "config.json").read_text())
    config["rms_norm_eps"] = config.get("rms_norm_eps", 1e-6) * 2
    (edited / "config.json").write_text(json.dumps(config))
    assert checkpoint_fingerprint(edited) != checkpoint_fingerprint(a)


def test_no_local_weights_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="not a local checkpoint directory"):
        checkpoint_fingerprint("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ConfigError, match="not a local checkpoint directory"):
        checkpoint_fingerprint(tmp_path)


def test_salts_and_numerics_separate_keys() -> None:
    geometry = ModelGeometry("ck", "float32", 32, 2, 2, 32)
    tag = numerics(torch.device("cpu"), "0.32.0", "CPU_ATTN")
    assert "vllm 0.32.0 CPU_ATTN" in tag
    tokens = list(range(64))

    def keys(salt: str | None, numerics_tag: str = tag) -> list[bytes]:
        return BlockHasher(namespace(geometry, "f" * 64, numerics_tag, salt)).block_keys(tokens)

    assert keys(None) == keys("")
    assert keys("tenant-a") != keys("tenant-b") != keys(None)
    assert keys(None) != keys(None, tag.replace("0.32.0", "0.33.0"))


def test_the_fingerprint_is_remembered_until_a_file_changes(checkpoints, tmp_path) -> None:
    """vLLM's scheduler and workers each build a connector: the second reads no weights."""
    a, _, _ = checkpoints
    own = tmp_path / "own"
    own.mkdir()
    for f in a.iterdir():
        (own / f.name).write_bytes(f.read_bytes())
    cache = tmp_path / "fingerprints"
    first = checkpoint_fingerprint(own, cache)
    [remembered] = list(cache.iterdir())
    remembered.write_text("0" * 64)  # what a second process would now be told
    assert checkpoint_fingerprint(own, cache) == "0" * 64
    weights = next(own.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes())  # same bytes, but rewritten: read again
    assert checkpoint_fingerprint(own, cache) == first


def test_tensor_parallel_ranks_hold_kv_head_slices_of_their_own() -> None:
    """Two KV heads on two ranks: a slice each, each saved by its rank; on four ranks each
    head is held by two, and the first of them saves it."""
    two = ModelGeometry("ck", "float32", 32, 2, 1, 32, tensor_parallel_size=2, total_kv_heads=2)
    assert two.num_shards == 2 and [two.shard_of_rank(r) for r in range(2)] == [0, 1]
    assert [two.saves_on_rank(r) for r in range(2)] == [True, True]
    assert [two.shard_label(s) for s in range(2)] == ["tp 2: kv heads 0-0 of 2",
                                                       "tp 2: kv heads 1-1 of 2"]
    four = ModelGeometry("ck", "float32", 32, 2, 1, 32, tensor_parallel_size=4, total_kv_heads=2)
    assert four.num_shards == 2 and [four.shard_of_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [four.saves_on_rank(r) for r in range(4)] == [True, False, True, False]
    wide = ModelGeometry("ck", "float32", 32, 2, 4, 32, tensor_parallel_size=2, total_kv_heads=8)
    assert wide.shard_label(1) == "tp 2: kv heads 4-7 of 8"
    with pytest.raises(ConfigError, match="rank 2 is not one of 2"):
        two.shard_of_rank(2)
    with pytest.raises(ConfigError, match="shard 2 is not one of 2"):
        two.shard_label(2)


def test_each_slice_and_each_parallel_size_has_its_own_keys() -> None:
    """A rank loads only what a rank holding the same heads under the same parallel size
    saved; one rank alone keeps the namespace it always had."""
    tag = numerics(torch.device("cpu"), "0.32.0", "CPU_ATTN")
    tokens = list(range(64))

    def keys(geometry: ModelGeometry, shard: int = 0) -> list[bytes]:
        return BlockHasher(namespace(geometry, "f" * 64, tag, None, shard=shard)
                           ).block_keys(tokens)

    one = ModelGeometry("ck", "float32", 32, 2, 1, 32)
    two = ModelGeometry("ck", "float32", 32, 2, 1, 32, tensor_parallel_size=2, total_kv_heads=2)
    four = ModelGeometry("ck", "float32", 32, 2, 1, 32, tensor_parallel_size=4, total_kv_heads=2)
    assert keys(two, 0) != keys(two, 1)
    assert keys(one) != keys(two, 0) and keys(four, 0) != keys(two, 0)
    assert namespace(one, "f" * 64, tag, None).numerics == tag  # unchanged without slices
