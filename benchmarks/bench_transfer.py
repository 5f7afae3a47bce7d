"""Block transfer: a store node in another process vs raw TCP, Redis and memcpy, in one run.

Remote reads use the bulk channel (sendfile from the arena, one scatter recv per request into
preallocated buffers); gRPC Get is measured too, since it is the fallback and the reason the
bulk channel exists. 64 KiB blocks are read both ways a caller can: one blocking call per 32
blocks (latency-bound), and one call whose 32-block requests are pipelined on one connection.
Same-node reads go through the product path, ``ClusterStore.batch_get_into`` / ``batch_get``
(lease, each block copied and its copy hashed while cache-hot, the blocks of a batch spread
over the verify pool's threads, release without waiting), for batches of 128 blocks (a
2048-token prompt at block_size 16) and 32, against memcpy of the same bytes into a destination
of the same size and reuse; and ``batch_get(..., device="cpu")`` (the device path: the leased
arena bytes verified, payloads copied into one fresh ``[n, *payload_shape]`` tensor) against
memcpy into fresh memory. Every figure is the best of a few repeats (the
least disturbed run on a shared machine). Then the product-path reads again, a plain node
against one with the cluster token, TLS and keyed blocks (``bench_transfer_secure``: what
security costs on the data path; ``--no-secure`` skips it).

    python -m benchmarks.bench_transfer [--quick] [--no-secure] [--json bench-results/transfer.json]
"""

from __future__ import annotations

import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
from redis.utils import HIREDIS_AVAILABLE

from benchmarks.bench_transfer_secure import bench_secure
from benchmarks.common import parse_args, report
from benchmarks.transfer_support import (
    block_tokens,
    cluster_store,
    gbps,
    make_blocks,
    race,
    start_node_process,
    store_fetch,
)
from kvstore.client.block_buffers import new_block_buffer
from kvstore.client.node_client import StoreNodeClient
from kvstore.config import ClientConfig
from kvstore.index.base import IndexEntry
from kvstore.index.redis import RedisIndex
from kvstore.keys import BlockHasher, Namespace
from tests.support.redis_server import RedisProcess, start_redis_server

ROOT = Path(__file__).resolve().parent.parent
NS_2MIB = Namespace("bench", "float16", 16, 32, 8, 128)  # 2 MiB payload
NS_64KIB = Namespace("bench", "float16", 16, 1, 8, 128)  # 64 KiB payload

# Per request byte, sends the next `n` bytes of a `total`-byte buffer (wrapping): like the store,
# it sends distinct, cache-cold memory, not the same cache-hot bytes every time.
TCP_SENDER = """
import socket, sys
n, total = int(sys.argv[1]), int(sys.argv[2])
lst = socket.create_server(("127.0.0.1", 0))
print(lst.getsockname()[1], flush=True)
conn, _ = lst.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
data = memoryview(bytearray(b"x" * total))
off = 0
while conn.recv(1):
    conn.sendall(data[off:off + n])
    off = (off + n) % total
"""


def fetch_all(client: StoreNodeClient, keys: list[bytes], bufs: list[bytearray], batch: int
              ) -> None:
    for i in range(0, len(keys), batch):
        sizes = client.get_blocks_into(keys[i:i + batch], bufs[i:i + batch])
        assert None not in sizes


class RawTcp:
    """A loopback sender in another process: per request byte, ``total`` bytes back, read with
    one ``recv_into`` per block (the bulk channel's traffic without its protocol or lease)."""

    def __init__(self, total: int, source_nbytes: int) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", TCP_SENDER, str(total),
                                      str(source_nbytes)],
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.sock = socket.create_connection(("127.0.0.1", int(self.proc.stdout.readline())))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.total = total

    def run(self, dsts: list[bytearray]) -> None:
        """Fill ``dsts`` (the same buffers the store is read into: a cache-hot destination
        would flatter the baseline), ``total`` bytes per request."""
        views = [memoryview(d) for d in dsts]
        per_request = self.total // len(views[0])
        for lo in range(0, len(views), per_request):
            self.sock.sendall(b"?")
            for b in views[lo:lo + per_request]:
                got, n = 0, len(b)
                while got < n:
                    got += self.sock.recv_into(b[got:], n - got, socket.MSG_WAITALL)

    def close(self) -> None:
        self.sock.close()
        self.proc.kill()
        self.proc.wait()


