"""vLLM with kvstore as its KV connector, against vLLM's own prefix cache, in one run.

One checkpoint built here (random weights; ``--quick``: 8 layers, hidden 256; otherwise
SmolLM2-135M's shape: 30 layers, hidden 576, 9 heads, 3 KV heads), system prompts (``--quick``:
three of 512 tokens; otherwise three each of 512, 1,024 and 2,048) each shared by two
questions, greedy decoding, every vLLM instance pinned to one core
(``VLLM_CPU_OMP_THREADS_BIND=0``) and a process of its own, every store's servers (kvstore's
cluster, Mooncake's and LMCache's) on the other cores:

1. no connector: each system's first question cold, its second warm from vLLM's own prefix
   cache in the same process: the floor a cross-instance hit is measured against; then the
   same with a connector that does nothing (``benchmarks.baselines.null_connector``): the
   cost of vLLM's connector machinery alone, which every connector pays; and with a
   connector that only moves a load's bytes (``benchmarks.baselines.copy_floor_connector``:
   on each local hit, the copies and checks of a kvstore load of its blocks, on the spare
   core under the forward, into memory vLLM never reads): what moving them costs the
   forward on this machine, whoever moves them;
2. a kvstore cluster (a private Ray head) and instance A with the connector: the first
   questions, which publish each system prompt;
3. a fresh instance B with the connector: the second questions, whose prefix exists only in
   kvstore;
4. the same A-then-fresh-B run through Mooncake's store connector and LMCache's (at chunk
   256 and 128, the faster counts), each in its own venv (``benchmarks/baselines/setup.sh``;
   they cannot share kvstore's: LMCache needs protobuf < 7) with its own servers, measured by
   the same instance code.
5. ``benchmarks.bench_vllm_pd`` in a process of its own: 8 users sharing a system prompt
   through ``kvstore serve --engine vllm`` (one prefill, one decode vLLM instance) against one
   vLLM instance doing both; its figures join this run's (``pd_*`` and
   ``ratio_throughput_pd_vs_single``).

``ratio_warm_xinstance_vs_local_prefix_cache`` is B's TTFT over the floor's (median over the
systems); ``..._same_instance`` pairs each of B's requests with a third question on the same
system right after it in B, kvstore bypassed: a hit in vLLM's own prefix cache in the same
process (median of the pairs' ratios), free of the spread from one instance's warm request
to the next one's, which the first ratio carries; the plain instance asks its third
questions the same way, and ``ratio_local_prefix_cache_third_vs_second_question`` says whether
a third question is as fast as the second (so a fair floor);
``ratio_warm_xinstance_vs_{mooncake,lmcache}`` B's over the baseline's B (lower is better:
kvstore's time over theirs); ``cached_tokens_vs_full_blocks`` B's cached tokens over the
system prompts' full blocks; ``outputs_equal`` B's tokens against the no-connector instance's
for the same prompts. A baseline whose venv is missing or that fails is listed under
``skipped`` with its reason. ``--kv-cache-dtype`` (e.g. ``fp8``) runs every instance, the
baselines' too, with that KV cache (kvstore then moves a quarter of the bytes); P/D is
measured with the model's dtype only, so such a run lists it under ``skipped``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.baselines.instance import Fresh, best_xinstance
from benchmarks.baselines.servers import FORWARD_CORE, off_forward_cores
from benchmarks.common import parse_args, report

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 32
#: A connector that does nothing (loaded in the instance's process, not imported here).
NULL_CONNECTOR = {"kv_connector": "NullConnector",
                  "kv_connector_module_path": "benchmarks.baselines.null_connector",
                  "kv_role": "kv_both"}
#: A connector that moves the bytes of a load of each local hit, and does nothing else.
COPY_FLOOR_CONNECTOR = {"kv_connector": "CopyFloorConnector",
                        "kv_connector_module_path": "benchmarks.baselines.copy_floor_connector",
                        "kv_role": "kv_both"}
SKIPPED: dict[str, str] = {}


def _flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint and logs")
    parser.add_argument("--floors-after", action="store_true",
                        help="time the same-instance floors after all the warm requests, not "
                             "each right after its own (the floor's KV then as cold in the "
                             "CPU's caches as a load's)")
    parser.add_argument("--kv-cache-dtype", default="auto", metavar="DTYPE",
                        help="every instance's vLLM --kv-cache-dtype (e.g. fp8; default auto: "
                             "the model's float32); P/D is measured at auto only")


def build_model(path: Path, quick: bool) -> str:
    from tests.support.checkpoint import build_checkpoint

    shape = (dict(hidden_size=256, num_hidden_layers=8, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=512) if quick else
             dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, intermediate_size=1536))
    return str(build_checkpoint(path, config_overrides=shape))


def prompts(quick: bool) -> list[tuple[list[int], list[int]]]:
    """(system, question) token ids: each system prompt twice, with two questions."""
    g = torch.Generator().manual_seed(7)
    # --quick: three systems of one size, so each figure is a median of three requests, not
    # one instance's first (whose one-time costs are no connector's per-request cost); else
    # three of each size: one request varies by about a fifth from one instance to the next
    sizes = [512, 512, 512] if quick else [512, 1024, 2048] * 3
    out = []
    for n in sizes:
        system = torch.randint(5, 390, (n,), generator=g).tolist()
        for q in range(2):
            out.append((system, torch.randint(5, 390, (24 + 8 * q,), generator=g).tolist()))
    return out


def third_questions(pairs: list[tuple[list[int], list[int]]]) -> list[list[int]]:
    """Per system, a third question as long as its second, from a generator of its own (so
    ``prompts`` stays the same): each warm request's floor in its own instance."""
    g = torch.Generator().manual_seed(8)
    return [system + torch.randint(5, 390, (len(question),), generator=g).tolist()
            for i, (system, question) in enumerate(pairs) if i % 2 == 1]


