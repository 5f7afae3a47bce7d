"""Block transfer: a store node in another process vs raw TCP, Redis and memcpy, in one run.

Remote reads use the bulk channel (sendfile from the arena, recv_into preallocated buffers);
gRPC Get is measured too, since it is the fallback and the reason the bulk channel exists.
Same-node reads are lease + ShmReader copy-and-verify + release. Every figure is the best of a
few repeats (the least disturbed run on a shared machine).

    python -m benchmarks.bench_transfer [--quick] [--json bench-results/transfer.json]
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import best_of, parse_args, report
from kvstore.block import block_nbytes, encode_block_into
from kvstore.client import StoreNodeClient
from kvstore.config import ClientConfig
from kvstore.index import IndexEntry
from kvstore.keys import BlockHasher, Namespace
from kvstore.redis_index import RedisIndex
from kvstore.redis_proc import start_redis_server
from kvstore.shm_reader import ShmReader

ROOT = Path(__file__).resolve().parent.parent
NS_2MIB = Namespace("bench", "float16", 16, 32, 8, 128)  # 2 MiB payload
NS_64KIB = Namespace("bench", "float16", 16, 1, 8, 128)  # 64 KiB payload

SERVER = """
import sys, time
from kvstore.config import ServerConfig
from kvstore.pool import BlockPool
from kvstore.server import StoreServer
pool = BlockPool(int(sys.argv[1]))
srv = StoreServer(pool, "bench", ServerConfig(max_workers=4))
g, b = srv.start()
print(g, b, pool.path, flush=True)
sys.stdin.read()
srv.stop(0)
pool.close()
"""

# Sends `n` bytes from a preallocated buffer each time it reads one request byte.
TCP_SENDER = """
import socket, sys
n = int(sys.argv[1])
lst = socket.create_server(("127.0.0.1", 0))
print(lst.getsockname()[1], flush=True)
conn, _ = lst.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
payload = memoryview(bytearray(b"x" * n))
while conn.recv(1):
    conn.sendall(payload)
