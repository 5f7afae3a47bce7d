"""End to end: a shared system prompt, cold vs warm TTFT, decode on fetched vs local KV.

Runs the engines in this process over the real store by default (``--store cluster``: a private
local Ray, the coordinator, a store node, and ``kvstore.cluster.lifecycle.connect()`` — index
lookups through the coordinator, leases over gRPC, same-node copies out of shared memory), or
over an in-process LocalStore (``--store local``), on the ``small`` preset: one cold request
publishes the system prompt, then requests with 32-64-token suffixes reuse it. Decode speed is
measured per step on KV reassembled from fetched blocks (``paged_cache_load``) against the
prefill's own, locally computed KV.

Throughput: 8 warm requests like those, generating twice as many tokens each (serving is
decode-heavy), through Ray actor replicas, 1 prefill + 1 decode against 2 + 2
(``kvstore.workers.jobs.deployment.Deployment.run``: several requests in flight per replica, so 1 +
1 already overlaps the prefill of one request with the decode of another), each replica on
``--threads`` torch threads; ``ratio_throughput_2x2_vs_1x1`` is requests per second of 2 + 2 over 1
+ 1. Each shape gets its own cache salt (so neither finds the other's blocks), a warm-up request per
replica and a cache warm-up of the system prompt before the timed run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from benchmarks.common import parse_args, report
from kvstore.api import KVStore
from kvstore.client.local_store import LocalStore
from kvstore.config import KVStoreConfig, WorkerConfig
from kvstore.workers.engine.prefill_decode import Engine
from kvstore.workers.jobs.deployment import Deployment
from kvstore.workers.model.causal_lm import load_model
from kvstore.workers.model.sampling import SamplingParams
from kvstore.workers.replicas.request_pipeline import RequestOutput


def make_tokens(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def _flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--store", choices=("cluster", "local"), default="cluster",
                        help="cluster: the real store on a private local Ray; local: in-process")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per replica in the throughput runs")


def open_store(kind: str) -> tuple[KVStore, Callable[[], None]]:
    """The store the engines use, and how to tear it down."""
    if kind == "local":
        return LocalStore(), lambda: None
    import ray

    from kvstore.cluster import lifecycle

    lifecycle.ensure_ray("local")  # a private instance, its auth mode decided (no warning)
    config = KVStoreConfig()
    lifecycle.start(config)
    store = lifecycle.connect(config)

    def close() -> None:
        store.close()
        lifecycle.stop(config)
        ray.shutdown()

    return store, close


def run_shape(num_prefill: int, num_decode: int, threads: int, system: list[int],
              prompts: list[list[int]], new_tokens: int) -> tuple[float, list[RequestOutput]]:
    """Wall time of ``prompts`` through ``num_prefill`` + ``num_decode`` actor replicas."""
    config = KVStoreConfig(worker=WorkerConfig(
        model="small", block_size=16, prefill_chunk_tokens=256, num_threads=threads,
        max_new_tokens=new_tokens, cache_salt=f"throughput-{num_prefill}x{num_decode}"))
    sampling = SamplingParams(max_new_tokens=new_tokens)
    dep = Deployment(config, num_prefill=num_prefill, num_decode=num_decode, mode="ray")
    try:
        vocab = dep.vocab_size
        # Every replica runs once (first forwards are slow), then the system prompt is cached.
        dep.run("generate", [(f"w{i}", make_tokens(40, 900 + i, vocab))
                             for i in range(2 * max(num_prefill, num_decode))],
                SamplingParams(max_new_tokens=2))
        dep.run("generate", [("system", system)], SamplingParams(max_new_tokens=0))
        t0 = time.perf_counter()
        outs = dep.run("generate", [(f"r{i}", p) for i, p in enumerate(prompts)], sampling)
        return time.perf_counter() - t0, outs
    finally:
        dep.close()


def measure_throughput(threads: int, system: list[int], prompts: list[list[int]],
                       new_tokens: int) -> dict[str, float | bool]:
    """1 + 1 against 2 + 2 replicas on the same prompts, in this run."""
    one_s, one = run_shape(1, 1, threads, system, prompts, new_tokens)
    two_s, two = run_shape(2, 2, threads, system, prompts, new_tokens)
    return {"throughput_1x1_rps": len(prompts) / one_s, "throughput_2x2_rps": len(prompts) / two_s,
            "ratio_throughput_2x2_vs_1x1": one_s / two_s, "throughput_threads": threads,
            "throughput_requests": len(prompts), "throughput_new_tokens": new_tokens,
            "outputs_match_2x2_vs_1x1": [o.output_token_ids for o in one]
            == [o.output_token_ids for o in two]}


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], _flags)
    system_tokens, num_requests, new_tokens = (512, 4, 16) if args.quick else (2048, 8, 32)
    config = WorkerConfig(model="small", block_size=16, prefill_chunk_tokens=256,
                          num_threads=2, max_new_tokens=new_tokens)
    model = load_model("small", seed=0, num_threads=config.num_threads)
    vocab = model.shape.vocab_size
    store, close_store = open_store(args.store)
    prefill, decode = Engine(model, store, config), Engine(model, store, config)
    sampling = SamplingParams(max_new_tokens=new_tokens)
    system = make_tokens(system_tokens, 1, vocab)
    prompts = [system + make_tokens(32 + (32 * i) // max(1, num_requests - 1), 100 + i, vocab)
               for i in range(num_requests + 1)]

    cold = prefill.prefill(prompts[0], sampling=sampling, request_id="cold")
    prefill.wait_published()  # the warm requests below measure reuse of all of it
    warm_ttft, fetched_tps, local_tps, bytes_per_request, matches = [], [], [], [], []
    for i, prompt in enumerate(prompts[1:]):
        pre = prefill.prefill(prompt, sampling=sampling, request_id=f"p{i}")
        # As a decode replica does: wait for the blocks the prefill queued, then fetch them.
        dec = decode.decode(prompt, pre.first_token, tail=pre.tail, sampling=sampling,
                            request_id=f"d{i}", wait_for_blocks=pre.num_prefix_blocks)
        _, local = Engine(model, None, config).generate(prompt, sampling=sampling,
                                                        request_id=f"l{i}")
        warm_ttft.append(pre.ttft_s)
        fetched_tps.append(dec.decode_tokens_per_s)
        local_tps.append(local.decode_tokens_per_s)
        bytes_per_request.append(pre.bytes_fetched + dec.bytes_fetched)
        matches.append(dec.output_token_ids == local.output_token_ids)

    if args.store == "local":  # the throughput runs need Ray actors all the same
        close_store()
        _, close_store = open_store("cluster")
    # At least 8 requests: 2 + 2 replicas hold 8 in flight, and fewer time mostly ramp-up.
    tput_prompts = [system + make_tokens(32 + 4 * i, 200 + i, vocab)
                    for i in range(max(8, num_requests))]
    tput = measure_throughput(args.threads, system, tput_prompts, 2 * new_tokens)
    close_store()
    warm = statistics.median(warm_ttft)
    fetched, local_s = statistics.median(fetched_tps), statistics.median(local_tps)
    figures = {
        "system_tokens": system_tokens, "num_requests": num_requests,
        "cold_ttft_s": cold.ttft_s, "warm_ttft_s": warm,
        "ratio_cold_vs_warm_ttft": cold.ttft_s / warm,
        "decode_tokens_per_s_fetched": fetched, "decode_tokens_per_s_local": local_s,
        "ratio_decode_fetched_vs_local": fetched / local_s,
        "bytes_fetched_per_request": statistics.median(bytes_per_request),
        "outputs_match": all(matches),
        "store": args.store,
        **tput,
    }
    report(f"end to end (small preset, {args.store} store)", [
        ("TTFT cold (s)", f"{cold.ttft_s:.3f}", ""),
        ("TTFT warm, median (s)", f"{warm:.3f}", ""),
        ("cold / warm TTFT", f"{figures['ratio_cold_vs_warm_ttft']:.1f}x", ">= 20"),
        ("decode tok/s, fetched KV", f"{fetched:.1f}", f"local {local_s:.1f}"),
        ("fetched / local decode", f"{figures['ratio_decode_fetched_vs_local']:.2f}", ">= 0.95"),
        ("bytes moved / request", f"{figures['bytes_fetched_per_request']:,.0f}", ""),
        ("outputs = local (bitwise tokens)", str(all(matches)), "True"),
        (f"requests/s, 1+1 replicas ({args.threads} thread)",
         f"{tput['throughput_1x1_rps']:.2f}", ""),
        (f"requests/s, 2+2 replicas ({args.threads} thread)",
         f"{tput['throughput_2x2_rps']:.2f}", ""),
        ("2+2 / 1+1 throughput", f"{tput['ratio_throughput_2x2_vs_1x1']:.2f}", ">= 1.5"),
        ("outputs 2+2 = 1+1", str(tput["outputs_match_2x2_vs_1x1"]), "True"),
    ], figures, args.json)


if __name__ == "__main__":
    main()
