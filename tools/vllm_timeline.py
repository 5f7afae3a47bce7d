"""Where a vLLM request's time goes around kvstore's connector: a timeline of its calls.

vLLM runs its scheduler and its worker in processes of their own, so a profiler in one of them
sees half a request. ``TimedKVStoreConnector`` is ``KVStoreConnector`` with every vLLM hook, and
the work inside them (the lookup's lease, the headers' check, the fetch, the writes: on the
spare core each layer's, then the tags' check, under the forward), logged as
``pid name start end`` lines (``time.perf_counter``, the system's monotonic clock, the same in
every process) to ``$KVSTORE_TIMELINE``; a client marks each request with ``mark``. Load it
as any connector::

    kv_transfer_config={"kv_connector": "TimedKVStoreConnector",
                        "kv_connector_module_path": "tools.vllm_timeline", "kv_role": "kv_both"}

and print each marked request's calls relative to its start::

    python -m tools.vllm_timeline /tmp/kvstore-vllm-timeline.log

A missing file, or one with no marked request, is a one-line error (exit 2).
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable
from typing import Any

DEFAULT_LOG = "/tmp/kvstore-vllm-timeline.log"
#: vLLM's connector calls, logged by name.
HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "request_finished", "handle_preemptions", "start_load_kv", "wait_for_layer_load",
         "wait_for_save",
         "get_finished")
#: Per-layer calls: left out of the summary unless asked for (``--layers``).
LAYER_HOOKS = ("wait_for_layer_load", "spare_write")


def log_path() -> str:
    return os.environ.get("KVSTORE_TIMELINE", DEFAULT_LOG)


def record(name: str, start: float, end: float) -> None:
    """Append one call to the timeline (one short line: appends from processes interleave
    whole)."""
    with open(log_path(), "a") as f:
        f.write(f"{os.getpid()} {name} {start:.6f} {end:.6f}\n")


def mark(label: str, start: float, end: float) -> None:
    """A client's request, from submission to its first token: the summary's unit."""
    record(f"REQUEST:{label}", start, end)


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            record(name, start, time.perf_counter())
    return call


def _timed_connector() -> type:
    """``KVStoreConnector`` whose calls are logged to the timeline; made on first use, so the
    summary (``main``) never imports vLLM."""
    from kvstore.client.arena_blocks import ArenaBlocks
    from kvstore.client.cluster_store import ClusterStore
    from kvstore.integrations.vllm import spare_core, worker_side
    from kvstore.integrations.vllm.connector import KVStoreConnector

    class TimedKVStoreConnector(KVStoreConnector):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            side = self.worker_side
            if side is not None:  # the worker's fetch, inside start_load_kv
                side._fetch_step = timed("fetch", side._fetch_step)  # type: ignore[method-assign]

    for hook in HOOKS:
        setattr(TimedKVStoreConnector, hook, timed(hook, getattr(KVStoreConnector, hook)))
    # The writes into vLLM's cache, inside start_load_kv (once: every connector's).
    worker_side.scatter_blocks = timed("write", worker_side.scatter_blocks)
    # Inside the lookup: the lease's round trip to this host's node. Inside start_load_kv:
    # the leased blocks' headers checked in the arena. On the spare core, under the forward:
    # each layer's writes, then the tags' check.
    ClusterStore.lease_prefix = timed(  # type: ignore[method-assign]
        "lease_prefix", ClusterStore.lease_prefix)
    ClusterStore.arena_blocks = timed(  # type: ignore[method-assign]
        "arena_blocks", ClusterStore.arena_blocks)
    spare_core.scatter_layer = timed("spare_write", spare_core.scatter_layer)
    ArenaBlocks.verify = timed("verify", ArenaBlocks.verify)  # type: ignore[method-assign]
    return TimedKVStoreConnector


def __getattr__(name: str) -> Any:
    """``TimedKVStoreConnector``, as vLLM loads a connector: by name from this module."""
    if name == "TimedKVStoreConnector":
        cls = globals()[name] = _timed_connector()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def summarize(lines: list[str], *, layers: bool = False) -> str:
    """Each marked request's calls, in order, as milliseconds from its start."""
    calls = [(int(pid), name, float(a), float(b))
             for pid, name, a, b in (line.split()[:4] for line in lines if line.strip())]
    out = []
    for _, name, start, end in (c for c in calls if c[1].startswith("REQUEST:")):
        out.append(f"{name.removeprefix('REQUEST:')}: {1e3 * (end - start):.2f} ms")
        for pid, call, a, b in calls:
            if call.startswith("REQUEST:") or not start <= a <= end:
                continue
            if call in LAYER_HOOKS and not layers:
                continue
            at = f"+{1e3 * (a - start):.2f}"
            out.append(f"  {pid:>7} {call:<28} {at:>9} ms  {1e3 * (b - a):6.2f} ms")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tools.vllm_timeline",
                                     description="Each marked request's connector calls.")
    parser.add_argument("path", nargs="?", default=log_path(),
                        help="the timeline (default: $KVSTORE_TIMELINE, else %(default)s)")
    parser.add_argument("--layers", action="store_true", help="list per-layer calls too")
    args = parser.parse_args(argv)
    try:
        with open(args.path) as f:
            text = summarize(f.readlines(), layers=args.layers)
    except OSError as exc:
        parser.exit(2, f"vllm_timeline: error: cannot read {args.path}: {exc.strerror}\n")
    if not text:
        parser.exit(2, f"vllm_timeline: error: no marked request in {args.path} (run "
                       "benchmarks.vllm_instance with KVSTORE_TIMELINE set, or call mark)\n")
    print(text)


if __name__ == "__main__":
    main()
