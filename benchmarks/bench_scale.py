"""Coordinator at cluster scale: 1,024 store nodes and 10 M blocks in the core, without Ray.

Fake nodes and a fake clock drive ``CoordinatorCore`` (embedded index: the LRU table is the
index) as store nodes would: every node holds chains of 16 blocks, one chain in ten is also on
the next node and one in a thousand on eight more (past the four inline holder lanes), then
every node heartbeats once per simulated second. Measured:

- memory per block: tracemalloc over building the whole core (arrays, holder sets, per-node
  lists, hash table, Python side maps), and the table's own ``nbytes_used`` accounting;
- heartbeats processed per second (each with 128 touches, below the high watermark);
- eviction planning: heartbeats reporting use over the high watermark, each planning the
  node's evictions down to the low one (p50/p99 ms); the fake node then reports the blocks
  removed and publishes as many new ones through ``publish`` (blocks/s of each);
- dropping a node (``remove_node``), and the baseline the per-node slot lists replace: a
  scan of every block's holder lanes for one node's blocks.

Each heartbeat is timed in wall-clock and in this thread's CPU time: on a shared machine the
wall-clock tail is other processes preempting this one (CPU p99 stays near p50), so both are
reported.

    python benchmarks/bench_scale.py [--quick] [--json PATH] [--nodes N] [--blocks N]
"""

from __future__ import annotations

import gc
import resource
import time
import tracemalloc
from typing import Any

import numpy as np

from benchmarks.common import parse_args, report
from kvstore.api import NodeAddress, PoolStats
from kvstore.config import CoordinatorConfig, KVStoreConfig
from kvstore.coordinator.core import CoordinatorCore
from kvstore.index.base import IndexEntry

CHAIN = 16  # blocks per chain
BLOCK_NBYTES = 2048  # 64-token blocks of a small model
NUM_ROOTS = 16  # namespaces
TOUCHES = 128  # touched keys per heartbeat
HOT_EVERY, HOT_EXTRA = 1000, 8  # one chain in HOT_EVERY is also on HOT_EXTRA more nodes
REPLICA_EVERY = 10  # one chain in REPLICA_EVERY is also on the next node
FILL = 0.85  # a node's blocks fill this much of its capacity (high watermark 0.90)
PRESSURE = 0.92  # the use an over-watermark heartbeat reports


def as_list(rows: np.ndarray) -> list[bytes]:
    """``[n, 4]`` uint64 key rows as 32-byte ``bytes`` objects."""
    raw = np.ascontiguousarray(rows).tobytes()
    return [raw[i:i + 32] for i in range(0, len(raw), 32)]


