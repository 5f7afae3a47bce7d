"""``kvstore serve``'s arguments, torch-free: ``kvstore --help`` must not import Ray Serve.

The command itself is ``kvstore.frontend.launch.cmd_serve``, imported when it runs.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvstore.command_flags import EMBEDDED_CLUSTER, add_config_flags
from kvstore.workers.jobs.args import WORKER_DEFAULTS, device_args, model_help, seed_help


def _run(args: argparse.Namespace) -> int:
    from kvstore.frontend.launch import cmd_serve

    return int(cmd_serve(args) or 0)


def register(subparsers: Any) -> None:
    """Add ``serve`` to the ``kvstore`` parser."""
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (Ray Serve) over the store",
        description="Serve /v1/completions and /v1/chat/completions with prefill and decode "
        "replicas on Ray Serve, sharing the store. Runs in the foreground until Ctrl-C. "
        "Settings: the serve: section of --config and KVSTORE_SERVE_* variables (the API key "
        "too: KVSTORE_SERVE_API_KEY or serve.api_key_file, never a flag).")
    p.add_argument("--model", help=model_help())
    p.add_argument("--tokenizer", metavar="PATH",
                   help="tokenizer directory (default: the model directory's own)")
    p.add_argument("--host", help="address to listen on (default: serve.host, 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (default: serve.port, 8000)")
    add_config_flags(p, address_fallback=EMBEDDED_CLUSTER)
    p.add_argument("--model-name", help="the name clients send as 'model' (default: the "
                   "preset or the model directory's name)")
    p.add_argument("--prefill-replicas", type=int, help="default: serve.prefill_replicas")
    p.add_argument("--decode-replicas", type=int, help="default: serve.decode_replicas")
    p.add_argument("--block-size", type=int, help="tokens per cached block (default: "
                   f"worker.block_size, {WORKER_DEFAULTS.block_size})")
    p.add_argument("--chunk-tokens", type=int, help="prefill chunk, a multiple of the block "
                   f"size (default: worker.prefill_chunk_tokens, "
                   f"{WORKER_DEFAULTS.prefill_chunk_tokens})")
    p.add_argument("--seed", type=int, help=seed_help())
    p.add_argument("--threads", type=int, help="torch threads per replica (default: "
                   f"worker.num_threads, {WORKER_DEFAULTS.num_threads})")
    device_args(p)
    p.add_argument("--ready-file", metavar="PATH",
                   help="write the base URL here once the server answers (for scripts)")
    p.set_defaults(func=_run)
