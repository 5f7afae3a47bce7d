"""Coordinator: batched LRU touches per second and memory per indexed block, vs plain Python.

Memory is the whole embedded coordinator (``CoordinatorCore`` with its default in-memory index,
the ``TableIndex`` over the LRU table, plus every side map), measured with tracemalloc after
publishing the blocks through ``publish`` as store nodes do; the harness's own key lists are
built before tracing starts, so they are not counted. Baselines, measured in the same run: the
same blocks in a plain dict (key -> (holders, nbytes, parent, last use)), the previous layout
(an ``InMemoryIndex`` of dicts and sets beside the LRU table), an ``OrderedDict`` LRU doing the
same touches (``move_to_end`` per key), and ``InMemoryIndex.lookup_prefix`` for the lookup on
every request's path. Also the Ray actor round trip of an empty call and of a heartbeat batch.

    python benchmarks/bench_coordinator.py [--quick] [--json PATH] [--no-ray]
"""

from __future__ import annotations

import gc
import os
import time
import tracemalloc
from collections import OrderedDict
from typing import Any

import numpy as np

from benchmarks.common import median_of, parse_args, report
from kvstore.api import NodeAddress, PoolStats
from kvstore.config import CoordinatorConfig, KVStoreConfig
from kvstore.coordinator.core import CoordinatorCore
from kvstore.coordinator.lru import LRUTable
from kvstore.index.base import Index, IndexEntry
from kvstore.index.memory import InMemoryIndex

BATCH = 1000
PREFIX = 128  # blocks in the longest-prefix lookup (a 2k-token prompt at block_size 16)
ROOT = bytes(32)


def make_keys(n: int, seed: int = 0) -> list[bytes]:
    raw = np.random.default_rng(seed).bytes(32 * n)
    return [raw[i * 32:(i + 1) * 32] for i in range(n)]


def traced(build: Any) -> tuple[Any, int]:
    """What ``build()`` leaves allocated, in bytes (tracemalloc)."""
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    obj = build()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return obj, after - before


def build_core(keys: list[bytes], parents: list[bytes], index: Index | None = None
               ) -> CoordinatorCore:
    """A coordinator holding ``keys`` as one chain on one node, published in batches."""
    # The baselines take longer than a node timeout to build: the node must not be declared
    # dead meanwhile (its blocks would leave the table and the touches would find nothing).
    config = KVStoreConfig(coordinator=CoordinatorConfig(node_timeout_s=1e9))
    core = CoordinatorCore(config, index=index)
    core.register_node("n0", NodeAddress("n0", "n0:1"), 1 << 50, [])
    for i in range(0, len(keys), BATCH):
        # fresh key copies, as a coordinator fed from the network holds its own bytes objects
        core.publish("n0", [IndexEntry(bytes(bytearray(k)), "n0", 1 << 20, p, ROOT)
                            for k, p in zip(keys[i:i + BATCH], parents[i:i + BATCH],
                                            strict=True)])
    return core


def build_dict(keys: list[bytes]) -> dict[bytes, list[Any]]:
    # Fresh key copies, as a table fed from the network would hold: its own bytes objects.
    d: dict[bytes, list[Any]] = {}
    parent = ROOT
    for i, k in enumerate(keys):
        d[bytes(bytearray(k))] = [1, 1 << 20, parent, i]
        parent = k
    return d


def touch_batches(keys: list[bytes], num_touches: int) -> list[list[bytes]]:
    idx = np.random.default_rng(1).integers(0, len(keys), num_touches)
    return [[keys[j] for j in idx[i:i + BATCH]] for i in range(0, num_touches, BATCH)]


def bench_core_touches(core: CoordinatorCore, batches: list[list[bytes]]) -> float:
    stats = PoolStats(1 << 50, 0, core.lru.num_blocks, 0, 0, 0, 0, 0)
    t0 = time.perf_counter()
    for batch in batches:
        core.heartbeat("n0", stats, batch, {})
    elapsed = time.perf_counter() - t0
    assert core.lru.num_blocks == stats.num_blocks, "the node timed out: touches found nothing"
    return sum(map(len, batches)) / elapsed


def bench_table_touches(table: LRUTable, batches: list[list[bytes]]) -> float:
    t0 = time.perf_counter()
    for batch in batches:
        table.touch(batch)
    return sum(map(len, batches)) / (time.perf_counter() - t0)


def bench_lookup(index: Index, keys: list[bytes], repeats: int) -> float:
    """Median seconds of one longest-prefix lookup of ``PREFIX`` cached keys."""
    prefix = keys[:PREFIX]
    assert index.lookup_prefix(prefix).num_blocks == PREFIX
    return median_of(lambda: index.lookup_prefix(prefix), repeats, warmup=20)


def bench_ordereddict(keys: list[bytes], batches: list[list[bytes]]) -> float:
    lru: OrderedDict[bytes, int] = OrderedDict((k, 1 << 20) for k in keys)
    t0 = time.perf_counter()
    for batch in batches:
        for k in batch:
            if k in lru:
                lru.move_to_end(k)
    return sum(map(len, batches)) / (time.perf_counter() - t0)