"""


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


def fetch_all(client: StoreNodeClient, keys: list[bytes], bufs: list[bytearray], batch: int
              ) -> None:
    for i in range(0, len(keys), batch):
        sizes = client.get_blocks_into(keys[i:i + batch], bufs[i:i + batch])
        assert None not in sizes


def raw_tcp(total_per_request: int, block: int, num_requests: int, repeats: int) -> float:
    proc = subprocess.Popen([sys.executable, "-c", TCP_SENDER, str(total_per_request)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    bufs = [memoryview(bytearray(block)) for _ in range(total_per_request // block)]

    def run() -> None:
        for _ in range(num_requests):
            sock.sendall(b"?")
            for b in bufs:
                got = 0
                while got < block:
                    got += sock.recv_into(b[got:], block - got, socket.MSG_WAITALL)

    t = best_of(run, repeats)
    sock.close()
    proc.kill()
    proc.wait()
    return t


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    n_big, n_small = (32, 256) if args.quick else (256, 1024)
    repeats = 3 if args.quick else 5
    big_keys, big_blocks = make_blocks(NS_2MIB, n_big)
    small_keys, small_blocks = make_blocks(NS_64KIB, n_small)
    big_nb, small_nb = len(big_blocks[0]), len(small_blocks[0])
    total_big, total_small = big_nb * n_big, small_nb * n_small
    capacity = total_big + total_small + (64 << 20)
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(capacity)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None and proc.stdin is not None
    grpc_port, bulk_port, shm_path = proc.stdout.readline().split()
    cfg = ClientConfig(timeout_s=120)
    grpc_addr, bulk_addr = f"127.0.0.1:{grpc_port}", f"127.0.0.1:{bulk_port}"
    redis = start_redis_server()
    figures: dict[str, float] = {}
    try:
        bulk = StoreNodeClient(grpc_addr, bulk_address=bulk_addr, config=cfg)
        plain = StoreNodeClient(grpc_addr, config=cfg)
        for i in range(0, n_big, 16):
            bulk.put_blocks(NS_2MIB, list(zip(big_keys[i:i + 16], big_blocks[i:i + 16],
                                              strict=True)))
        bulk.put_blocks(NS_64KIB, list(zip(small_keys, small_blocks, strict=True)))

        big_bufs = [bytearray(big_nb) for _ in range(n_big)]
        t_bulk_big = best_of(lambda: fetch_all(bulk, big_keys, big_bufs, 32), repeats)
        assert big_bufs[-1] == big_blocks[-1]
        t_grpc_big = best_of(lambda: fetch_all(plain, big_keys, big_bufs, 32), repeats)
        small_bufs = [bytearray(small_nb) for _ in range(n_small)]
        t_bulk_small = best_of(lambda: fetch_all(bulk, small_keys, small_bufs, 32), repeats)
        assert small_bufs[-1] == small_blocks[-1]
        t_grpc_small = best_of(lambda: fetch_all(plain, small_keys, small_bufs, 32), repeats)
        t_tcp_big = raw_tcp(32 * big_nb, big_nb, n_big // 32, repeats)

        r = redis.client()
        for k, b in zip(big_keys, big_blocks, strict=True):
            r.set(k, bytes(b))
        for k, b in zip(small_keys, small_blocks, strict=True):
            r.set(k, bytes(b))

        def redis_fetch(keys: list[bytes]) -> None:
            for i in range(0, len(keys), 32):
                assert None not in r.mget(keys[i:i + 32])

        t_redis_big = best_of(lambda: redis_fetch(big_keys), repeats)
        t_redis_small = best_of(lambda: redis_fetch(small_keys), repeats)

        # Same node: lease + one verified copy out of the arena + release, vs plain memcpy.
        reader = ShmReader(shm_path)
        src = np.frombuffer(bytearray(total_big), np.uint8)
        dst_arr = np.empty(total_big, np.uint8)
        t_memcpy = best_of(lambda: np.copyto(dst_arr, src), repeats)

        def shm_fetch() -> None:
            for i in range(0, n_big, 32):
                lease = bulk.lease(big_keys[i:i + 32], 30)
                for loc, buf in zip(lease.locations, big_bufs[i:i + 32], strict=True):
                    reader.copy_verified_into(loc, buf, NS_2MIB)
                bulk.release(lease.lease_id)

        t_shm = best_of(shm_fetch, repeats)
        assert big_bufs[0] == big_blocks[0]
        reader.close()

        index = RedisIndex(redis.url)
        lk_ns = Namespace("bench-lookup", "float16", 16, 1, 1, 8)
        lk_keys = BlockHasher(lk_ns).block_keys(list(range(2048 * 16)))
        parents = [lk_ns.root, *lk_keys[:-1]]
        index.publish([IndexEntry(k, "bench", 1024, p, lk_ns.root)
                       for k, p in zip(lk_keys, parents, strict=True)])
        lookups = []
        for _ in range(20 if args.quick else 50):
            t0 = time.perf_counter()
            assert index.lookup_prefix(lk_keys).num_blocks == 2048
            lookups.append(time.perf_counter() - t0)
        index.close()
        bulk.close()
        plain.close()
    finally:
        redis.stop()
        proc.stdin.close()
        proc.wait(timeout=30)

    figures = {
        "remote_gbps_2mib": gbps(total_big, t_bulk_big),
        "grpc_gbps_2mib": gbps(total_big, t_grpc_big),
        "tcp_gbps_2mib": gbps(total_big, t_tcp_big),
        "redis_gbps_2mib": gbps(total_big, t_redis_big),
        "remote_gbps_64kib_batch32": gbps(total_small, t_bulk_small),
        "grpc_gbps_64kib_batch32": gbps(total_small, t_grpc_small),
        "redis_gbps_64kib_batch32": gbps(total_small, t_redis_small),
        "samenode_gbps_2mib": gbps(total_big, t_shm),
        "memcpy_gbps_2mib": gbps(total_big, t_memcpy),
        "ratio_remote_vs_redis_2mib": t_redis_big / t_bulk_big,
        "ratio_remote_vs_tcp_2mib": t_tcp_big / t_bulk_big,
        "ratio_grpc_vs_redis_2mib": t_redis_big / t_grpc_big,
        "ratio_samenode_vs_memcpy_2mib": t_memcpy / t_shm,
        "redis_lookup_2048_p50_ms": statistics.median(lookups) * 1e3,
        "num_blocks_2mib": n_big,
        "num_blocks_64kib": n_small,
    }
    f = figures
    rows = [
        ("remote bulk 2 MiB (GB/s)", f"{f['remote_gbps_2mib']:.2f}",
         f"redis {f['redis_gbps_2mib']:.2f} / tcp {f['tcp_gbps_2mib']:.2f}"),
        ("remote gRPC Get 2 MiB (GB/s)", f"{f['grpc_gbps_2mib']:.2f}", "(fallback path)"),
        ("ratio remote vs redis 2 MiB", f"{f['ratio_remote_vs_redis_2mib']:.2f}x", ">= 1.0x"),
        ("ratio remote vs raw tcp 2 MiB", f"{f['ratio_remote_vs_tcp_2mib']:.2f}x", "<= 1.0x"),
        ("remote bulk 64 KiB x32 (GB/s)", f"{f['remote_gbps_64kib_batch32']:.2f}",
         f">= 5 (redis {f['redis_gbps_64kib_batch32']:.2f}, "
         f"gRPC {f['grpc_gbps_64kib_batch32']:.2f})"),
        ("same-node shm+verify 2 MiB (GB/s)", f"{f['samenode_gbps_2mib']:.2f}",
         f"memcpy {f['memcpy_gbps_2mib']:.2f}"),
        ("ratio same-node vs memcpy", f"{f['ratio_samenode_vs_memcpy_2mib']:.2f}x", ">= 0.6x"),
        ("redis lookup 2048 keys p50 (ms)", f"{f['redis_lookup_2048_p50_ms']:.2f}", "<= 2 ms"),
    ]
    report("kvstore block transfer", rows, figures, args.json)


if __name__ == "__main__":
    main()
