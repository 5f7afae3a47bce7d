"""One vLLM instance, in a process of its own, for bench_vllm and the connector's tests.

vLLM spawns its engine processes, and "a fresh instance" means a process whose only copy of a
prefix can be in the connector's store, so each instance is ``python -m
benchmarks.vllm_instance JOB`` with a JSON job: the checkpoint, block size, prompts (token ids)
with their cache salts, and the connector role (none: no connector), or a whole
``kv_transfer_config`` for another connector. For each prompt it
measures the time to the first token (a one-token generation) and then generates
``max_tokens`` greedily; it prints one line ``RESULTS <json>``: per prompt the TTFT, the
tokens, each token's logprob, and the prompt tokens vLLM did not compute (``cached``).
``together`` submits every prompt in one batch instead (vLLM admits and decodes them together;
no TTFT). ``warmup`` runs one unrelated request first, untimed (a served instance is warm: its
first request's one-time costs are not a cache's; ``WARMUP_PROMPT``). ``stop_cluster_after`` (a
prompt index) stops the kvstore cluster (``kvstore stop``) once that prompt is done: the fault
tests' cluster that goes away while an instance runs. ``metrics``: vLLM's statistics on, and
``METRICS <json>`` before the results: kvstore's counters on vLLM's own metrics. ``bypass``: the
connector neither loads nor saves (``kvstore_bypass``): the same engine without the cache, the
reference a cached run is compared with. ``floor_prompts`` (one per prompt, or None): after
each prompt's generation, the first token of its floor prompt (another question on the same
system prompt) is timed too (``ttft_floor_s``, ``cached_floor``), kvstore bypassed: a hit in
vLLM's own prefix cache in the same process a moment after the timed request, the floor paired
with it, free of the spread from one instance to the next. (Not the same prompt again: a repeat
measured faster than another question on the same system.) ``floors_after``: the floors are
timed after all the prompts instead, each then as cold in the CPU's caches as a load.
``tensor_parallel_size``: the instance's ranks (default 1). ``kv_cache_dtype``: vLLM's
``--kv-cache-dtype`` (default auto: the model's dtype).

``phases`` (a list of such jobs' prompt settings: ``prompts``, ``salts``, ``together``,
``bypass``, ``stop_cluster_after``, ``reset_connector``: the connector's cache reset too, as
after a weight update; ``save_generated``: each request asks the connector to save its
generated blocks too; ``prefill_leg``: each request is a P/D proxy's prefill leg
(``do_remote_decode``), whose result keeps the ``kv_transfer_params`` vLLM answered;
``kv_transfer_params``: one per prompt, a decode leg's, as such a proxy forwards them) runs
one after another on the same engine, vLLM's own prefix cache
reset before each phase, so a test pays for one engine start, not one per phase;
their results are printed as one list, in order.

With ``KVSTORE_TIMELINE`` set, kvstore's connector is ``tools.vllm_timeline``'s timed one and
each timed request is marked there (``python -m tools.vllm_timeline`` prints where its time
went).
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from typing import Any

#: The warm-up request: the same in every instance, so an instance B meets it in its
#: connector's store (published by A's warm-up) and its first load, whose one-time costs are
#: no connector's per-request cost, is untimed. 288 tokens: whole blocks of 32 and one whole
#: chunk of 256 (LMCache saves whole chunks only), for every connector alike.
WARMUP_PROMPT = [3 + (i * 7919) % 300 for i in range(288)]
#: A request's ``extra_args`` that has kvstore's connector neither load nor save it.
BYPASS = {"kv_transfer_params": {"kvstore_bypass": True}}
#: A request's ``extra_args`` that has kvstore's connector save its generated blocks too.
SAVE_GENERATED = {"kv_transfer_params": {"kvstore_save_generated": True}}
#: A request's ``extra_args`` as a P/D proxy sends its prefill leg.
PREFILL_LEG = {"kv_transfer_params": {"do_remote_decode": True}}


def run(job: dict[str, Any]) -> list[dict[str, Any]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = dict(
        model=job["model"], dtype="float32", max_model_len=job.get("max_model_len", 4096),
        gpu_memory_utilization=0.15, enforce_eager=True, block_size=job["block_size"],
        enable_prefix_caching=True, tensor_parallel_size=job.get("tensor_parallel_size", 1),
        kv_cache_dtype=job.get("kv_cache_dtype", "auto"))
    if job.get("metrics"):  # vLLM's statistics on: its Prometheus metrics are read at the end
        kwargs["disable_log_stats"] = False
    if job.get("kv_transfer_config"):  # another connector (benchmarks/baselines/)
        kwargs["kv_transfer_config"] = job["kv_transfer_config"]
    elif job.get("role"):
        timed = bool(os.environ.get("KVSTORE_TIMELINE"))
        kwargs["kv_transfer_config"] = {
            "kv_connector": "TimedKVStoreConnector" if timed else "KVStoreConnector",
            "kv_connector_module_path": "tools.vllm_timeline" if timed
            else "kvstore.integrations.vllm",
            "kv_role": job["role"], "kv_connector_extra_config": job.get("extra", {})}
    llm = LLM(**kwargs)
    first = SamplingParams(max_tokens=1, temperature=0)
    if job.get("warmup"):  # a served instance is warm: one unrelated request first, untimed
        llm.generate([TokensPrompt(prompt_token_ids=WARMUP_PROMPT)], first, use_tqdm=False)
    results: list[dict[str, Any]] = []
    for n, phase in enumerate(job.get("phases") or [job]):
        if n or phase.get("reset_connector"):  # each phase meets only what the connector holds
            llm.reset_prefix_cache(reset_connector=bool(phase.get("reset_connector")))
        results += _phase(llm, job, phase)
    if job.get("metrics"):
        print("METRICS " + json.dumps(connector_metrics(llm)), flush=True)
    return results


def connector_metrics(llm: Any) -> dict[str, float]:
    """kvstore's counters on vLLM's own metrics (``vllm:kvstore_*``), and vLLM's cached prompt
    tokens by source (``vllm:prompt_tokens_cached_by_source:<source>``), summed over engines."""
    totals: dict[str, float] = {}
    for metric in llm.get_metrics():
        name = metric.name
        if name == "vllm:prompt_tokens_cached_by_source":
            name += ":" + metric.labels.get("source", "")
        elif not name.startswith("vllm:kvstore_"):
            continue
        totals[name] = totals.get(name, 0) + metric.value
    return totals


def _phase(llm: Any, job: dict[str, Any], phase: dict[str, Any]) -> list[dict[str, Any]]:
    from vllm import SamplingParams

    extra = BYPASS if phase.get("bypass") else SAVE_GENERATED \
        if phase.get("save_generated") else PREFILL_LEG if phase.get("prefill_leg") else None
    legs = phase.get("kv_transfer_params") or [None] * len(phase["prompts"])
    extras = [{"kv_transfer_params": leg} if leg else extra for leg in legs]
    first = [SamplingParams(max_tokens=1, temperature=0, extra_args=e) for e in extras]
    params = [SamplingParams(max_tokens=job["max_tokens"], temperature=0, logprobs=1,
                             extra_args=e) for e in extras]
    salts = phase.get("salts") or [None] * len(phase["prompts"])
    requests = [_prompt(p, salt) for p, salt in zip(phase["prompts"], salts, strict=True)]
    if phase.get("together"):  # one batch: vLLM admits and decodes them together (no TTFT)
        return [_result(out, None, out.num_cached_tokens)
                for out in llm.generate(requests, params, use_tqdm=False)]
    results = []
    floors = phase.get("floor_prompts") or job.get("floor_prompts")
    floors_after = phase.get("floors_after") or job.get("floors_after")
    for n, request in enumerate(requests):
        t0 = time.perf_counter()
        [head] = llm.generate([request], first[n], use_tqdm=False)
        ttft = time.perf_counter() - t0
        if os.environ.get("KVSTORE_TIMELINE"):  # tools is not a package mypy reads twice
            importlib.import_module("tools.vllm_timeline").mark(f"prompt-{n}", t0, t0 + ttft)
        [out] = llm.generate([request], params[n], use_tqdm=False)
        results.append(_result(out, ttft, head.num_cached_tokens))
        if floors and floors[n] and not floors_after:
            _time_floor(llm, _prompt(floors[n], salts[n]), n, results[-1])
        if n == phase.get("stop_cluster_after"):
            subprocess.run([sys.executable, "-m", "kvstore.cli", "stop"], check=True,
                           capture_output=True, timeout=300)
    if floors and floors_after:
        for n, (tokens, salt) in enumerate(zip(floors, salts, strict=True)):
            if tokens:
                _time_floor(llm, _prompt(tokens, salt), n, results[n])
    return results


def _prompt(tokens: list[int], salt: str | None) -> Any:
    from vllm.inputs import TokensPrompt

    request = TokensPrompt(prompt_token_ids=tokens)
    if salt:
        request["cache_salt"] = salt
    return request


def _time_floor(llm: Any, request: Any, n: int, result: dict[str, Any]) -> None:
    """Adds to ``result`` the first token's time of ``request`` with kvstore bypassed (a hit
    in vLLM's own prefix cache, for a prompt whose prefix an earlier request brought in) and
    the prompt tokens it did not compute."""
    from vllm import SamplingParams

    once = SamplingParams(max_tokens=1, temperature=0, extra_args=BYPASS)
    t0 = time.perf_counter()
    [out] = llm.generate([request], once, use_tqdm=False)
    ttft = time.perf_counter() - t0
    if os.environ.get("KVSTORE_TIMELINE"):
        importlib.import_module("tools.vllm_timeline").mark(f"floor-{n}", t0, t0 + ttft)
    result["ttft_floor_s"], result["cached_floor"] = ttft, out.num_cached_tokens


def _result(out: Any, ttft: float | None, cached: int | None) -> dict[str, Any]:
    logprobs = [max(step.values(), key=lambda lp: lp.logprob).logprob
                for step in out.outputs[0].logprobs or []]
    return {"ttft_s": ttft, "tokens": list(out.outputs[0].token_ids), "logprobs": logprobs,
            "cached": cached, "kv_transfer_params": out.kv_transfer_params}


def main() -> None:
    """The job is the one argument, or ``-``: read from stdin (a job past the kernel's
    128 KiB limit on one argument: thousands of prompt tokens)."""
    text = sys.stdin.read() if sys.argv[1] == "-" else sys.argv[1]
    print("RESULTS " + json.dumps(run(json.loads(text))), flush=True)


if __name__ == "__main__":
    main()