def instance(env: dict[str, str], model: str, batch: list[list[int]], role: str | None,
             max_tokens: int, transfer: dict[str, Any] | None = None,
             floors: Sequence[list[int] | None] | None = None, floors_after: bool = False,
             kv_cache_dtype: str = "auto") -> list[dict[str, Any]]:
    """One instance's results; ``transfer``: another connector's ``kv_transfer_config``;
    ``floors``: a prompt per prompt whose first token is timed after it (``floors_after``:
    after them all), kvstore bypassed."""
    job = {"model": model, "block_size": BLOCK, "max_tokens": max_tokens, "prompts": batch,
           "warmup": True, "salts": [None] * len(batch), "role": role,
           "kv_transfer_config": transfer, "floor_prompts": floors,
           "floors_after": floors_after, "kv_cache_dtype": kv_cache_dtype}
    done = subprocess.run([sys.executable, "-m", "benchmarks.vllm_instance", "-"],
                          input=json.dumps(job), env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=1800)
    lines = [x for x in done.stdout.splitlines() if x.startswith("RESULTS ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"a vLLM instance failed:\n{done.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("RESULTS "))


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], _flags)
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    env = {**os.environ, "KVSTORE_STATE_DIR": str(work / "state"), "RAY_AUTH_MODE": "disabled",
           "VLLM_CPU_OMP_THREADS_BIND": str(FORWARD_CORE), "VLLM_CPU_KVCACHE_SPACE": "2",
           "PYTHONPATH": str(ROOT)}
    try:
        run(args, env, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


def start_kvstore(env: dict[str, str], *, off_forward: bool = False) -> list[str]:
    """``kvstore start`` for this run (its state directory is in ``env``); the command line
    that runs kvstore, for the matching ``stop``. A failed start ends the bench in one line.
    ``off_forward``: the cluster's processes (Ray's and the store node) run off the vLLM
    instances' core, as the baselines' servers do (``servers.off_forward_cores``)."""
    kvstore = [sys.executable, "-m", "kvstore.cli"]
    started = subprocess.run([*kvstore, "start", "--capacity", "1GiB"], env=env,
                             capture_output=True, text=True, timeout=300,
                             preexec_fn=off_forward_cores() if off_forward else None)
    if started.returncode != 0:
        lines = started.stderr.strip().splitlines()
        raise SystemExit(f"kvstore start failed: {lines[-1] if lines else started.returncode}")
    return kvstore


def prefill_decode(env: dict[str, str], work: Path, quick: bool) -> dict[str, Any] | str:
    """``bench_vllm_pd``'s figures (its own cluster and engines), or why there are none."""
    out = work / "pd.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.bench_vllm_pd",
                           *(["--quick"] if quick else []), "--json", str(out)],
                          env={k: v for k, v in env.items() if k != "KVSTORE_STATE_DIR"},
                          cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0 or not out.exists():
        lines = done.stderr.strip().splitlines()
        return f"bench_vllm_pd failed: {lines[-1] if lines else done.returncode}"
    figures: dict[str, Any] = json.loads(out.read_text())
    return figures