def bench_ray(keys: list[bytes], repeats: int) -> dict[str, float]:
    import ray

    from kvstore.cluster.address import auth_mode_for_private_ray
    from kvstore.cluster.head import keep_loopback_address
    from kvstore.coordinator.actor import Coordinator

    # a private instance: its auth mode decided here, as kvstore decides it (no warning)
    os.environ.setdefault("RAY_AUTH_MODE", auth_mode_for_private_ray())
    keep_loopback_address()  # a private Ray, as kvstore starts one: on loopback only
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        # Any: the actor handle's methods are typed as the plain class's, without .remote.
        actor: Any = ray.remote(Coordinator).options(num_cpus=0).remote(KVStoreConfig())
        entries = [IndexEntry(k, "n0", 1 << 20, ROOT, ROOT) for k in keys[:10_000]]
        ray.get(actor.register_node.remote("n0", NodeAddress("n0", "n0:1"), 1 << 50, entries))
        stats = PoolStats(1 << 50, 0, len(entries), 0, 0, 0, 0, 0)
        batch = keys[:BATCH]
        ping = median_of(lambda: ray.get(actor.ping.remote()), repeats, warmup=5)
        beat = median_of(lambda: ray.get(actor.heartbeat.remote("n0", stats, batch, {})),
                         repeats, warmup=5)
        return {"ray_call_ms": ping * 1e3, "ray_heartbeat_batch_ms": beat * 1e3,
                "ray_touches_per_s": BATCH / beat}
    finally:
        ray.shutdown()


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], lambda p: p.add_argument(
        "--no-ray", action="store_true", help="skip the actor round-trip measurement"))
    num_blocks = 100_000 if args.quick else 200_000
    num_touches = 200_000 if args.quick else 1_000_000
    keys = make_keys(num_blocks)
    parents = [ROOT, *keys[:-1]]
    core, core_bytes = traced(lambda: build_core(keys, parents))
    _, old_bytes = traced(lambda: build_core(keys, parents, index=InMemoryIndex()))
    _, dict_bytes = traced(lambda: build_dict(keys))
    ours_b, old_b = core_bytes / num_blocks, old_bytes / num_blocks
    dict_b, table_b = dict_bytes / num_blocks, core.lru.nbytes_used() / num_blocks
    batches = touch_batches(keys, num_touches)
    core_tps = bench_core_touches(core, batches)
    table_tps = bench_table_touches(core.lru, batches)
    od_tps = bench_ordereddict(keys, batches)
    repeats = 200 if args.quick else 1000
    look_s = bench_lookup(core.index, keys, repeats)
    dict_index = InMemoryIndex()
    dict_index.publish([IndexEntry(k, "n0", 1 << 20, p, ROOT)
                        for k, p in zip(keys[:PREFIX], parents, strict=False)])
    dict_look_s = bench_lookup(dict_index, keys, repeats)
    figures: dict[str, Any] = {
        "num_blocks": num_blocks, "num_touches": num_touches, "batch": BATCH,
        "touches_per_s": core_tps, "table_touches_per_s": table_tps,
        "ordereddict_touches_per_s": od_tps,
        "ratio_touches_vs_ordereddict": core_tps / od_tps,
        "ratio_table_touches_vs_ordereddict": table_tps / od_tps,
        "index_bytes_per_block": ours_b, "table_arrays_bytes_per_block": table_b,
        "dict_bytes_per_block": dict_b, "dict_index_core_bytes_per_block": old_b,
        "ratio_memory_vs_dict": dict_b / ours_b,
        "ratio_memory_vs_dict_index_core": old_b / ours_b,
        "lookup_prefix_blocks": PREFIX, "lookup_prefix_us": look_s * 1e6,
        "dict_index_lookup_prefix_us": dict_look_s * 1e6,
        "ratio_lookup_prefix_vs_dict_index": dict_look_s / look_s,
    }
    rows = [
        ("blocks indexed", f"{num_blocks:,}", ""),
        ("touches/s via core heartbeat (embedded)", f"{core_tps:,.0f}", ">= 100,000"),
        ("touches/s, LRU table alone", f"{table_tps:,.0f}", f"OrderedDict {od_tps:,.0f}"),
        ("ratio core touches vs OrderedDict", f"{core_tps / od_tps:.2f}x", ""),
        ("coordinator bytes per block (whole core)", f"{ours_b:.0f}",
         f"<= 200; dict {dict_b:.0f}"),
        ("  of which the table's arrays", f"{table_b:.0f}", ""),
        ("previous layout (dict index + table)", f"{old_b:.0f}",
         f"{old_b / ours_b:.2f}x ours"),
        ("ratio memory vs dict", f"{dict_b / ours_b:.2f}x", ""),
        (f"lookup_prefix of {PREFIX} blocks (median)", f"{look_s * 1e6:.0f} us",
         f"InMemoryIndex {dict_look_s * 1e6:.0f} us"),
    ]
    if not args.no_ray:
        ray_fig = bench_ray(keys, 50 if args.quick else 300)
        figures.update(ray_fig)
        beat_ms = ray_fig["ray_heartbeat_batch_ms"]
        rows += [("Ray actor call, empty (median)", f"{ray_fig['ray_call_ms']:.2f} ms", ""),
                 (f"Ray heartbeat with {BATCH} touches", f"{beat_ms:.2f} ms",
                  f"{ray_fig['ray_touches_per_s']:,.0f} touches/s")]
    report("coordinator: cluster LRU", rows, figures, args.json)


if __name__ == "__main__":
    main()
