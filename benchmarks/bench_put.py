"""The write and lookup paths at production rates: Put blocks/s and lookup_prefix calls/s.

Starts a private local Ray, the coordinator and one store node (embedded index, or Redis with
``--index redis``), connects a ``ClusterStore`` as a worker does and measures, with 64-token
blocks of 2 KiB payload (float16, 1 layer, 1 KV head of 8), ``batch_put`` of fresh blocks in
batches of ``--batch`` (the replay's ~210), then ``lookup_prefix`` of one batch's keys by
another reader, through its index view (``lookup_per_s_1client``) and with the view off
(``lookup_per_s_1client_uncached``: one index round trip per lookup), as 1 / the median
call time. The
baseline in the same run is the floor a Put cannot beat: the same blocks encoded, verified and
committed into an in-process ``BlockPool`` (no network, no index), so
``ratio_put_vs_inprocess`` is ours / that floor. With ``--clients N`` (N > 1) the put rate of N
client processes together is reported too (``put_blocks_per_s_Nclients``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

import numpy as np
import torch

from benchmarks.common import parse_args, report
from kvstore.api import BlockPut
from kvstore.block import block_nbytes, verify_block
from kvstore.block_batch import encode_blocks_into
from kvstore.config import IndexConfig, KVStoreConfig, PoolConfig
from kvstore.keys import BlockHasher, Namespace
from kvstore.node.block_pool import BlockPool

#: 64 tokens x 1 layer x (K, V) x 1 head x 8 dims x float16 = 2 KiB of payload per block.
NS = Namespace("bench-put", "float16", 64, 1, 1, 8)


def make_puts(seed: int, num_blocks: int) -> list[BlockPut]:
    """``num_blocks`` chained blocks of fresh tokens (distinct per seed) and random payloads."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 32000, (num_blocks * NS.block_size,), generator=g).tolist()
    keys = BlockHasher(NS).block_keys(tokens)
    parents = [NS.root, *keys[:-1]]
    payload = torch.randn((num_blocks, *NS.payload_shape), generator=g).to(torch.float16)
    bs = NS.block_size
    return [BlockPut(k, p, tokens[i * bs : (i + 1) * bs], payload[i])
            for i, (k, p) in enumerate(zip(keys, parents, strict=True))]


def inprocess_floor(batches: list[list[BlockPut]]) -> float:
    """Blocks/s of what a Put does minus the network and the index, in one process: encode the
    batch (``encode_blocks_into``, as ``batch_put`` does), then per block reserve -> copy ->
    verify -> commit into a local pool, as the server does."""
    nbytes = block_nbytes(NS)
    pool = BlockPool(64 << 20)
    try:
        t0 = time.perf_counter()
        for batch in batches:
            rows = np.empty((len(batch), nbytes), dtype=np.uint8)
            encode_blocks_into(rows, NS, [b.key for b in batch], [b.parent_key for b in batch],
                               [b.token_ids for b in batch], [b.payload for b in batch])
            for b, row in zip(batch, rows, strict=True):
                res = pool.reserve(b.key, nbytes)
                res.view[:nbytes] = row.data
                verify_block(res.view, NS, b.key)
                pool.commit(res)
        return sum(map(len, batches)) / (time.perf_counter() - t0)
    finally:
        pool.close()


def _client_puts(address: str, config: KVStoreConfig, seed: int, num_batches: int,
                 batch: int, start: Any, out: Any) -> None:
    """One client process: wait for the start signal, put ``num_batches`` batches."""
    import ray

    from kvstore.cluster import lifecycle
    from kvstore.cluster.names import RAY_NAMESPACE

    ray.init(address=address, namespace=RAY_NAMESPACE, logging_level=logging.WARNING,
             log_to_driver=False)
    store = lifecycle.connect(config)
    batches = [make_puts(seed * 1000 + i, batch) for i in range(num_batches)]
    store.batch_put(NS, make_puts(seed * 1000 + 999, 8))  # connect and warm up
    start.wait()
    t0 = time.perf_counter()
    for b in batches:
        store.batch_put(NS, b)
    out.put((num_batches * batch, t0, time.perf_counter()))
    store.close()
    ray.shutdown()


