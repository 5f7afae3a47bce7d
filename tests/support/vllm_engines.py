"""Real vLLM engines for the connector's tests: a private kvstore cluster, and one fresh vLLM
instance per call, each in a process of its own (``benchmarks.vllm_instance``).

An engine takes far longer to load than a test takes to run, so a test module starts its
engines once (module-scoped fixtures) and runs everything it needs as phases of them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: The engine tests' model: two KV heads of 32 (the smallest head size vLLM's CPU attention
#: supports, and a multiple of 32, as its fp8 cache needs).
KV_HEADS, HEAD_DIM = 2, 32


def engine_checkpoint(tmp_path_factory: Any, sliding_window: int | None = None) -> str:
    """A small real-format checkpoint of the engine tests' shape, in a fresh directory.
    ``sliding_window``: every other layer attends to that many tokens only (``layer_types``,
    which vLLM's Llama honours: a hybrid model, as Gemma's and gpt-oss's are)."""
    from tests.support.checkpoint import build_checkpoint

    shape: dict[str, Any] = dict(hidden_size=4 * HEAD_DIM, num_attention_heads=4,
                                 num_key_value_heads=KV_HEADS, intermediate_size=256)
    if sliding_window is not None:
        shape.update(sliding_window=sliding_window,
                     layer_types=["sliding_attention", "full_attention"])  # 2 layers
    return str(build_checkpoint(tmp_path_factory.mktemp("ck") / "m", config_overrides=shape))


@contextmanager
def kvstore_cluster(state: Path, omp_bind: str = "0") -> Iterator[dict[str, str]]:
    """A kvstore cluster of its own (a private Ray head, ``kvstore start``) for the
    duration; yields the environment its engines run in: vLLM's forwards bound to the cores
    ``omp_bind`` names (``VLLM_CPU_OMP_THREADS_BIND``, a list per rank), 1 GiB of KV each."""
    env = {**os.environ, "KVSTORE_STATE_DIR": str(state), "RAY_AUTH_MODE": "disabled",
           "VLLM_CPU_OMP_THREADS_BIND": omp_bind, "VLLM_CPU_KVCACHE_SPACE": "1",
           "PYTHONPATH": str(ROOT)}
    kvstore = [sys.executable, "-m", "kvstore.cli"]
    subprocess.run([*kvstore, "start", "--capacity", "256MiB"], env=env, check=True,
                   capture_output=True, timeout=180)
    try:
        yield env
    finally:
        subprocess.run([*kvstore, "stop"], env=env, capture_output=True, timeout=120)


def run_engine(env: dict[str, str], checkpoint: str, prompts: list[list[int]],
               salts: list[str | None], role: str | None = "kv_both", *, block_size: int,
               logs: list[str] | None = None, metrics: dict[str, float] | None = None,
               **extra: object) -> list[dict]:
    """One fresh instance's results per prompt (8 tokens each, greedy); its stderr is
    appended to ``logs``; with ``metrics``, vLLM's statistics are on and kvstore's counters on
    them land there. ``extra``: more of ``benchmarks.vllm_instance``'s job (``phases``,
    ``tensor_parallel_size``, ...)."""
    job = {"model": checkpoint, "block_size": block_size, "max_tokens": 8, "prompts": prompts,
           "salts": salts, "role": role, "metrics": metrics is not None, **extra}
    done = subprocess.run([sys.executable, "-m", "benchmarks.vllm_instance", json.dumps(job)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULTS ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    if logs is not None:
        logs.append(done.stderr)
    if metrics is not None:
        [line] = [line for line in done.stdout.splitlines() if line.startswith("METRICS ")]
        metrics.update(json.loads(line.removeprefix("METRICS ")))
    return json.loads(lines[-1].removeprefix("RESULTS "))


def assert_same(got: dict, want: dict) -> None:
    """The same greedy tokens, each token's logprob within float32 noise."""
    assert got["tokens"] == want["tokens"]
    diff = max(abs(a - b) for a, b in zip(got["logprobs"], want["logprobs"], strict=True))
    assert diff < 1e-4, diff


def support_script(env: dict[str, str], module: str, jobs: list[dict]) -> str:
    """``python -m tests.support.<module> JOBS`` in the cluster's environment (a process
    of its own, so the test process never joins the Ray cluster); its output."""
    done = subprocess.run([sys.executable, "-m", f"tests.support.{module}", json.dumps(jobs)],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout
