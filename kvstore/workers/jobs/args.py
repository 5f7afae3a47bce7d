"""The worker subcommands' arguments (prefill, decode, generate, demo, bench), torch-free.

``kvstore --help`` and ``kvstore generate --help`` must answer at once, so the parser is built
here without importing the worker stack (torch, transformers, Ray); each subcommand's ``func``
imports ``kvstore.workers.jobs.commands`` only when it runs. ``--config`` and ``--address`` and
the flags' settings are ``kvstore.command_flags``'s, shared with ``serve`` and the operator
commands.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from kvstore.command_flags import EMBEDDED_CLUSTER, add_config_flags
from kvstore.config import WorkerConfig

#: The ``worker`` settings' defaults, as the help texts state them.
WORKER_DEFAULTS = WorkerConfig()
#: The demo's own defaults: a model big enough that reuse shows in the time to first token.
DEMO_MODEL = "small"
DEMO_MAX_NEW_TOKENS = 8


def _lazy(name: str) -> Callable[[argparse.Namespace], int]:
    """A ``func`` that imports ``kvstore.workers.jobs.commands`` when the command runs, not when it
    parses."""

    def run(args: argparse.Namespace) -> int:
        from kvstore.workers.jobs import commands

        return int(getattr(commands, name)(args) or 0)

    run.__name__ = name
    return run


def model_help(default: str | None = None) -> str:
    """``--model``'s help; ``default`` names a command's own default (the demo's), else the
    ``worker.model`` setting's is stated."""
    where = default or f"worker.model, {WORKER_DEFAULTS.model}"
    return f"preset (tiny, small) or a local weights directory (default: {where})"


def seed_help() -> str:
    """``--seed``'s help, with the ``worker.seed`` default."""
    return f"weights seed of a random preset (default: worker.seed, {WORKER_DEFAULTS.seed})"


def _common(p: argparse.ArgumentParser, *, prompts: bool = True,
            model_default: str | None = None, max_new_default: int | None = None) -> None:
    """The flags every worker job shares; a command's own defaults (the demo's) are stated in
    the help where they replace the settings'."""
    max_new = (f"{max_new_default}" if max_new_default is not None
               else f"worker.max_new_tokens, {WORKER_DEFAULTS.max_new_tokens}")
    if prompts:
        p.add_argument("--prompts", metavar="FILE.jsonl", required=True,
                       help='one request a line: {"id": ..., "token_ids": [...]}, "text" '
                       'or "messages": [{"role": ..., "content": ...}]')
    add_config_flags(p, address_fallback=EMBEDDED_CLUSTER)
    p.add_argument("--in-process", action="store_true",
                   help="no Ray: replicas in this process over a LocalStore")
    p.add_argument("--model", help=model_help(model_default))
    p.add_argument("--seed", type=int, help=seed_help())
    p.add_argument("--sampling-seed", type=int, default=0,
                   help="seed of sampling when --temperature > 0 (default 0)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature (default 0: greedy)")
    p.add_argument("--max-new-tokens", type=int,
                   help=f"tokens to generate per request (default: {max_new}); "
                   "0: prefill and publish only, a cache warm-up")
    p.add_argument("--stop-token-ids", type=int, nargs="*", default=[], metavar="ID",
                   help="token ids that end a request's generation (besides the "
                   "checkpoint's end-of-sequence tokens)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at the end-of-sequence tokens of the checkpoint's "
                   "generation_config; only --stop-token-ids")
    p.add_argument("--block-size", type=int, help="tokens per cached block (default: "
                   f"worker.block_size, {WORKER_DEFAULTS.block_size})")
    p.add_argument("--chunk-tokens", type=int, help="prefill chunk, a multiple of the block "
                   f"size (default: worker.prefill_chunk_tokens, "
                   f"{WORKER_DEFAULTS.prefill_chunk_tokens})")
    p.add_argument("--salt", help="tenant cache salt")
    p.add_argument("--threads", type=int, help="torch threads per replica (default: "
                   f"worker.num_threads, {WORKER_DEFAULTS.num_threads})")
    device_args(p)
    p.add_argument("--tokenizer", metavar="PATH", help="local tokenizer dir (default: the --model "
                   "directory's own; bytes for presets)")
    p.add_argument("--json", action="store_true", help="JSON lines on stdout")
    p.add_argument("--output", metavar="PATH", help="write results as JSONL")


def device_args(p: argparse.ArgumentParser) -> None:
    """Where the model runs and how it attends (every job command, the demo, serve)."""
    p.add_argument("--device", help="torch device of the replicas' model and KV: auto (the "
                   "first GPU, else cpu; default: worker.device), cpu, cuda:N, npu:N")
    p.add_argument("--attn-implementation", choices=["auto", "eager", "sdpa"],
                   help="attention: auto (sdpa on a GPU, eager on the CPU; default: "
                   "worker.attn_implementation), eager or sdpa")
    p.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"],
                   help="model and KV dtype: auto (bfloat16 on a GPU, float32 on the CPU; "
                   "default: worker.dtype)")
    p.add_argument("--gpus-per-replica", metavar="N",
                   help="GPUs each Ray replica asks for, so Ray gives it its own: auto (1 where "
                   "the model runs on CUDA, a share of one when replicas outnumber GPUs, else "
                   "0; default: worker.gpus_per_replica), 0.5 (two replicas per GPU), 0 (none)")


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
    p.set_defaults(func=_lazy("cmd_prefill"))
    p = subparsers.add_parser("decode", help="generate from prompts whose KV was published")
    _common(p)
    _placement(p)
    p.set_defaults(func=_lazy("cmd_decode"))
    p = subparsers.add_parser("generate", help="disaggregated prefill + decode")
    _common(p)
    _placement(p)
    p.add_argument("--prefill-replicas", type=int, default=1,
                   help="prefill replicas (Ray actors) to start (default 1)")
    p.add_argument("--decode-replicas", type=int, default=1,
                   help="decode replicas (Ray actors) to start (default 1)")
    p.add_argument("--no-cache", action="store_true", help="bypass the store (reference run)")
    p.set_defaults(func=_lazy("cmd_generate"))
    p = subparsers.add_parser("demo", help="shared system prompt: cold vs warm TTFT, exactness")
    _common(p, prompts=False, model_default=DEMO_MODEL, max_new_default=DEMO_MAX_NEW_TOKENS)
    p.add_argument("--system-tokens", type=int, default=1024,
                   help="tokens of the shared system prompt (default 1024)")
    p.add_argument("--requests", type=int, default=4,
                   help="requests sharing the system prompt (default 4)")
    p.add_argument("--suffix-tokens", type=int, default=48,
                   help="tokens of each request's own suffix (default 48)")
    p.set_defaults(func=_lazy("cmd_demo"), model_default=DEMO_MODEL,
                   max_new_default=DEMO_MAX_NEW_TOKENS)
    p = subparsers.add_parser("bench", help="run the benchmarks in benchmarks/")
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run, not numbers")
    p.add_argument("--json-dir", metavar="DIR", help="write each benchmark's JSON here")
    p.add_argument("names", nargs="*", help="benchmark names (default: all)")
    p.set_defaults(func=_lazy("cmd_bench"))
