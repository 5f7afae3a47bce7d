"""Where a warm prefill's time goes: its phases on one timeline, and variants that isolate a cause.

``bench_gpu`` says how far a warm request is from the floor; this says why. It sets up what
``bench_gpu`` does (a Llama-3-8B-shaped model on the GPU, a store node in another process, a
prompt published by a cold run), then times warm prefills under variants that each take one
suspect away:

- ``floor`` / ``floor_fresh``: the floor's store (blocks in pinned memory, one DMA), on one
  engine for every run or a fresh engine per run (as the warm runs are timed);
- ``warm``: a same-node read as ``bench_gpu`` times it (a fresh engine per run);
- ``warm_reused``: one engine for every run;
- ``by_block``: copies block after block, the cache built before the forward (no layered
  copies: ``KVSTORE_LAYERED_COPIES=0``);
- ``verify_first``: the verdicts awaited before any compute (no verification beside it);
- ``host_checks``: payload checksums on the host beside the forward, as where the device
  cannot (``KVSTORE_DEVICE_CHECKSUM=0``), not on the device;
- ``gc_off``: Python's garbage collector off during the request;
- ``switch_1ms``: the interpreter's GIL switch interval at 1 ms instead of 5 (the read's
  thread holds the GIL for shorter spells while the forward launches kernels);
- ``remote``: over the bulk channel (verified before compute).

For each: the median and best TTFT and, for the median run, when each phase started and how
long it took (ms from the request's start): the lookup (and its question to this host's node),
the lease, the fetch call, the copies being issued, the wait for usable rows, verification
(on the read's thread), building the cache, the chunk loop (the forward, logits on the host),
the forward calls within it (their host side only: the rest of the loop waits for the device)
and the wait for verdicts after it; for reads checked on the device, the headers' check and
the device's checksums (the kernel and its wait). ``--device cpu`` runs the same on the
``tiny`` preset.

    python -m tools.gpu_breakdown --json /tmp/breakdown.json [--lengths 4096,16384]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from benchmarks.bench_gpu import FIRST_TOKEN, PinnedBlocks, _cold_cache, only, sync
from benchmarks.transfer_support import start_node_process
from kvstore.block import block_nbytes
from kvstore.client import device_checksum, device_reads, strided_copy
from kvstore.client.cluster_store import ClusterStore
from kvstore.client.device_copy import DeviceRows
from kvstore.client.early_fetch import EarlyFetch
from kvstore.client.node_client import StoreNodeClient
from kvstore.config import ClientConfig, WorkerConfig
from kvstore.index.base import IndexEntry
from kvstore.index.memory import InMemoryIndex
from kvstore.workers.engine import prefill_decode
from kvstore.workers.engine.block_io import BlockIO
from kvstore.workers.engine.prefill_chunks import ChunkLoop
from kvstore.workers.engine.prefill_decode import Engine
from kvstore.workers.model.causal_lm import CausalLM, load_model

#: (label, owner, attribute): the calls put on the timeline.
POINTS: tuple[tuple[str, Any, str], ...] = (
    ("request", Engine, "prefill"),
    ("lookup", ClusterStore, "lookup_prefix"),
    ("held_here", ClusterStore, "_held_here"),
    ("lease", StoreNodeClient, "lease"),
    ("fetch", BlockIO, "fetch"),
    ("get_early", ClusterStore, "batch_get_early"),
    ("issued", DeviceRows, "issued"),
    ("leading", EarlyFetch, "leading"),
    ("verify", device_reads, "parallel_map"),
    ("headers", device_reads, "check_headers"),
    ("device_sums", device_reads, "_device_verdicts"),
    ("cache", prefill_decode, "prefill_cache"),
    ("layer_copies", DeviceRows, "copy_runs_by_layer"),
    ("chunks", ChunkLoop, "run"),
    ("forward", CausalLM, "forward"),
    ("verdicts", EarlyFetch, "result"),
)


class Timeline:
    """Calls of ``POINTS`` as ``(label, start, end)``, from whichever thread made them."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float, float]] = []
        self._lock = threading.Lock()

    def wrap(self, label: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self.events.append((label, start, time.perf_counter()))
        return call

    def phases(self) -> dict[str, tuple[float, float]]:
        """Per label: (start, total duration) in ms from the request's start."""
        t0 = min((s for label, s, _ in self.events if label == "request"), default=0.0)
        out: dict[str, tuple[float, float]] = {}
        for label, s, e in self.events:
            first, total = out.get(label, (float("inf"), 0.0))
            out[label] = (min(first, (s - t0) * 1e3), total + (e - s) * 1e3)
        return out


@contextlib.contextmanager
def patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    old = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


@contextlib.contextmanager
def instrumented(timeline: Timeline) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for label, owner, name in POINTS:
            stack.enter_context(patched(owner, name, timeline.wrap(label, getattr(owner, name))))
        yield


def _verify_first(original: Callable[..., Any]) -> Callable[..., Any]:
    def fetch_early(self: BlockIO, *args: Any, **kwargs: Any) -> Any:
        fetch = original(self, *args, **kwargs)
        if fetch.confirm is not None:
            good = fetch.confirm()
            fetch.confirm = None
            fetch.keep(good)
        return fetch
    return fetch_early


def variant_patches(name: str) -> contextlib.AbstractContextManager[Any]:
    """What a variant changes for the time of its runs."""
    stack = contextlib.ExitStack()
    if name == "verify_first":
        stack.enter_context(patched(BlockIO, "_fetch_early",
                                    _verify_first(BlockIO._fetch_early)))
    elif name == "host_checks":
        stack.enter_context(patched(device_checksum, "usable", lambda device: False))
    elif name == "by_block":
        stack.enter_context(patched(strided_copy, "available", lambda: False))
    elif name == "switch_1ms":
        old = sys.getswitchinterval()
        sys.setswitchinterval(0.001)
        stack.callback(sys.setswitchinterval, old)
    elif name == "gc_off":
        gc.disable()
        stack.callback(gc.enable)
    return stack


@dataclasses.dataclass
class Setup:
    model: CausalLM
    config: WorkerConfig
    tokens: list[int]
    stores: dict[str, ClusterStore]
    floor: PinnedBlocks
    expected: int


def prepare(model: CausalLM, config: WorkerConfig, node: Any, num_tokens: int) -> Setup:
    """A prompt computed cold and published to the node, stores for both reader kinds (the
    same-node arena page-locked), and the floor's pinned blocks."""
    cfg = dataclasses.replace(config, cache_salt=f"breakdown-{num_tokens}")
    tokens = torch.randint(0, model.shape.vocab_size, (num_tokens,),
                           generator=torch.Generator().manual_seed(num_tokens)).tolist()
    index = InMemoryIndex()
    stores = {name: ClusterStore(node.node_id, index, only(node), ClientConfig(timeout_s=300),
                                 local_node_id=reader)
              for name, reader in (("samenode", node.node_id), ("remote", "another-node"))}
    stores["samenode"].prepare_device_reads(model.device, wait=True)
    writer = Engine(model, stores["samenode"], cfg)
    writer.prefill(tokens, request_id="cold", sampling=FIRST_TOKEN)
    writer.wait_published()
    writer.close()
    keys = writer.hasher_for(None).block_keys(tokens)
    index.publish([IndexEntry(k, node.node_id, block_nbytes(writer.namespace), p,
                              writer.namespace.root)
                   for k, p in zip(keys, [writer.namespace.root, *keys[:-1]], strict=True)])
    nb = (num_tokens - 1) // cfg.block_size
    blocks = model.export_block_major(_cold_cache(model, tokens, cfg), 0, nb, cfg.block_size)
    return Setup(model, cfg, tokens, stores, PinnedBlocks(blocks, keys[:nb]),
                 writer.resume_point(nb * cfg.block_size, num_tokens))


VARIANTS = ("floor", "floor_fresh", "warm", "warm_reused", "by_block", "verify_first",
            "host_checks", "gc_off", "switch_1ms", "remote")


def run_variant(setup: Setup, name: str, repeats: int) -> dict[str, Any]:
    """``repeats`` timed prefills (after one untimed) of one variant: TTFTs and the median
    run's phases."""
    store: Any = setup.floor if name.startswith("floor") else \
        setup.stores["remote" if name == "remote" else "samenode"]
    fresh = name in ("floor_fresh", "warm", "by_block", "verify_first", "host_checks", "gc_off",
                     "switch_1ms", "remote")
    shared = None if fresh else Engine(setup.model, store, setup.config)
    runs: list[tuple[float, dict[str, tuple[float, float]]]] = []
    with variant_patches(name):
        for i in range(repeats + 1):
            engine = shared or Engine(setup.model, store, setup.config)
            timeline = Timeline()
            sync(setup.model.device)
            with instrumented(timeline):
                got = engine.prefill(setup.tokens, request_id=f"{name}-{i}",
                                     sampling=FIRST_TOKEN)
            if shared is None:
                engine.close()
            assert got.cached_tokens == setup.expected, \
                f"{name}: {got.cached_tokens} cached, expected {setup.expected}: {got.misses}"
            if i:
                runs.append((got.ttft_s, timeline.phases()))
    if shared is not None:
        shared.close()
    ttfts = sorted(t for t, _ in runs)
    median = statistics.median(ttfts)
    phases = min(runs, key=lambda r: abs(r[0] - median))[1]
    return {"ttft_median_ms": median * 1e3, "ttft_best_ms": ttfts[0] * 1e3,
            "phases": {k: [round(s, 2), round(d, 2)] for k, (s, d) in phases.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lengths", default=None, help="prompt lengths, comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_breakdown: skipped: no CUDA device")
        return
    gpu = device.type == "cuda"
    preset = "llama3-8b" if gpu else "tiny"
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else \
        ([4096, 16384] if gpu else [256])
    config = WorkerConfig(model=preset, block_size=16, prefill_chunk_tokens=512 if gpu else 64,
                          device=str(device), dtype="bfloat16" if gpu else "float32",
                          attn_implementation="sdpa" if gpu else "eager")
    model = load_model(preset, device=str(device), dtype=config.dtype,
                       attn_implementation=config.attn_implementation, num_threads=None)
    kv_per_token = model.shape.num_layers * 2 * model.shape.num_kv_heads * \
        model.shape.head_dim * (2 if gpu else 4)
    proc, node = start_node_process(sum(lengths) * kv_per_token * 3 // 2 + (256 << 20),
                                    "breakdown", max_workers=8)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if gpu else "cpu"}
    try:
        Engine(model, None, config).prefill([7] * 600, sampling=FIRST_TOKEN)  # warm-up
        for n in lengths:
            setup = prepare(model, config, node, n)
            try:
                for name in args.variants.split(","):
                    got = run_variant(setup, name, args.repeats)
                    out[f"{n}/{name}"] = got
                    phases = "  ".join(f"{k} {s:.1f}+{d:.1f}"
                                       for k, (s, d) in got["phases"].items() if k != "request")
                    print(f"{n:>6} {name:<17} median {got['ttft_median_ms']:7.1f} best "
                          f"{got['ttft_best_ms']:7.1f} | {phases}", flush=True)
            finally:
                for store in setup.stores.values():
                    store.close()
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=60)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