def multi_client_rate(address: str, config: KVStoreConfig, clients: int, num_batches: int,
                      batch: int) -> float:
    """Total blocks/s of ``clients`` processes putting at once (first start to last end)."""
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_client_puts, args=(address, config, 100 + c, num_batches,
                                                    batch, start, out)) for c in range(clients)]
    for p in procs:
        p.start()
    time.sleep(1.0)
    start.set()
    results = [out.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    total = sum(r[0] for r in results)
    return total / (max(r[2] for r in results) - min(r[1] for r in results))


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Bring a private cluster up, measure, tear it down."""
    import ray

    from kvstore.cluster import lifecycle
    from kvstore.cluster.head import keep_loopback_address
    from kvstore.cluster.names import RAY_NAMESPACE

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    num_batches = 5 if args.quick else 20
    redis_proc = None
    if args.index == "redis" and not args.redis_url:
        from tests.support.redis_server import start_redis_server

        redis_proc = start_redis_server()  # a private one, stopped at the end
        args.redis_url = redis_proc.url
    index = IndexConfig(backend="redis", redis_url=args.redis_url) if args.index == "redis" \
        else IndexConfig()
    config = KVStoreConfig(pool=PoolConfig(capacity_bytes=256 << 20), index=index)
    keep_loopback_address()  # a private Ray, as kvstore starts one: on loopback only
    ray.init(address="local", namespace=RAY_NAMESPACE, include_dashboard=False,
             logging_level=logging.WARNING, log_to_driver=False)
    try:
        lifecycle.start(config)
        store = lifecycle.connect(config)
        batches = [make_puts(i, args.batch) for i in range(num_batches)]
        store.batch_put(NS, make_puts(10_000, 8))  # connections and first calls
        t0 = time.perf_counter()
        for b in batches:
            store.batch_put(NS, b)
        put_rate = num_batches * args.batch / (time.perf_counter() - t0)
        keys = [[p.key for p in b] for b in batches]
        store.close()
        # Lookups by another reader, as a worker sees them (the index view, default TTL), and
        # with the view off (client.index_view_ttl_s = 0: one index round trip per lookup).
        num_lookups = 50 if args.quick else 200
        figures: dict[str, Any] = {"put_blocks_per_s_1client": round(put_rate)}
        for name, ttl in (("lookup_per_s_1client", config.client.index_view_ttl_s),
                          ("lookup_per_s_1client_uncached", 0.0)):
            cfg = dataclasses.replace(config, client=dataclasses.replace(
                config.client, index_view_ttl_s=ttl))
            rdr = lifecycle.connect(cfg)
            rdr.lookup_prefix(NS, [bytes(32)])  # connect (an absent key: nothing is remembered)
            times = []
            for i in range(num_lookups):
                t0 = time.perf_counter()
                hit = rdr.lookup_prefix(NS, keys[i % num_batches])
                times.append(time.perf_counter() - t0)
                assert hit.num_blocks == args.batch, "a put block is not visible"
            # Per call, from the median: one descheduled call on a shared box is not the path.
            figures[name] = round(1 / statistics.median(times))
            rdr.close()
        if args.clients > 1:
            figures[f"put_blocks_per_s_{args.clients}clients"] = round(multi_client_rate(
                ray.get_runtime_context().gcs_address, config, args.clients, num_batches,
                args.batch))
        lifecycle.stop(config)
    finally:
        ray.shutdown()
        if redis_proc is not None:
            redis_proc.stop()
    floor = inprocess_floor([make_puts(20_000 + i, args.batch) for i in range(num_batches)])
    figures["put_blocks_per_s_inprocess"] = round(floor)
    figures["ratio_put_vs_inprocess"] = round(put_rate / floor, 3)
    figures["index"] = args.index
    figures["batch"] = args.batch
    return figures


def _flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--index", choices=("memory", "redis"), default="memory",
                        help="memory: the embedded index in the coordinator; redis: --redis-url")
    parser.add_argument("--redis-url", default=None,
                        help="with --index redis; unset starts a private redis-server")
    parser.add_argument("--batch", type=int, default=210, help="blocks per batch_put")
    parser.add_argument("--clients", type=int, default=1,
                        help="also measure this many client processes putting at once")


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], _flags)
    f = measure(args)
    rows = [("put blocks/s, 1 client", f"{f['put_blocks_per_s_1client']:,}", "30,000 target"),
            ("lookup_prefix calls/s, 1 client", f"{f['lookup_per_s_1client']:,}",
             f"{f['lookup_per_s_1client_uncached']:,} without the view"),
            ("in-process encode+verify+commit", f"{f['put_blocks_per_s_inprocess']:,}",
             "floor"),
            ("put / in-process", f"{f['ratio_put_vs_inprocess']:.3f}", "")]
    if args.clients > 1:
        key = f"put_blocks_per_s_{args.clients}clients"
        rows.append((f"put blocks/s, {args.clients} clients", f"{f[key]:,}", ""))
    report(f"Put and lookup, 2 KiB blocks, {args.index} index", rows, f, args.json)


if __name__ == "__main__":
    main()
