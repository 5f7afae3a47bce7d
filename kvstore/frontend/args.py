"""``kvstore serve``'s arguments, torch-free: ``kvstore --help`` must not import Ray Serve.

The command itself is ``kvstore.frontend.launch.cmd_serve``, imported when it runs. Engines
other than kvstore's own come from the caller (``register``'s ``engines``: the CLI hands in
vLLM's), since the front end must not import the integrations above it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

from kvstore.command_flags import EMBEDDED_CLUSTER, add_config_flags
from kvstore.workers.jobs.args import WORKER_DEFAULTS, device_args, model_help, seed_help

#: ``--engine NAME`` -> a function of the parsed arguments returning its
#: ``kvstore.frontend.engines.ServeEngine`` (imported only when the command runs).
EngineFactories = Mapping[str, Callable[[argparse.Namespace], Any]]


def _runner(engines: EngineFactories) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        from kvstore.frontend.launch import cmd_serve

        make = engines.get(args.engine)
        return int(cmd_serve(args, make(args) if make else None) or 0)

    return run


def register(subparsers: Any, engines: EngineFactories | None = None) -> None:
    """Add ``serve`` to the ``kvstore`` parser; ``engines``: those besides kvstore's own."""
    engines = dict(engines or {})
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (Ray Serve) over the store",
        description="Serve /v1/completions and /v1/chat/completions with prefill and decode "
        "replicas on Ray Serve, sharing the store. Runs in the foreground until Ctrl-C. "
        "Settings: the serve: section of --config and KVSTORE_SERVE_* variables (the API key "
        "too: KVSTORE_SERVE_API_KEY or serve.api_key_file, never a flag).")
    p.add_argument("--model", help=model_help())
    p.add_argument("--engine", choices=["kvstore", *sorted(engines)], default="kvstore",
                   help="what computes in the prefill and decode replicas: kvstore's own "
                   "engine (default), or vLLM engines (--model a checkpoint directory; the "
                   "prefill instances are kv_producer, the decode ones kv_consumer of vLLM's "
                   "KVStoreConnector)")
    p.add_argument("--tokenizer", metavar="PATH",
                   help="tokenizer directory (default: the model directory's own)")
    p.add_argument("--host", help="address to listen on (default: serve.host, 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (default: serve.port, 8000)")
    add_config_flags(p, address_fallback=EMBEDDED_CLUSTER)
    p.add_argument("--model-name", help="the name clients send as 'model' (default: the "
                   "preset or the model directory's name)")
    p.add_argument("--prefill-replicas", type=int, help="default: serve.prefill_replicas")
    p.add_argument("--decode-replicas", type=int, help="default: serve.decode_replicas")
    p.add_argument("--max-ongoing-requests", type=int, help="requests each replica works on "
                   "at once; a vLLM replica batches them (default: serve.max_ongoing_requests)")
    p.add_argument("--engine-args", metavar="JSON", help="--engine vllm: vLLM's engine "
                   "arguments as a JSON object, e.g. '{\"block_size\": 32, \"dtype\": "
                   "\"float32\"}' (AsyncEngineArgs' names)")
    p.add_argument("--prefill-cpus", metavar="CPUS", help="--engine vllm on a CPU: the cores "
                   "each prefill engine's threads are bound to (VLLM_CPU_OMP_THREADS_BIND, "
                   "e.g. 0 or 0-3; default: vLLM's own choice)")
    p.add_argument("--decode-cpus", metavar="CPUS", help="--engine vllm on a CPU: the same "
                   "for each decode engine")
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
    p.set_defaults(func=_runner(engines))