def run(args: argparse.Namespace, env: dict[str, str], work: Path) -> None:
    model = build_model(work / "model", args.quick)
    pairs = prompts(args.quick)
    first = [s + q for i, (s, q) in enumerate(pairs) if i % 2 == 0]
    second = [s + q for i, (s, q) in enumerate(pairs) if i % 2 == 1]
    new_tokens = 8 if args.quick else 16
    interleaved = [p for pair in zip(first, second, strict=True) for p in pair]
    thirds = third_questions(pairs)
    dtype = args.kv_cache_dtype
    plain = instance(env, model, interleaved, None, new_tokens,
                     floors=[p for third in thirds for p in (None, third)],
                     floors_after=args.floors_after, kv_cache_dtype=dtype)
    cold, floor = plain[0::2], plain[1::2]
    # The same with a connector that does nothing: vLLM's connector machinery alone.
    null_floor = instance(env, model, interleaved, None, new_tokens,
                          transfer=NULL_CONNECTOR, kv_cache_dtype=dtype)[1::2]
    # ... and with one that moves a load's bytes under the forward: the floor of a copy.
    # Each paired with a third question right after it, moving nothing (kvstore_bypass).
    copy_floor = instance(env, model, interleaved, None, new_tokens,
                          transfer=COPY_FLOOR_CONNECTOR,
                          floors=[p for third in thirds for p in (None, third)],
                          floors_after=args.floors_after, kv_cache_dtype=dtype)[1::2]
    kvstore = start_kvstore(env, off_forward=True)
    try:
        instance(env, model, first, "kv_both", new_tokens, kv_cache_dtype=dtype)
        fresh = instance(env, model, second, "kv_both", new_tokens, floors=thirds,
                         floors_after=args.floors_after, kv_cache_dtype=dtype)
    finally:
        subprocess.run([*kvstore, "stop"], env=env, capture_output=True, timeout=300)
    systems = [s for i, (s, _) in enumerate(pairs) if i % 2 == 1]
    full = sum(len(s) // BLOCK * BLOCK for s in systems)
    warm_x = statistics.median(r["ttft_s"] for r in fresh)
    warm_local = statistics.median(r["ttft_s"] for r in floor)
    # A third question in the same process (right after each request, or after them all):
    # the floor paired with it, where vLLM's own cache held all the request had from kvstore.
    third_local = statistics.median(r["ttft_floor_s"] for r in floor)
    pairs_hit = [r for r in fresh if r["cached_floor"] == r["cached"] > 0]
    paired = statistics.median(r["ttft_s"] / r["ttft_floor_s"] for r in pairs_hit or fresh)
    warm_null = statistics.median(r["ttft_s"] for r in null_floor)
    warm_copy = statistics.median(r["ttft_s"] for r in copy_floor)
    paired_copy = statistics.median(r["ttft_s"] / r["ttft_floor_s"] for r in copy_floor)
    cold_s = statistics.median(r["ttft_s"] for r in cold)
    diff = max(abs(a - b) for x, y in zip(fresh, floor, strict=True)
               for a, b in zip(x["logprobs"], y["logprobs"], strict=True))
    baselines: dict[str, Fresh] = {}
    skipped = dict(SKIPPED)
    for name in ("mooncake", "lmcache"):  # each starts and stops its own servers
        got = best_xinstance(name, model, first, second, env, block_size=BLOCK,
                             max_tokens=new_tokens, kv_cache_dtype=dtype)
        if isinstance(got, str):
            skipped[f"ratio_warm_xinstance_vs_{name}"] = got
        else:
            baselines[name] = got
    figures: dict[str, Any] = {
        "system_tokens": [len(s) for s in systems], "block_size": BLOCK,
        "kv_cache_dtype": dtype,
        "ttft_cold_s": cold_s, "ttft_warm_local_prefix_cache_s": warm_local,
        "ttft_warm_xinstance_s": warm_x,
        "ratio_warm_xinstance_vs_local_prefix_cache": warm_x / warm_local,
        "ttft_warm_local_prefix_cache_third_question_s": third_local,
        "ratio_local_prefix_cache_third_vs_second_question": third_local / warm_local,
        "ttft_warm_xinstance_third_question_s": statistics.median(
            r["ttft_floor_s"] for r in fresh),
        "ratio_warm_xinstance_vs_local_prefix_cache_same_instance": paired,
        "same_instance_pairs_hit_vs_requests": len(pairs_hit) / len(fresh),
        "same_instance_floors_after": args.floors_after,
        "ttft_warm_local_prefix_cache_null_connector_s": warm_null,
        "ratio_null_connector_vs_local_prefix_cache": warm_null / warm_local,
        "ratio_warm_xinstance_vs_null_connector_prefix_cache": warm_x / warm_null,
        "ttft_warm_local_prefix_cache_copy_floor_s": warm_copy,
        "ratio_copy_floor_vs_local_prefix_cache": warm_copy / warm_local,
        "ratio_warm_xinstance_vs_copy_floor": warm_x / warm_copy,
        "ratio_copy_floor_vs_local_prefix_cache_same_instance": paired_copy,
        "ratio_cold_vs_warm_xinstance": cold_s / warm_x,
        "cached_tokens_vs_full_blocks": sum(r["cached"] for r in fresh) / full,
        "outputs_equal": all(x["tokens"] == y["tokens"] for x, y in
                             zip(fresh, floor, strict=True)),
        "max_logprob_diff": diff, "skipped": skipped,
    }
    rows = []
    for name, got in baselines.items():
        figures[f"ratio_warm_xinstance_vs_{name}"] = warm_x / got.ttft_s
        figures[f"ttft_warm_xinstance_{name}_s"] = got.ttft_s
        figures[f"cached_tokens_vs_full_blocks_{name}"] = sum(
            r["cached"] for r in got.results) / full
        figures[f"outputs_equal_{name}"] = all(
            x["tokens"] == y["tokens"] for x, y in zip(got.results, floor, strict=True))
        rows.append((f"fresh from kvstore / fresh from {name}", f"{warm_x / got.ttft_s:.2f}",
                     f"<= 1.0 ({name}: {got.ttft_s:.3f} s)"))
    if "lmcache" in baselines:
        figures["lmcache_chunk_size"] = baselines["lmcache"].chunk_size
    pd = prefill_decode(env, work, args.quick) if dtype == "auto" else \
        f"measured with kv_cache_dtype auto only (this run: {dtype})"
    if isinstance(pd, str):
        skipped["ratio_throughput_pd_vs_single"] = pd
    else:
        figures.update({k if k.startswith("ratio_") else f"pd_{k}": v for k, v in pd.items()
                        if isinstance(v, (int, float, bool))})
        rows.append(("P/D / single instance, tokens per second",
                     f"{pd['ratio_throughput_pd_vs_single']:.2f}", "> 1.0"))
    report("vLLM + kvstore connector (CPU, one core per instance)", [
        ("TTFT cold (s)", f"{cold_s:.3f}", ""),
        ("TTFT warm, vLLM's own prefix cache (s)", f"{warm_local:.3f}", "the floor"),
        ("TTFT warm, fresh instance from kvstore (s)", f"{warm_x:.3f}", ""),
        ("fresh from kvstore / own prefix cache", f"{warm_x / warm_local:.2f}", "<= 1.0"),
        ("the same, each against a third question right after it, same instance",
         f"{paired:.2f}", "median of the pairs"),
        ("own prefix cache: a third question / the second question",
         f"{third_local / warm_local:.2f}", "~1.0: the third is a fair floor"),
        ("TTFT warm, own prefix cache with a do-nothing connector (s)", f"{warm_null:.3f}",
         f"{warm_null / warm_local:.2f}x the floor: vLLM's connector machinery alone"),
        ("fresh from kvstore / that", f"{warm_x / warm_null:.2f}", ""),
        ("TTFT warm, own prefix cache, a load's bytes moved aside (s)", f"{warm_copy:.3f}",
         f"{warm_copy / warm_local:.2f}x the floor: moving the bytes alone"),
        ("fresh from kvstore / that", f"{warm_x / warm_copy:.2f}", "kvstore's own cost"),
        ("moving the bytes alone, each against a third question right after it",
         f"{paired_copy:.2f}", "median of the pairs: compare kvstore's"),
        ("cached tokens / full blocks", f"{figures['cached_tokens_vs_full_blocks']:.2f}", "1.0"),
        ("outputs = no connector", str(figures["outputs_equal"]), "True"),
        ("largest logprob difference", f"{diff:.2e}", ""),
        *rows,
    ], figures, args.json)


if __name__ == "__main__":
    main()