def memcpy_batches(src: np.ndarray, batch_nbytes: int, fresh: bool) -> Callable[[], None]:
    """Copy ``src`` in ``batch_nbytes`` pieces into one reused destination, or a new one per
    piece: the baseline for the same-node path with the same buffer policy."""
    dst = np.empty(batch_nbytes, np.uint8)

    def run() -> None:
        for lo in range(0, src.size, batch_nbytes):
            piece = src[lo:lo + batch_nbytes]
            out = np.empty(piece.size, np.uint8) if fresh else dst[:piece.size]
            np.copyto(out, piece)

    return run


# -- the index against its floor: a 2,048-key lookup vs one MGET of the same keys ---------------


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median time of each ``fn``, run in turns so every contender sees the same load."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def lookup_chain(salt: str, num: int = 2048) -> tuple[bytes, list[bytes]]:
    """A namespace root and ``num`` chained keys (distinct per ``salt``)."""
    ns = Namespace("bench-lookup", "float16", 16, 1, 1, 8, cache_salt=salt)
    return ns.root, list(BlockHasher(ns).block_keys(list(range(num * ns.block_size))))


def chain_entries(root: bytes, keys: list[bytes], node_id: str) -> list[IndexEntry]:
    parents = [root, *keys[:-1]]
    return [IndexEntry(k, node_id, 1024, p, root) for k, p in zip(keys, parents, strict=True)]


