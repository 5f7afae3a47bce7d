"""Where a vLLM request's time goes around kvstore's connector: a timeline of its calls.

vLLM runs its scheduler and its worker in processes of their own, so a profiler in one of them
sees half a request. ``TimedKVStoreConnector`` is ``KVStoreConnector`` with every vLLM hook, and
the worker's fetch and writes, logged as ``pid name start end`` lines (``time.perf_counter``,
the system's monotonic clock, the same in every process) to ``$KVSTORE_TIMELINE``; a
client marks each request with ``mark``. Load it as any connector::

    kv_transfer_config={"kv_connector": "TimedKVStoreConnector",
                        "kv_connector_module_path": "tools.vllm_timeline", "kv_role": "kv_both"}

and print each marked request's calls relative to its start::

    python -m tools.vllm_timeline /tmp/kvstore-vllm-timeline.log

It is how the warm request of ``bench_vllm`` was taken apart (README, "With vLLM").
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from kvstore.integrations.vllm import worker_side
from kvstore.integrations.vllm.connector import KVStoreConnector

DEFAULT_LOG = "/tmp/kvstore-vllm-timeline.log"
#: vLLM's connector calls, logged by name.
HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
         "request_finished", "start_load_kv", "wait_for_layer_load", "wait_for_save",
         "get_finished")
#: Per-layer calls: left out of the summary unless asked for (``--layers``).
LAYER_HOOKS = ("wait_for_layer_load",)


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


class TimedKVStoreConnector(KVStoreConnector):
    """``KVStoreConnector`` whose calls are logged to the timeline."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        side = self.worker_side
        if side is not None:  # the worker's fetch, inside start_load_kv
            side._fetch_step = timed("  fetch", side._fetch_step)  # type: ignore[method-assign]


for _hook in HOOKS:
    setattr(TimedKVStoreConnector, _hook, timed(_hook, getattr(KVStoreConnector, _hook)))
# The writes into vLLM's cache, inside start_load_kv (once, at import: every connector's).
worker_side.scatter_blocks = timed("  write", worker_side.scatter_blocks)


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
    args = sys.argv[1:] if argv is None else argv
    layers = "--layers" in args
    paths = [a for a in args if a != "--layers"] or [log_path()]
    with open(paths[0]) as f:
        print(summarize(f.readlines(), layers=layers))


if __name__ == "__main__":
    main()
