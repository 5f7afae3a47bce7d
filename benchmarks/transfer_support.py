"""What the transfer benchmarks share: test blocks, timing in turns, the product read path.

``bench_transfer`` (plain node against raw TCP, Redis and memcpy) and ``bench_transfer_secure``
(the same product path against a node with auth, TLS and keyed blocks) measure with the same
blocks and the same timing, so their figures compare.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kvstore.api import FetchedBlock, Miss, NodeAddress
from kvstore.block import block_nbytes, encode_block_into
from kvstore.client.cluster_store import ClusterStore
from kvstore.config import ClientConfig
from kvstore.index.base import IndexEntry
from kvstore.index.memory import InMemoryIndex
from kvstore.keys import BlockHasher, Namespace

ROOT = Path(__file__).resolve().parent.parent
# A plain store node in a process of its own (another process, as a worker meets one), until
# its stdin closes: it prints its gRPC port, bulk port and arena path.
NODE_SERVER = """
import sys
from kvstore.config import ServerConfig
from kvstore.node.block_pool import BlockPool
from kvstore.node.store_server import StoreServer
pool = BlockPool(int(sys.argv[1]))
srv = StoreServer(pool, sys.argv[2], ServerConfig(max_workers=int(sys.argv[3])))
g, b = srv.start()
print(g, b, pool.path, flush=True)
sys.stdin.read()
srv.stop(0)
pool.close()
"""


def start_node_process(capacity: int, node_id: str = "bench", max_workers: int = 4
                       ) -> tuple[subprocess.Popen[str], NodeAddress]:
    """A store node of ``capacity`` bytes in another process; close its stdin to stop it."""
    proc = subprocess.Popen([sys.executable, "-c", NODE_SERVER, str(capacity), node_id,
                             str(max_workers)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))})
    assert proc.stdout is not None
    grpc_port, bulk_port, shm_path = proc.stdout.readline().split()
    return proc, NodeAddress(node_id, f"127.0.0.1:{grpc_port}", f"127.0.0.1:{bulk_port}",
                             shm_path)


def make_blocks(ns: Namespace, num: int) -> tuple[list[bytes], list[bytearray]]:
    tokens = torch.arange(num * ns.block_size).tolist()
    keys = BlockHasher(ns).block_keys(tokens)
    base = torch.randn(ns.payload_shape).to(ns.torch_dtype)
    blocks = []
    parent = ns.root
    for i, key in enumerate(keys):
        buf = bytearray(block_nbytes(ns))
        base.view(-1)[i % base.numel()] = float(i)  # every block differs
        encode_block_into(buf, ns, key, parent, tokens[i * ns.block_size:(i + 1) * ns.block_size],
                          base)
        blocks.append(buf)
        parent = key
    return list(keys), blocks


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def race(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best time of each ``fn``, run in turns (one of each per round) so that every contender
    sees the same background load: on a shared machine, a ratio is fair only this way."""
    for fn in fns.values():
        fn()  # warm-up: connections, page faults, caches
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def cluster_store(addr: NodeAddress, ns: Namespace, keys: list[bytes], reader_node: str,
                  config: ClientConfig | None = None) -> ClusterStore:
    """A ClusterStore whose index lists ``keys`` on the bench node; same node when
    ``reader_node`` is that node's id (shared memory), else remote (bulk). ``config``: the
    client's settings (a secure node's token and CA), by default plain with a long timeout."""
    index = InMemoryIndex()
    parents = [ns.root, *keys[:-1]]
    index.publish([IndexEntry(k, addr.node_id, block_nbytes(ns), p, ns.root)
                   for k, p in zip(keys, parents, strict=True)])
    return ClusterStore(addr.node_id, index, lambda node: addr,
                        config or ClientConfig(timeout_s=120), local_node_id=reader_node)


def store_fetch(store: ClusterStore, ns: Namespace, keys: list[bytes], tokens: list[list[int]],
                batch: int, out: torch.Tensor | None, device: torch.device | str | None = None
                ) -> None:
    """Every block through the product path, ``batch`` at a time; into ``out`` if given,
    else ``batch_get`` (a fresh tensor per batch; on ``device`` if given: a GPU benchmark
    times ``device="cuda"`` against ``None`` with this)."""
    for i in range(0, len(keys), batch):
        ks, ts = keys[i:i + batch], tokens[i:i + batch]
        got = store.batch_get(ns, ks, ts, device=device) if out is None \
            else store.batch_get_into(ns, ks, ts, out)
        if not all(isinstance(g, FetchedBlock) for g in got):
            raise RuntimeError(f"bench fetch missed: {[g for g in got if isinstance(g, Miss)][:1]}")


def block_tokens(ns: Namespace, num: int) -> list[list[int]]:
    tokens = torch.arange(num * ns.block_size).tolist()
    return [tokens[i * ns.block_size:(i + 1) * ns.block_size] for i in range(num)]