def bench_lookup(server: RedisProcess, repeats: int) -> dict[str, float]:
    """``RedisIndex.lookup_prefix`` of 2,048 keys against one ``MGET`` of the same 2,048 keys
    (same server, client library, connection type and reply parser), for a full hit, a hit of
    half the chain and a miss on the first key; then index publishes in batches of 200."""
    index = RedisIndex(server.url, key_prefix="bench-lookup:")
    r = server.client()
    root, full = lookup_chain("full")
    half_root, half = lookup_chain("half")
    index.publish(chain_entries(root, full, "bench-node-0"))
    index.publish(chain_entries(half_root, half[:1024], "bench-node-0"))
    r.mset({k: b"bench-node-0" for k in full + half[:1024]})  # the MGET's values: same size
    miss = [lookup_chain("miss", 1)[1][0], *full[1:]]  # first key unknown: a hit of 0

    def check(keys: list[bytes], expected: int) -> Callable[[], None]:
        def run() -> None:
            assert index.lookup_prefix(keys).num_blocks == expected
        return run

    t = interleaved_medians({
        "lookup_full": check(full, 2048), "mget_full": partial(r.mget, full),
        "lookup_half": check(half, 1024), "mget_half": partial(r.mget, half),
        "lookup_miss": check(miss, 0), "mget_miss": partial(r.mget, miss),
    }, repeats)
    assert index.lookup_prefix(full).holders == [["bench-node-0"]] * 2048

    batches = [chain_entries(*lookup_chain(f"pub-{i}", 2000), "bench-node-1")
               for i in range(repeats)]
    publish_s = []
    for entries in batches:
        t0 = time.perf_counter()
        for lo in range(0, len(entries), 200):
            index.publish(entries[lo:lo + 200])
        publish_s.append(time.perf_counter() - t0)
    index.clear()
    index.close()
    r.close()
    return {
        "redis_lookup_2048_p50_ms": t["lookup_full"] * 1e3,
        "redis_mget_2048_p50_ms": t["mget_full"] * 1e3,
        "ratio_lookup_vs_mget_2048": t["lookup_full"] / t["mget_full"],
        "ratio_lookup_vs_mget_2048_half_hit": t["lookup_half"] / t["mget_half"],
        "ratio_lookup_vs_mget_2048_miss_first": t["lookup_miss"] / t["mget_miss"],
        "redis_publish_blocks_per_s_batch200": 2000 / statistics.median(publish_s),
    }


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], lambda p: p.add_argument(
        "--no-secure", action="store_true",
        help="skip the plain vs secure node arm (auth token, TLS, keyed blocks)"))
    n_big, n_small = (64, 256) if args.quick else (256, 1024)
    repeats = 3 if args.quick else 7
    big_keys, big_blocks = make_blocks(NS_2MIB, n_big)
    small_keys, small_blocks = make_blocks(NS_64KIB, n_small)
    big_tokens, small_tokens = block_tokens(NS_2MIB, n_big), block_tokens(NS_64KIB, n_small)
    big_nb, small_nb = len(big_blocks[0]), len(small_blocks[0])
    total_big, total_small = big_nb * n_big, small_nb * n_small
    capacity = total_big + total_small + (64 << 20)
    proc, node = start_node_process(capacity)
    assert proc.stdin is not None
    cfg = ClientConfig(timeout_s=120)
    grpc_addr, bulk_addr = node.grpc_address, node.bulk_address
    assert bulk_addr is not None
    redis = start_redis_server()
    tcp_big, tcp_small = RawTcp(32 * big_nb, total_big), RawTcp(32 * small_nb, total_small)
    t: dict[str, float] = {}
    try:
        bulk = StoreNodeClient(grpc_addr, bulk_address=bulk_addr, config=cfg)
        plain = StoreNodeClient(grpc_addr, config=cfg)
        for i in range(0, n_big, 16):
            bulk.put_blocks(NS_2MIB, list(zip(big_keys[i:i + 16], big_blocks[i:i + 16],
                                              strict=True)))
        bulk.put_blocks(NS_64KIB, list(zip(small_keys, small_blocks, strict=True)))
        r = redis.client()
        for k, b in zip(big_keys, big_blocks, strict=True):
            r.set(k, bytes(b))
        for k, b in zip(small_keys, small_blocks, strict=True):
            r.set(k, bytes(b))

        def redis_fetch(keys: list[bytes]) -> None:
            for i in range(0, len(keys), 32):
                assert None not in r.mget(keys[i:i + 32])

        # -- remote: every contender in turns ------------------------------------------------
        big_bufs = [bytearray(big_nb) for _ in range(n_big)]
        t |= {f"{k}_big": v for k, v in race({
            "bulk": lambda: fetch_all(bulk, big_keys, big_bufs, 32),
            "tcp": lambda: tcp_big.run(big_bufs),
            "redis": lambda: redis_fetch(big_keys),
            "grpc": lambda: fetch_all(plain, big_keys, big_bufs, 32),
        }, repeats).items()}
        fetch_all(bulk, big_keys, big_bufs, 32)
        assert big_bufs == big_blocks
        small_bufs = [bytearray(small_nb) for _ in range(n_small)]
        remote = cluster_store(node, NS_64KIB, small_keys, "another-node")
        remote_out = new_block_buffer(NS_64KIB, 128)
        t |= {f"{k}_small": v for k, v in race({
            # One call: the client sends requests of 32 blocks, 4 in flight on one connection.
            "bulk": lambda: fetch_all(bulk, small_keys, small_bufs, n_small),
            "bulk_seq": lambda: fetch_all(bulk, small_keys, small_bufs, 32),
            "store": lambda: store_fetch(remote, NS_64KIB, small_keys, small_tokens, 128,
                                         remote_out),
            "tcp": lambda: tcp_small.run(small_bufs),
            "redis": lambda: redis_fetch(small_keys),
            "grpc": lambda: fetch_all(plain, small_keys, small_bufs, 32),
        }, repeats).items()}
        fetch_all(bulk, small_keys, small_bufs, n_small)
        assert small_bufs == small_blocks
        remote.close()
        big_bufs, small_bufs = [], []  # free 600 MiB before the same-node runs
        r.flushall()  # the lookup below should not share memory with 600 MiB of blocks

        # -- same node: the product path vs memcpy with the same buffer policy ---------------
        src = np.frombuffer(bytearray(total_big), np.uint8)
        local = cluster_store(node, NS_2MIB, big_keys, "bench")
        for batch in (128, 32):
            out = new_block_buffer(NS_2MIB, batch)
            t |= {f"{k}_{batch}": v for k, v in race({
                "memcpy": memcpy_batches(src, batch * big_nb, False),
                "shm": partial(store_fetch, local, NS_2MIB, big_keys, big_tokens, batch, out),
            }, repeats).items()}
            assert bytes(out[(n_big - 1) % batch].numpy()) == big_blocks[n_big - 1]
        t |= {f"{k}_fresh_128": v for k, v in race({
            "memcpy": memcpy_batches(src, 128 * big_nb, True),
            "shm": partial(store_fetch, local, NS_2MIB, big_keys, big_tokens, 128, None),
            "device_cpu": partial(store_fetch, local, NS_2MIB, big_keys, big_tokens, 128, None,
                                  "cpu"),
        }, repeats).items()}
        local.close()
        del src

        lookup_figures = bench_lookup(redis, 20 if args.quick else 50)
        bulk.close()
        plain.close()
    finally:
        tcp_big.close()
        tcp_small.close()
        redis.stop()
        proc.stdin.close()
        proc.wait(timeout=30)

    big, small = (lambda k: gbps(total_big, t[k])), (lambda k: gbps(total_small, t[k]))
    figures: dict[str, float] = {
        "remote_gbps_2mib": big("bulk_big"),
        "grpc_gbps_2mib": big("grpc_big"),
        "tcp_gbps_2mib": big("tcp_big"),
        "redis_gbps_2mib": big("redis_big"),
        "remote_gbps_64kib_batch32": small("bulk_small"),
        "remote_gbps_64kib_seq32": small("bulk_seq_small"),
        "remote_verified_gbps_64kib_batch128": small("store_small"),
        "tcp_gbps_64kib_batch32": small("tcp_small"),
        "grpc_gbps_64kib_batch32": small("grpc_small"),
        "redis_gbps_64kib_batch32": small("redis_small"),
        "samenode_gbps_2mib": big("shm_128"),
        "samenode_gbps_2mib_batch32": big("shm_32"),
        "samenode_fresh_gbps_2mib": big("shm_fresh_128"),
        "samenode_device_cpu_gbps_2mib": big("device_cpu_fresh_128"),
        "memcpy_gbps_2mib": big("memcpy_128"),
        "memcpy_gbps_2mib_batch32": big("memcpy_32"),
        "memcpy_fresh_gbps_2mib": big("memcpy_fresh_128"),
        "ratio_remote_vs_redis_2mib": t["redis_big"] / t["bulk_big"],
        "ratio_remote_vs_tcp_2mib": t["tcp_big"] / t["bulk_big"],
        "ratio_grpc_vs_redis_2mib": t["redis_big"] / t["grpc_big"],
        "ratio_remote_vs_tcp_64kib": t["tcp_small"] / t["bulk_small"],
        "ratio_samenode_vs_memcpy_2mib": t["memcpy_128"] / t["shm_128"],
        "ratio_samenode_vs_memcpy_2mib_batch32": t["memcpy_32"] / t["shm_32"],
        "ratio_samenode_fresh_vs_memcpy_fresh_2mib": t["memcpy_fresh_128"] / t["shm_fresh_128"],
        "ratio_samenode_device_cpu_vs_memcpy_fresh_2mib":
            t["memcpy_fresh_128"] / t["device_cpu_fresh_128"],
        **lookup_figures,
        "redis_hiredis": float(HIREDIS_AVAILABLE),
        "num_blocks_2mib": n_big,
        "num_blocks_64kib": n_small,
    }
    f = figures
    parser = "hiredis" if HIREDIS_AVAILABLE else "pure-Python parser: pip install hiredis"
    rows = [
        ("remote bulk 2 MiB, calls of 32 (GB/s)", f"{f['remote_gbps_2mib']:.2f}",
         f"redis MGET {f['redis_gbps_2mib']:.2f} / tcp {f['tcp_gbps_2mib']:.2f}"),
        ("remote gRPC Get 2 MiB (GB/s)", f"{f['grpc_gbps_2mib']:.2f}", "(fallback path)"),
        ("ratio remote vs redis 2 MiB", f"{f['ratio_remote_vs_redis_2mib']:.2f}x", ">= 1.0x"),
        ("ratio remote vs raw tcp 2 MiB", f"{f['ratio_remote_vs_tcp_2mib']:.2f}x", "<= 1.0x"),
        ("remote bulk 64 KiB, requests of 32 pipelined (GB/s)",
         f"{f['remote_gbps_64kib_batch32']:.2f}",
         f">= 5 (tcp x32 {f['tcp_gbps_64kib_batch32']:.2f}, redis "
         f"{f['redis_gbps_64kib_batch32']:.2f}, gRPC {f['grpc_gbps_64kib_batch32']:.2f})"),
        ("remote bulk 64 KiB, one call per 32 (GB/s)", f"{f['remote_gbps_64kib_seq32']:.2f}",
         "latency-bound"),
        ("remote ClusterStore 64 KiB x128 + verify (GB/s)",
         f"{f['remote_verified_gbps_64kib_batch128']:.2f}", "the product path"),
        ("same-node batch_get_into x128, reused (GB/s)", f"{f['samenode_gbps_2mib']:.2f}",
         f"memcpy {f['memcpy_gbps_2mib']:.2f}"),
        ("ratio same-node vs memcpy x128", f"{f['ratio_samenode_vs_memcpy_2mib']:.2f}x",
         ">= 0.6x"),
        ("same-node batch_get_into x32, reused (GB/s)",
         f"{f['samenode_gbps_2mib_batch32']:.2f}",
         f"memcpy {f['memcpy_gbps_2mib_batch32']:.2f} "
         f"({f['ratio_samenode_vs_memcpy_2mib_batch32']:.2f}x)"),
        ("same-node batch_get x128, fresh buffers (GB/s)",
         f"{f['samenode_fresh_gbps_2mib']:.2f}",
         f"memcpy to fresh {f['memcpy_fresh_gbps_2mib']:.2f} "
         f"({f['ratio_samenode_fresh_vs_memcpy_fresh_2mib']:.2f}x)"),
        ("same-node batch_get(device='cpu') x128 (GB/s)",
         f"{f['samenode_device_cpu_gbps_2mib']:.2f}",
         f"memcpy to fresh ({f['ratio_samenode_device_cpu_vs_memcpy_fresh_2mib']:.2f}x)"),
        ("redis lookup 2048 keys p50 (ms)", f"{f['redis_lookup_2048_p50_ms']:.2f}",
         f"one MGET {f['redis_mget_2048_p50_ms']:.2f}"),
        ("ratio lookup 2048 vs MGET (time, lower is better)",
         f"{f['ratio_lookup_vs_mget_2048']:.2f}x",
         f"<= 1.5x (half hit {f['ratio_lookup_vs_mget_2048_half_hit']:.2f}x, "
         f"miss {f['ratio_lookup_vs_mget_2048_miss_first']:.2f}x)"),
        ("redis index publish, batches of 200 (blocks/s)",
         f"{f['redis_publish_blocks_per_s_batch200']:,.0f}", "one script call per batch"),
        ("redis-py reply parser", "hiredis" if HIREDIS_AVAILABLE else "python", parser),
    ]
    if not args.no_secure:  # after the plain node above has stopped: its own three nodes
        secure_figures, secure_rows = bench_secure(args.quick)
        figures |= secure_figures
        rows += secure_rows
    report("kvstore block transfer", rows, figures, args.json)


if __name__ == "__main__":
    main()
