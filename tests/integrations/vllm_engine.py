"""One vLLM engine run for the connector tests, in a process of its own (vLLM spawns its engine
processes, and a fresh process is what "a new instance" means): reads a JSON job on argv,
prints one JSON line of results."""

from __future__ import annotations

import json
import sys


def main() -> None:
    job = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams

    kwargs = dict(model=job["model"], dtype="float32", max_model_len=2048,
                  gpu_memory_utilization=0.15, enforce_eager=True, block_size=job["block_size"],
                  enable_prefix_caching=True)
    if job.get("role"):
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KVStoreConnector",
            "kv_connector_module_path": "kvstore.integrations.vllm",
            "kv_role": job["role"], "kv_connector_extra_config": job.get("extra", {})}
    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=job["max_tokens"], temperature=0, logprobs=1)
    results = []
    for prompt, salt in zip(job["prompts"], job["salts"], strict=True):
        request: dict = {"prompt_token_ids": prompt}
        if salt:
            request["cache_salt"] = salt
        [out] = llm.generate([request], params, use_tqdm=False)
        logprobs = [max(step.values(), key=lambda lp: lp.logprob).logprob
                    for step in out.outputs[0].logprobs]
        results.append({"tokens": list(out.outputs[0].token_ids), "logprobs": logprobs,
                        "cached": out.num_cached_tokens})
    print("RESULTS " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