class Cluster:
    """The fake store nodes: which key rows each holds, and the core they talk to."""

    def __init__(self, num_nodes: int, num_blocks: int, seed: int = 0) -> None:
        self.num_nodes, self.num_blocks = num_nodes, num_blocks // CHAIN * CHAIN
        self.rng = np.random.default_rng(seed)
        self.keys = self.rng.integers(0, 2**63, (self.num_blocks, 4), dtype=np.uint64)
        self.roots = self.rng.integers(0, 2**63, (NUM_ROOTS, 4), dtype=np.uint64)
        self.root_bytes = as_list(self.roots)
        self.names = [f"node-{i:04d}" for i in range(num_nodes)]
        self.now = 1000.0
        num_chains = self.num_blocks // CHAIN
        # node n's own chains are one contiguous range
        self.bounds = [n * num_chains // num_nodes * CHAIN for n in range(num_nodes + 1)]

    def clock(self) -> float:
        return self.now

    def holdings(self, node: int) -> np.ndarray:
        """Block indices node ``node`` holds: its own, replicas and hot chains."""
        lo, hi = self.bounds[node], self.bounds[node + 1]
        parts = [np.arange(lo, hi)]
        prev = (node - 1) % self.num_nodes
        plo, phi = self.bounds[prev], self.bounds[prev + 1]
        parts.append(chain_blocks(np.arange(plo // CHAIN, phi // CHAIN, REPLICA_EVERY)))
        for back in range(2, 2 + HOT_EXTRA):
            src = (node - back) % self.num_nodes
            slo, shi = self.bounds[src] // CHAIN, self.bounds[src + 1] // CHAIN
            first = -(-slo // HOT_EVERY) * HOT_EVERY
            parts.append(chain_blocks(np.arange(first, shi, HOT_EVERY)))
        return np.unique(np.concatenate(parts))

    def parents_of(self, blocks: np.ndarray) -> np.ndarray:
        rows = self.keys[np.maximum(blocks - 1, 0)]
        heads = blocks % CHAIN == 0
        rows[heads] = self.roots[(blocks[heads] // CHAIN) % NUM_ROOTS]
        return rows

    def build(self) -> tuple[CoordinatorCore, list[np.ndarray]]:
        """A core holding every node's blocks (published table-side in one batch per node)."""
        # 0.90/0.80, not the defaults: FILL and PRESSURE sit around these, and the planning
        # figures (a tenth of a node's blocks per over-watermark beat) are measured at them
        config = KVStoreConfig(coordinator=CoordinatorConfig(
            node_timeout_s=10.0, high_watermark=0.90, low_watermark=0.80))
        core = CoordinatorCore(config, clock=self.clock)
        held = []
        for n, name in enumerate(self.names):
            blocks = self.holdings(n)
            core.register_node(name, NodeAddress(name, f"{name}:1"),
                               int(len(blocks) * BLOCK_NBYTES / FILL), [])
            node = core.nodes.get(name)
            assert node is not None
            roots = [self.root_bytes[r] for r in ((blocks // CHAIN) % NUM_ROOTS).tolist()]
            core.lru.add(node.slot, as_list(self.keys[blocks]),
                         as_list(self.parents_of(blocks)), [BLOCK_NBYTES] * len(blocks), roots)
            held.append(blocks)
        return core, held


def chain_blocks(chains: np.ndarray) -> np.ndarray:
    return (chains[:, None] * CHAIN + np.arange(CHAIN)).ravel()


def stats(core: CoordinatorCore, name: str, fill: float) -> PoolStats:
    node = core.nodes.get(name)
    assert node is not None
    used = int(fill * node.capacity_bytes)
    return PoolStats(node.capacity_bytes, used, used // BLOCK_NBYTES, 0, 0, 0, 0, 0)


def percentiles(ms: list[float]) -> tuple[float, float]:
    return float(np.percentile(ms, 50)), float(np.percentile(ms, 99))


class Timer:
    """Wall-clock and thread-CPU milliseconds of each timed call."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def __enter__(self) -> Timer:
        self._t, self._c = time.perf_counter(), time.thread_time()
        return self

    def __exit__(self, *exc: object) -> None:
        self.cpu.append((time.thread_time() - self._c) * 1e3)
        self.wall.append((time.perf_counter() - self._t) * 1e3)

    def figures(self, name: str) -> dict[str, float]:
        p50, p99 = percentiles(self.wall)
        c50, c99 = percentiles(self.cpu)
        return {f"{name}_ms_p50": p50, f"{name}_ms_p99": p99,
                f"{name}_cpu_ms_p50": c50, f"{name}_cpu_ms_p99": c99}


def run_heartbeats(cluster: Cluster, core: CoordinatorCore, held: list[np.ndarray],
                   num_beats: int) -> Timer:
    """Plain heartbeats (touches, no planning), each node once per simulated second."""
    rng = np.random.default_rng(1)
    n = cluster.num_nodes
    touched = [as_list(cluster.keys[rng.choice(held[b % n], TOUCHES)]) for b in range(num_beats)]
    timer = Timer()
    for b in range(num_beats):
        name = cluster.names[b % n]
        cluster.now += 1.0 / n
        s = stats(core, name, FILL)
        with timer:
            core.heartbeat(name, s, touched[b], {})
    return timer


def run_evictions(cluster: Cluster, core: CoordinatorCore, num_beats: int
                  ) -> dict[str, Any]:
    """Over-watermark heartbeats; the node then removes what it was told and refills."""
    n = cluster.num_nodes
    timer, removed_s, publish_s, num_evicted = Timer(), 0.0, 0.0, 0
    fresh_rng = np.random.default_rng(2)
    for b in range(num_beats):
        name = cluster.names[b % n]
        cluster.now += 1.0 / n
        s = stats(core, name, PRESSURE)
        with timer:
            reply = core.heartbeat(name, s, [], {})
        evict = reply.evict
        num_evicted += len(evict)
        t0 = time.perf_counter()
        core.removed(name, evict)
        removed_s += time.perf_counter() - t0
        new = as_list(fresh_rng.integers(0, 2**63, (len(evict), 4), dtype=np.uint64))
        root = cluster.root_bytes[b % NUM_ROOTS]
        entries = [IndexEntry(k, name, BLOCK_NBYTES, p, root)
                   for k, p in zip(new, [root, *new[:-1]], strict=True)]
        t0 = time.perf_counter()
        core.publish(name, entries)
        publish_s += time.perf_counter() - t0
    return {**timer.figures("evict_plan"),
            "evict_blocks_per_plan": num_evicted / num_beats,
            "removed_blocks_per_s": num_evicted / removed_s,
            "publish_blocks_per_s": num_evicted / publish_s}


def time_drops(cluster: Cluster, core: CoordinatorCore, num: int) -> tuple[float, float]:
    """ms to drop a node with ``remove_node``, and ms for the full-scan baseline."""
    drop_ms, scan_ms = [], []
    lanes = core.lru.sets.lanes[: core.lru._next_slot]
    for name in cluster.names[-num:]:
        node = core.nodes.get(name)
        assert node is not None
        t0 = time.perf_counter()
        scanned = np.flatnonzero((lanes == node.slot + 1).any(axis=1))
        scan_ms.append((time.perf_counter() - t0) * 1e3)
        assert scanned.size <= core.lru.num_blocks_of(node.slot)  # spilled ones are extra
        t0 = time.perf_counter()
        core.remove_node(name)
        drop_ms.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(drop_ms)), float(np.median(scan_ms))


def main() -> None:
    def extra(p: Any) -> None:
        p.add_argument("--nodes", type=int, help="store nodes (1,024; --quick 128)")
        p.add_argument("--blocks", type=int, help="blocks (10 M; --quick 500k)")

    args = parse_args(__doc__.splitlines()[0], extra)
    num_nodes = args.nodes or (128 if args.quick else 1024)
    num_blocks = args.blocks or (500_000 if args.quick else 10_000_000)
    cluster = Cluster(num_nodes, num_blocks)  # the harness's keys: built before tracing
    gc.collect()
    tracemalloc.start()
    t0 = time.perf_counter()
    core, held = cluster.build()
    build_s = time.perf_counter() - t0
    traced = tracemalloc.get_traced_memory()[0] - sum(h.nbytes for h in held)
    tracemalloc.stop()
    lru = core.lru
    blocks = lru.num_blocks
    beats = run_heartbeats(cluster, core, held, 4 * num_nodes)
    evictions = run_evictions(cluster, core, num_nodes)
    drop_ms, scan_ms = time_drops(cluster, core, min(8, num_nodes))
    assert core.metrics["nodes_dead"] == 0, "a fake node timed out: the clock ran too fast"
    figures: dict[str, Any] = {
        "nodes": num_nodes, "blocks": blocks, "build_s": build_s,
        "mem_bytes_per_block": traced / blocks,
        "table_bytes_per_block": lru.nbytes_used() / blocks,
        "spilled_blocks": len(lru.sets.spill),
        "heartbeats_per_s": len(beats.wall) / (sum(beats.wall) / 1e3),
        "heartbeats_per_cpu_s": len(beats.cpu) / (sum(beats.cpu) / 1e3),
        **beats.figures("heartbeat"),
        **evictions,
        "drop_node_ms": drop_ms, "scan_slots_of_ms": scan_ms,
        "ratio_drop_vs_one_scan": scan_ms / drop_ms,
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    f = figures
    rows = [
        ("store nodes / blocks", f"{num_nodes:,} / {blocks:,}", f"built in {build_s:.0f} s"),
        ("memory per block (tracemalloc, whole core)", f"{f['mem_bytes_per_block']:.0f} B",
         "<= 200 B"),
        ("  table's own accounting", f"{f['table_bytes_per_block']:.0f} B",
         f"{f['spilled_blocks']:,} blocks with > 4 holders"),
        ("heartbeats/s (128 touches, no planning)", f"{f['heartbeats_per_s']:,.0f}",
         f"per CPU-second {f['heartbeats_per_cpu_s']:,.0f}; need {num_nodes:,}"),
        ("  heartbeat p50 / p99", f"{f['heartbeat_ms_p50']:.2f} / {f['heartbeat_ms_p99']:.2f} ms",
         f"CPU {f['heartbeat_cpu_ms_p50']:.2f} / {f['heartbeat_cpu_ms_p99']:.2f} ms"),
        ("heartbeat with eviction planning p50 / p99",
         f"{f['evict_plan_ms_p50']:.2f} / {f['evict_plan_ms_p99']:.2f} ms",
         f"CPU {f['evict_plan_cpu_ms_p50']:.2f} / {f['evict_plan_cpu_ms_p99']:.2f} ms"),
        ("  blocks ordered per plan", f"{f['evict_blocks_per_plan']:.0f}", ""),
        ("removed / published blocks/s",
         f"{f['removed_blocks_per_s']:,.0f} / {f['publish_blocks_per_s']:,.0f}", ""),
        ("drop a node (remove_node)", f"{drop_ms:.2f} ms",
         f"one scan of all lanes {scan_ms:.2f} ms"),
        ("max RSS", f"{f['max_rss_mib']:,.0f} MiB", ""),
    ]
    report("coordinator at scale (core, no Ray)", rows, figures, args.json)


if __name__ == "__main__":
    main()
