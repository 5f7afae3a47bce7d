"""``kvstore demo``: a long shared system prompt prefilled once, reused by other replicas.

It prints cold vs warm time-to-first-token, the hit rate, the bytes moved, and whether the
cached generations equal ``--no-cache`` generations token for token.
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any

import torch
from rich.table import Table

from kvstore.command_output import Steps, output_console
from kvstore.config import KVStoreConfig
from kvstore.workers.jobs.deployment import Deployment
from kvstore.workers.model.device import resolve_worker
from kvstore.workers.model.sampling import SamplingParams


def make_tokens(n: int, seed: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def run_demo(args: argparse.Namespace, config: KVStoreConfig, steps: Steps | None = None
             ) -> int:
    """Cold request, then warm requests with other suffixes on other replicas, then checks;
    each phase reported through ``steps`` (``kvstore.command_output``)."""
    steps = steps or Steps.silent()
    console = output_console(stderr=args.json)
    sampling = SamplingParams(max_new_tokens=config.worker.max_new_tokens,
                              temperature=args.temperature, sampling_seed=args.sampling_seed)
    wc = config.worker
    where = resolve_worker(wc.device, wc.dtype, wc.attn_implementation)
    console.print(f"[bold]kvstore demo[/]: model {wc.model} on {where.device} ({where.dtype}, "
                  f"{where.attn_implementation}), system prompt {args.system_tokens} tokens, "
                  f"{args.requests} requests")
    dep = Deployment(config, num_prefill=2, num_decode=1,
                     mode="inprocess" if args.in_process else "ray", address=args.address,
                     own_ray=True, steps=steps)
    try:
        vocab = dep.vocab_size
        system = make_tokens(args.system_tokens, 1, vocab)
        prompts = [system + make_tokens(args.suffix_tokens, 100 + i, vocab)
                   for i in range(args.requests + 1)]
        with steps.phase(f"cold request: prefilling the {args.system_tokens}-token system "
                         "prompt"):
            outs = [dep.generate("cold", prompts[0], sampling)]
        with steps.counted("warm requests (the system prompt from the store)",
                           args.requests) as advance:
            for i, p in enumerate(prompts[1:]):
                outs.append(dep.generate(f"warm-{i}", p, sampling))
                advance()
        with steps.counted("--no-cache reference runs", len(prompts)) as advance:
            refs = []
            for i, p in enumerate(prompts):
                refs.append(dep.generate(f"ref-{i}", p, sampling, use_cache=False))
                advance()
    finally:
        dep.close()
    warm = outs[1:]
    figures: dict[str, Any] = {
        "device": str(where.device),
        "cold_ttft_s": outs[0].ttft_s,
        "warm_ttft_s": statistics.median(o.ttft_s for o in warm) if warm else None,
        "hit_rate": sum(o.cached_tokens for o in warm) / max(1, sum(o.num_prompt_tokens
                                                                    for o in warm)),
        "bytes_fetched": sum(o.bytes_fetched for o in outs),
        "outputs_match": all(o.output_token_ids == r.output_token_ids
                             for o, r in zip(outs, refs, strict=True)),
    }
    if args.json:
        print(json.dumps(figures), flush=True)
    table = Table(title="kvstore demo")
    for col in ("request", "replica", "cached / prompt", "TTFT ms", "bytes fetched", "= no-cache"):
        table.add_column(col)
    for o, r in zip(outs, refs, strict=True):
        table.add_row(o.id, o.prefill_replica, f"{o.cached_tokens} / {o.num_prompt_tokens}",
                      f"{o.ttft_s * 1e3:.0f}", f"{o.bytes_fetched:,}",
                      "yes" if o.output_token_ids == r.output_token_ids else "NO")
    console.print(table)
    speedup = (figures["cold_ttft_s"] / figures["warm_ttft_s"]) if warm else float("nan")
    console.print(f"cold TTFT {figures['cold_ttft_s'] * 1e3:.0f} ms, warm TTFT (median) "
                  f"{(figures['warm_ttft_s'] or 0) * 1e3:.0f} ms ({speedup:.1f}x), hit rate "
                  f"{figures['hit_rate']:.1%}, {figures['bytes_fetched']:,} bytes moved, "
                  f"outputs match --no-cache: {figures['outputs_match']}")
    return 0 if figures["outputs_match"] else 1
