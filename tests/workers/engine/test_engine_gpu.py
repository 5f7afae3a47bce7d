"""The exactness suite on a CUDA device (skips without one; CI has none).

The same engine code as the CPU tests, with the model, its caches, the fetched blocks and the
operators on the GPU (bfloat16 and sdpa by default there, eager too): a cached run is bitwise
the ``--no-cache`` run for full and partial hits, a corrupted block and a dead holder are
recomputed, and the blocks are on the device when they enter the model.
"""

from __future__ import annotations

import pytest
import torch

from kvstore.client.local_store import LocalStore
from kvstore.workers.engine.prefill_decode import Engine
from kvstore.workers.model.causal_lm import load_model
from tests.workers.engine.test_engine import (
    HolderGone,
    assert_same,
    disaggregated,
    make_config,
    make_prompt,
)

pytestmark = pytest.mark.gpu
BS = 16


@pytest.fixture(scope="module", params=["sdpa", "eager"])
def model(request):
    return load_model("tiny", seed=0, device="cuda", attn_implementation=request.param)


def test_the_model_and_its_namespace_are_the_gpus(model) -> None:
    assert model.device.type == "cuda" and model.dtype == "bfloat16"
    assert model.numerics.startswith("cuda sm_") and model.attn_implementation in model.numerics
    engine = Engine(model, LocalStore(), make_config())
    assert engine.namespace.numerics == model.numerics and engine.namespace.dtype == "bfloat16"


@pytest.mark.parametrize("n", [20, 64, 100, 130])
def test_cold_then_warm_equals_uncached(model, n) -> None:
    store = LocalStore()
    writer, reader = Engine(model, store, make_config()), Engine(model, store, make_config())
    pre, dec = disaggregated(writer, reader, make_prompt(n))
    assert_same(model, make_prompt(n), pre, dec)
    pre2, dec2 = disaggregated(writer, reader, make_prompt(n))
    assert pre2.cached_tokens == (n - 1) // BS * BS
    assert dec2.fetched_tokens == n // BS * BS and dec2.recomputed_tokens == 0
    assert_same(model, make_prompt(n), pre2, dec2)


@pytest.mark.parametrize("shared", [16, 40, 75])
def test_partial_hit_equals_uncached(model, shared) -> None:
    store = LocalStore()
    engine = Engine(model, store, make_config())
    engine.prefill(make_prompt(100, seed=1))
    engine.wait_published()
    prompt = make_prompt(100, seed=1)[:shared] + make_prompt(50, seed=2)
    pre, dec = disaggregated(engine, Engine(model, store, make_config()), prompt, tail=False)
    assert pre.cached_tokens <= shared // BS * BS
    assert_same(model, prompt, pre, dec)


@pytest.mark.parametrize("fault", ["corrupted", "holder_gone"])
def test_a_bad_block_is_recomputed_on_the_gpu(model, fault: str) -> None:
    """A block that fails verification, or whose holder dies mid-fetch, moves the resume point
    back: the tokens are still the no-cache ones."""
    store = LocalStore()
    writer = Engine(model, store, make_config())
    prompt = make_prompt(110, seed=3)
    first = writer.prefill(prompt)
    writer.wait_published()
    if fault == "corrupted":
        store.corrupt(first.block_keys[3])
    reader = Engine(model, store if fault == "corrupted" else HolderGone(store, 3),
                    make_config())
    pre, dec = disaggregated(reader, reader, prompt, tail=False)
    assert pre.cached_tokens <= 3 * BS
    assert ("corrupted" if fault == "corrupted" else "node_unavailable") in pre.misses
    assert_same(model, prompt, pre, dec)


def test_fetched_blocks_arrive_on_the_device(model) -> None:
    store = LocalStore()
    writer = Engine(model, store, make_config())
    prompt = make_prompt(64, seed=5)
    writer.prefill(prompt)
    writer.wait_published()
    reader = Engine(model, store, make_config())
    keys = reader.hasher.block_keys(prompt)
    fetch = reader.io.fetch(reader.namespace, prompt, keys, len(keys))
    assert fetch.payloads and all(p.device.type == "cuda" for p in fetch.payloads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_the_weights_checksum_is_the_same_on_the_gpu_and_the_cpu(dtype) -> None:
    """Exact float64 row sums: one fingerprint for the same weights on any device."""
    from kvstore.workers.model.fingerprint import tensor_checksum

    t = (torch.randn(3, 70001, generator=torch.Generator().manual_seed(2)) * 40).to(dtype)
    assert tensor_checksum(t.to("cuda")) == tensor_checksum(t)


def test_a_preset_builds_on_the_gpu_with_the_cpu_builds_shape() -> None:
    gpu = load_model("tiny", device="cuda", dtype="float32", attn_implementation="eager")
    cpu = load_model("tiny", device="cpu", dtype="float32", attn_implementation="eager")
    assert gpu.device.type == "cuda" and gpu.shape == cpu.shape
    assert gpu.numerics != cpu.numerics  # another device kind: another namespace
