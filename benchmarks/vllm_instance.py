"""One vLLM instance, in a process of its own, for bench_vllm and the connector's tests.

vLLM spawns its engine processes, and "a fresh instance" means a process whose only copy of a
prefix can be in the connector's store, so each instance is ``python -m
benchmarks.vllm_instance JOB`` with a JSON job: the checkpoint, block size, prompts (token ids)
with their cache salts, and the connector role (none: no connector). For each prompt it
measures the time to the first token (a one-token generation) and then generates
``max_tokens`` greedily; it prints one line ``RESULTS <json>``: per prompt the TTFT, the
tokens, each token's logprob, and the prompt tokens vLLM did not compute (``cached``).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def run(job: dict[str, Any]) -> list[dict[str, Any]]:
    from vllm import LLM, SamplingParams

    kwargs: dict[str, Any] = dict(
        model=job["model"], dtype="float32", max_model_len=job.get("max_model_len", 4096),
        gpu_memory_utilization=0.15, enforce_eager=True, block_size=job["block_size"],
        enable_prefix_caching=True)
    if job.get("role"):
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KVStoreConnector",
            "kv_connector_module_path": "kvstore.integrations.vllm",
            "kv_role": job["role"], "kv_connector_extra_config": job.get("extra", {})}
    llm = LLM(**kwargs)
    first = SamplingParams(max_tokens=1, temperature=0)
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0, logprobs=1)
    results = []
    for prompt, salt in zip(job["prompts"], job["salts"], strict=True):
        request: dict[str, Any] = {"prompt_token_ids": prompt}
        if salt:
            request["cache_salt"] = salt
        t0 = time.perf_counter()
        [head] = llm.generate([request], first, use_tqdm=False)
        ttft = time.perf_counter() - t0
        [out] = llm.generate([request], params, use_tqdm=False)
        logprobs = [max(step.values(), key=lambda lp: lp.logprob).logprob
                    for step in out.outputs[0].logprobs or []]
        results.append({"ttft_s": ttft, "tokens": list(out.outputs[0].token_ids),
                        "logprobs": logprobs, "cached": head.num_cached_tokens})
    return results


def main() -> None:
    print("RESULTS " + json.dumps(run(json.loads(sys.argv[1]))), flush=True)


if __name__ == "__main__":
    main()
