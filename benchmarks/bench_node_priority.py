"""A lease's round trip when the store node's core is busy: at Ray's worker niceness vs normal.

Ray starts its workers, the store node's actor among them, at nice 15 so that a busy task
never starves its control plane. A store node is a server on its readers' path: a vLLM
scheduler asks it for a lease before every warm request. Here a node runs in a process of its
own on one core, as Ray starts it (nice 15), and a reader on another core leases the same
64 blocks over and over (``ClusterStore.lease_prefix``, the scheduler's call; the mean round
trip, which counts the stalls a median hides), three ways:

1. the node's core otherwise idle: the baseline;
2. a process of normal priority keeping the node's core busy (as a vLLM engine polling for its
   worker, or a forward on all cores, would), the node still at nice 15;
3. the same, after the node raised its own priority as the actor does at start
   (``process_priority.serve_at_normal_priority``).

``ratio_lease_busy_core_vs_idle`` is 3 over 1 (what a busy core costs the node as it runs);
``ratio_lease_busy_core_niced_vs_idle`` is 2 over 1 (what it would cost at Ray's niceness).
Needs two cores and the right to raise a priority (root or CAP_SYS_NICE).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from benchmarks.common import parse_args, report

RAY_WORKER_NICENESS = 15
BLOCKS = 64


def _node(conn: Any, core: int) -> None:
    """The node's process: pinned to ``core`` at Ray's niceness; raises its priority when
    told to, answers where it listens."""
    from kvstore.config import ServerConfig
    from kvstore.node.block_pool import BlockPool
    from kvstore.node.store_server import StoreServer
    from kvstore.process_priority import serve_at_normal_priority

    os.sched_setaffinity(0, {core})
    os.nice(RAY_WORKER_NICENESS)
    pool = BlockPool(256 << 20)
    server = StoreServer(pool, "node-a", ServerConfig())
    server.start()
    conn.send((server.addresses, pool.path))
    while (ask := conn.recv()) is not None:
        conn.send(serve_at_normal_priority("the store node") if ask == "normal" else None)
    server.stop(0)
    pool.close()


def _spinner(core: int) -> subprocess.Popen[bytes]:
    """A process of normal priority that keeps ``core`` busy."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"],
                            preexec_fn=lambda: os.sched_setaffinity(0, {core}))


def _lease_times(store: Any, namespace: Any, keys: list[bytes], n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        hit, lease = store.lease_prefix(namespace, keys)
        out.append(time.perf_counter() - start)
        store.release_lease(lease)
    assert hit.num_blocks == len(keys), hit
    return out


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 or os.geteuid() != 0:
        raise SystemExit("bench_node_priority needs two cores and root (to raise a priority)")
    from kvstore.api import BlockPut
    from kvstore.client.cluster_store import ClusterStore
    from kvstore.config import ClientConfig
    from kvstore.index.memory import InMemoryIndex
    from kvstore.keys import BlockHasher, Namespace
    from kvstore.records import NodeAddress

    node_core, reader_core = cores[-1], cores[0]
    os.sched_setaffinity(0, {reader_core})
    namespace = Namespace("bench", "float16", 32, 30, 3, 64)
    tokens = list(range(1000, 1000 + 32 * BLOCKS))
    keys = [bytes(k) for k in BlockHasher(namespace).block_keys(tokens)]
    here, there = mp.Pipe()
    node = mp.get_context("spawn").Process(target=_node, args=(there, node_core), daemon=True)
    node.start()
    spinner = None
    try:
        (grpc_address, bulk_address), path = here.recv()
        store = ClusterStore("node-a", InMemoryIndex(),
                             {"node-a": NodeAddress("node-a", grpc_address, bulk_address,
                                                    path)}.__getitem__,
                             ClientConfig(timeout_s=30, retries=1))
        payload = torch.zeros(namespace.payload_shape, dtype=torch.float16)
        parents = [namespace.root, *keys[:-1]]
        store.batch_put(namespace, [BlockPut(k, p, tokens[i * 32:(i + 1) * 32], payload)
                                    for i, (k, p) in enumerate(zip(keys, parents,
                                                                   strict=True))])
        n = 40 if args.quick else 200
        _lease_times(store, namespace, keys, 20)  # connections up, caches warm
        idle = statistics.mean(_lease_times(store, namespace, keys, n))
        spinner = _spinner(node_core)
        time.sleep(0.5)
        niced = statistics.mean(_lease_times(store, namespace, keys, max(10, n // 4)))
        here.send("normal")
        if not here.recv():
            raise SystemExit("the node could not raise its priority")
        normal = statistics.mean(_lease_times(store, namespace, keys, n))
        store.close()
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
        here.send(None)
        node.join(30)
    figures = {"blocks_per_lease": BLOCKS, "lease_idle_core_us": idle * 1e6,
               "lease_busy_core_niced_us": niced * 1e6, "lease_busy_core_us": normal * 1e6,
               "ratio_lease_busy_core_vs_idle": normal / idle,
               "ratio_lease_busy_core_niced_vs_idle": niced / idle}
    report("A lease's round trip, the node's core busy with a process of normal priority", [
        ("lease, the node's core idle (us)", f"{idle * 1e6:.0f}", "the baseline"),
        ("lease, core busy, node at Ray's nice 15 (us)", f"{niced * 1e6:.0f}",
         f"{niced / idle:.1f}x the baseline"),
        ("lease, core busy, node at normal priority (us)", f"{normal * 1e6:.0f}",
         f"{normal / idle:.1f}x the baseline"),
    ], figures, args.json)


if __name__ == "__main__":
    main()
