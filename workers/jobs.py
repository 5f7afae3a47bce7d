"""Worker subcommands of the ``kvstore`` CLI: prefill, decode, generate, demo, bench.

``kvstore.cli`` calls ``register(subparsers)``. Every command runs on the running kvstore
cluster, or starts an embedded one (local Ray, in-memory index) when none is up;
``--in-process`` runs everything in this process on a LocalStore (no Ray at all).
Progress goes to stderr, so ``--json`` output on stdout stays one JSON object per line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from kvstore.config import KVStoreConfig, load_config
from kvstore.errors import ConfigError
from workers.engine import SamplingParams
from workers.serving import Deployment, RequestOutput, parse_resource
from workers.tokenizer import Tokenizer, load_tokenizer

err = Console(stderr=True)


def _common(p: argparse.ArgumentParser, *, prompts: bool = True) -> None:
    if prompts:
        p.add_argument("--prompts", metavar="FILE.jsonl", required=True,
                       help='one request a line: {"id": ..., "token_ids": [...]} or "text"')
    p.add_argument("--config", metavar="FILE", help="YAML settings")
    p.add_argument("--address", metavar="RAY_ADDRESS", help="Ray cluster to use")
    p.add_argument("--in-process", action="store_true",
                   help="no Ray: replicas in this process over a LocalStore")
    p.add_argument("--model", help="preset (tiny, small) or a local weights directory")
    p.add_argument("--seed", type=int, help="weights seed of a random preset")
    p.add_argument("--sampling-seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--stop-token-ids", type=int, nargs="*", default=[])
    p.add_argument("--block-size", type=int)
    p.add_argument("--chunk-tokens", type=int, help="prefill chunk (a multiple of block size)")
    p.add_argument("--salt", help="tenant cache salt")
    p.add_argument("--threads", type=int, help="torch threads per replica")
    p.add_argument("--tokenizer", metavar="PATH", help="local tokenizer dir (default: bytes)")
    p.add_argument("--json", action="store_true", help="JSON lines on stdout")
    p.add_argument("--output", metavar="PATH", help="write results as JSONL")


def _placement(p: argparse.ArgumentParser) -> None:
    # The prefill/decode node types of deploy/cluster-aws.yaml and the KubeRay worker groups.
    p.add_argument("--prefill-resource", metavar="NAME[=AMOUNT]",
                   help="Ray custom resource prefill replicas ask for (places them by node)")
    p.add_argument("--decode-resource", metavar="NAME[=AMOUNT]",
                   help="Ray custom resource decode replicas ask for (places them by node)")


def register(subparsers: Any) -> None:
    """Add the worker subcommands to the ``kvstore`` parser."""
    p = subparsers.add_parser("prefill", help="prefill prompts and publish their KV blocks")
    _common(p)
    _placement(p)
    p.set_defaults(func=cmd_prefill)
    p = subparsers.add_parser("decode", help="generate from prompts whose KV was published")
    _common(p)
    _placement(p)
    p.set_defaults(func=cmd_decode)
    p = subparsers.add_parser("generate", help="disaggregated prefill + decode")
    _common(p)
    _placement(p)
    p.add_argument("--prefill-replicas", type=int, default=1)
    p.add_argument("--decode-replicas", type=int, default=1)
    p.add_argument("--no-cache", action="store_true", help="bypass the store (reference run)")
    p.set_defaults(func=cmd_generate)
    p = subparsers.add_parser("demo", help="shared system prompt: cold vs warm TTFT, exactness")
    _common(p, prompts=False)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--suffix-tokens", type=int, default=48)
    p.set_defaults(func=cmd_demo, model_default="small", max_new_default=8)
    p = subparsers.add_parser("bench", help="run the benchmarks in benchmarks/")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json-dir", metavar="DIR", help="write each benchmark's JSON here")
    p.add_argument("names", nargs="*", help="benchmark names (default: all)")
    p.set_defaults(func=cmd_bench)


def make_config(args: argparse.Namespace) -> KVStoreConfig:
    """Defaults < --config < KVSTORE_* < flags."""
    worker = {"model": args.model or getattr(args, "model_default", None), "seed": args.seed,
              "block_size": args.block_size, "prefill_chunk_tokens": args.chunk_tokens,
              "cache_salt": args.salt, "num_threads": args.threads,
              "max_new_tokens": args.max_new_tokens or getattr(args, "max_new_default", None)}
    return load_config(args.config, overrides={"worker": worker})


def make_sampling(args: argparse.Namespace, config: KVStoreConfig) -> SamplingParams:
    return SamplingParams(max_new_tokens=config.worker.max_new_tokens,
                          temperature=args.temperature, sampling_seed=args.sampling_seed,
                          stop_token_ids=tuple(args.stop_token_ids))


def read_prompts(path: str, tokenizer: Tokenizer) -> list[tuple[str, list[int]]]:
    """``(id, token_ids)`` per line; the line number is in every error."""
    out = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read --prompts {path}: {exc}") from exc
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{path}:{n}: not JSON ({exc.msg})") from None
        if not isinstance(obj, dict) or ("token_ids" in obj) == ("text" in obj):
            raise ConfigError(f"{path}:{n}: give exactly one of 'token_ids' or 'text'")
        if "text" in obj:
            ids = tokenizer.encode(str(obj["text"]))
        else:
            ids = obj["token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise ConfigError(f"{path}:{n}: 'token_ids' must be a list of ints")
        out.append((str(obj.get("id", n)), ids))
    if not out:
        raise ConfigError(f"--prompts {path} has no requests")
    return out


def emit(args: argparse.Namespace, results: list[RequestOutput], title: str) -> None:
    """JSON lines and/or a JSONL file, and a table on stderr."""
    rows = [r.to_json() for r in results]
    if args.output:
        Path(args.output).write_text("".join(json.dumps(r) + "\n" for r in rows))
    if args.json:
        for row in rows:
            print(json.dumps(row), flush=True)
    table = Table(title=title)
    for col in ("id", "prompt", "cached", "ttft ms", "bytes fetched", "sources", "tokens"):
        table.add_column(col)
    for r in results:
        toks = " ".join(map(str, r.output_token_ids[:8]))
        table.add_row(r.id, str(r.num_prompt_tokens), str(r.cached_tokens),
                      f"{r.ttft_s * 1e3:.1f}", str(r.bytes_fetched),
                      ",".join(f"{k[:8]}:{v}" for k, v in r.sources.items()),
                      toks + (" ..." if len(r.output_token_ids) > 8 else ""))
    (err if args.json else Console()).print(table)


def _resource(spec: str | None) -> dict[str, float] | None:
    return parse_resource(spec) if spec else None


def _run(args: argparse.Namespace, kind: str) -> int:
    config = make_config(args)
    tokenizer = load_tokenizer(args.tokenizer)
    prompts = read_prompts(args.prompts, tokenizer)
    sampling = make_sampling(args, config)
    dep = Deployment(config, num_prefill=getattr(args, "prefill_replicas", 1),
                     num_decode=getattr(args, "decode_replicas", 1),
                     mode="inprocess" if args.in_process else "ray", address=args.address,
                     prefill_resources=_resource(getattr(args, "prefill_resource", None)),
                     decode_resources=_resource(getattr(args, "decode_resource", None)))
    results = []
    try:
        with Progress(console=err, transient=True) as progress:
            task = progress.add_task(kind, total=len(prompts))
            for rid, ids in prompts:
                if kind == "prefill":
                    pre, index = dep.prefill(ids, sampling, request_id=rid)
                    out = RequestOutput(rid, [pre.first_token], pre.cached_tokens,
                                        pre.num_prompt_tokens, pre.ttft_s, pre.bytes_fetched,
                                        pre.sources, 0.0, f"prefill-{index}",
                                        unreused_shared_tokens=pre.unreused_shared_tokens,
                                        resume=dep.reuse["resume"])
                elif kind == "decode":
                    dec = dep.decode(ids, None, sampling, request_id=rid)
                    out = RequestOutput(rid, dec.output_token_ids, dec.fetched_tokens, len(ids),
                                        dec.timings["setup_s"], dec.bytes_fetched, dec.sources,
                                        dec.decode_tokens_per_s)
                else:
                    out = dep.generate(rid, ids, sampling, use_cache=not args.no_cache)
                if args.tokenizer:
                    out.text = tokenizer.decode(out.output_token_ids)
                results.append(out)
                progress.advance(task)
        reuse = dep.reuse
    finally:
        dep.close()
    emit(args, results, f"kvstore {kind} (reuse {reuse['mode']}: resume at {reuse['resume']} "
                        f"boundaries, {'bitwise' if reuse['exact'] else 'approximate'})")
    return 0


def cmd_prefill(args: argparse.Namespace) -> int:
    return _run(args, "prefill")


def cmd_decode(args: argparse.Namespace) -> int:
    return _run(args, "decode")


def cmd_generate(args: argparse.Namespace) -> int:
    return _run(args, "generate")


def cmd_demo(args: argparse.Namespace) -> int:
    from workers.demo import run_demo

    return run_demo(args, make_config(args))


def cmd_bench(args: argparse.Namespace) -> int:
    """Run each ``benchmarks/bench_*.py`` (they print their own tables)."""
    root = Path(__file__).resolve().parents[1] / "benchmarks"
    scripts = sorted(root.glob("bench_*.py"))
    if args.names:
        scripts = [s for s in scripts if s.stem.removeprefix("bench_") in args.names
                   or s.stem in args.names]
    if not scripts:
        raise ConfigError(f"no benchmarks found in {root} (names: {args.names or 'all'})")
    failed = 0
    for script in scripts:
        # As modules from the repository root: benchmarks import benchmarks.common.
        cmd = [sys.executable, "-m", f"benchmarks.{script.stem}"]
        cmd += ["--quick"] if args.quick else []
        if args.json_dir:
            cmd += ["--json", str(Path(args.json_dir) / f"{script.stem}.json")]
        err.print(f"[bold]{script.stem}[/]")
        failed += subprocess.run(cmd, cwd=root.parent, check=False).returncode != 0
    return 1 if failed else 0
