"""Trace replay: a Mooncake-format trace against a real cluster, judged by exact LRU and Belady.

Each hash_id of the trace becomes 512 deterministic tokens (``benchmarks.trace_sim``), each
request the chained keys of its full 64-token blocks; a block's 2 KiB payload (float16, one
layer, one KV head of 8) is its key repeated, so every byte read back can be checked. The
cluster is real: a private local Ray, ``lifecycle.start`` (coordinator + one store node, the
embedded index) with a pool smaller than the working set, and ``--clients N`` spawned processes
that each ``lifecycle.connect`` as a worker does. Requests go to clients round-robin in arrival
order; each client replays its share at the trace's arrival times divided by ``--speed`` (open
loop: a late request goes at once), or back to back with ``--speed 0``. Several clients at
``--speed 0`` drift apart, so a request may find blocks a later request (in trace order) already
put: their hit rate is not judged against the trace-order LRU as strictly as one client's is.
Per request:

    lookup_prefix(keys) -> batch_get(the promised prefix) -> batch_put(every key after the
    leading run actually served)

and the store time per request is the wall time of those three calls. What counts:

* hit: a block of the leading run that ``batch_get`` returned with exactly the expected bytes;
  hit rate = hits / blocks looked up.
* stale promise: a block ``lookup_prefix`` promised that came back ``Miss`` (not_found or
  lease_expired, i.e. evicted in between): a miss, never an error.
* wrong block: a ``FetchedBlock`` whose bytes differ from the expected ones (must be 0).
* failed read: a promised block rejected by verification (corrupted, mismatch) or whose holder
  was unreachable (must be 0); ``errors`` counts calls that raised (a Put refused with
  ``PoolFull``, say), also 0 in a healthy replay.

The baselines run on the same key sequence in this process: an exact LRU and Belady's MIN
(``trace_sim``) with as many blocks as the pool can hold, ``capacity_bytes // align_up(
block_nbytes)`` (the arena hands out 64-byte-aligned extents of the whole encoded block, header
included). The store evicts from above the high watermark down to the low one, so it never uses
more than that and often less: the comparison does not flatter the store. An LRU of the low
watermark's size (``lru_low_watermark_hit_rate_capNN``) shows how much of a gap is the
watermark rather than the eviction order. Capacities are
fractions of the working set (the distinct blocks of the replayed requests), ``--capacities``.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty
from typing import Any, cast

import numpy as np
import torch

from benchmarks.common import parse_args, report
from benchmarks.trace_sim import TraceExpander, load_trace, simulate_belady, simulate_lru
from kvstore.api import BlockPut, FetchedBlock, Miss, PoolStats
from kvstore.block import block_nbytes
from kvstore.config import KVStoreConfig
from kvstore.config_loader import load_config
from kvstore.constants import align_up
from kvstore.errors import KVStoreError
from kvstore.gc_tuning import freeze_startup_objects
from kvstore.keys import Namespace

#: 64 tokens x 1 layer x (K, V) x 1 head x 8 dims x float16 = 2 KiB of payload per block.
NS = Namespace("bench-trace", "float16", 64, 1, 1, 8)
REPO = Path(__file__).resolve().parent.parent
DEFAULT_TRACE = REPO.parent / "shared" / "traces" / "synthetic_trace.jsonl"
#: Misses that mean "evicted since the lookup": the staleness a lookup may have, not an error.
STALE_REASONS = ("not_found", "lease_expired")


def expected_payload(key: bytes) -> bytes:
    """A block's payload bytes: its 32-byte key repeated, so any misplaced byte shows."""
    return key * (NS.payload_nbytes // len(key))


def payload_tensors(keys: list[bytes]) -> list[torch.Tensor]:
    """``expected_payload`` of each key as a payload tensor, built in one array op: the
    replay's own work (a worker's KV comes from its model) stays out of the store's time."""
    if not keys:
        return []
    rows = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(len(keys), -1)
    tiled = np.tile(rows, (1, NS.payload_nbytes // rows.shape[1]))
    return list(torch.from_numpy(tiled).view(torch.float16).view(len(keys), *NS.payload_shape)
                .unbind(0))


@dataclass(slots=True)
class ClientResult:
    """One client's tallies and per-request store times (seconds)."""

    num_requests: int = 0
    lookups: int = 0
    hits: int = 0
    stale_promises: int = 0
    wrong_blocks: int = 0
    failed_reads: int = 0
    errors: list[str] = field(default_factory=list)
    store_s: list[float] = field(default_factory=list)
    #: Seconds spent in each call, summed (where a request's time goes).
    lookup_s: float = 0.0
    get_s: float = 0.0
    put_s: float = 0.0
    t_first: float = 0.0
    t_last: float = 0.0


def replay_client(address: str, config: KVStoreConfig, trace: str, limit: int, client: int,
                  num_clients: int, speed: float, ready: Any, start_at: Any, out: Any) -> None:
    """One client process: connect, expand its share, wait for the start, replay it."""
    import ray

    from kvstore.cluster import lifecycle
    from kvstore.cluster.names import RAY_NAMESPACE

    ray.init(address=address, namespace=RAY_NAMESPACE, logging_level=logging.WARNING,
             log_to_driver=False)
    store = lifecycle.connect(config)
    requests = load_trace(Path(trace), limit)[client::num_clients]
    expander = TraceExpander(NS)
    mine = [(r.timestamp_ms / 1000.0, expander.expand(r)) for r in requests]
    store.lookup_prefix(NS, mine[0][1].keys[:1])  # first connections outside the timing
    # Started, as a serving process is once loaded: the start-up objects leave the garbage
    # collector's walks (kvstore.gc_tuning; the store node and coordinator do the same).
    freeze_startup_objects()
    ready.put(client)
    while start_at.value == 0.0:
        time.sleep(0.005)
    t_zero = start_at.value
    while time.time() < t_zero:
        time.sleep(0.001)
    res = ClientResult(t_first=time.time())
    for arrival_s, req in mine:
        if speed > 0:
            delay = t_zero + arrival_s / speed - time.time()
            if delay > 0:
                time.sleep(delay)
        res.num_requests += 1
        res.lookups += len(req.keys)
        try:
            t0 = time.perf_counter()
            promised = store.lookup_prefix(NS, req.keys).num_blocks
            t1 = time.perf_counter()
            got = store.batch_get(NS, req.keys[:promised], req.token_ids[:promised]) \
                if promised else []
            t2 = time.perf_counter()
            spent = t2 - t0
            res.lookup_s += t1 - t0
            res.get_s += t2 - t1
            served = 0
            for i, r in enumerate(got):
                if isinstance(r, FetchedBlock):
                    if r.payload.reshape(-1).view(torch.uint8).numpy().tobytes() \
                            != expected_payload(req.keys[i]):
                        res.wrong_blocks += 1
                    elif served == i:  # only the leading run is a usable prefix
                        served += 1
                elif isinstance(r, Miss) and r.reason in STALE_REASONS:
                    res.stale_promises += 1
                else:
                    res.failed_reads += 1
            res.hits += served
            puts = [BlockPut(k, p, t, x) for k, p, t, x in
                    zip(req.keys[served:], req.parent_keys[served:], req.token_ids[served:],
                        payload_tensors(req.keys[served:]), strict=True)]
            t0 = time.perf_counter()
            store.batch_put(NS, puts)
            put = time.perf_counter() - t0
            res.put_s += put
            res.store_s.append(spent + put)
        except KVStoreError as exc:  # counted and reported: a replay must show none
            res.errors.append(f"{type(exc).__name__}: {exc}")
    res.t_last = time.time()
    out.put(res)
    store.close()
    ray.shutdown()


def _take(queue: Any, procs: list[Any]) -> Any:
    """The next item of ``queue``; raise if a client died first (never wait forever)."""
    while True:
        try:
            return queue.get(timeout=2.0)
        except Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"a replay client exited with {dead[0]} (its stderr "
                                   "above says why)") from None


def replay(address: str, config: KVStoreConfig, trace: Path, limit: int, num_clients: int,
           speed: float) -> dict[str, Any]:
    """Replay the trace with ``num_clients`` processes against the running cluster."""
    ctx = mp.get_context("spawn")
    ready, out = ctx.Queue(), ctx.Queue()
    start_at = ctx.Value("d", 0.0)
    procs = [ctx.Process(target=replay_client, args=(
        address, config, str(trace), limit, c, num_clients, speed, ready, start_at, out))
        for c in range(num_clients)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            _take(ready, procs)
        start_at.value = time.time() + 0.5  # every client starts its clock at the same instant
        results: list[ClientResult] = [_take(out, procs) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    store_ms = sorted(s * 1e3 for r in results for s in r.store_s)
    num_requests = sum(r.num_requests for r in results)
    lookups = sum(r.lookups for r in results)
    wall = max(r.t_last for r in results) - min(r.t_first for r in results)
    return {
        "requests": num_requests, "lookups": lookups,
        "hit_rate": sum(r.hits for r in results) / lookups,
        "req_per_s": num_requests / wall,
        "p50_ms": statistics.median(store_ms),
        "p99_ms": store_ms[min(len(store_ms) - 1, int(0.99 * len(store_ms)))],
        # mean ms per request in each call, and outside them (the replay's own work, waits)
        **{f"{what}_ms_mean": 1e3 * sum(getattr(r, f"{what}_s") for r in results)
           / max(num_requests, 1) for what in ("lookup", "get", "put")},
        "stale_promises": sum(r.stale_promises for r in results),
        "wrong_blocks": sum(r.wrong_blocks for r in results),
        "failed_reads": sum(r.failed_reads for r in results),
        "errors": sum(len(r.errors) for r in results),
        "first_errors": [e for r in results for e in r.errors][:3],
    }


def run_capacity(address: str, capacity_bytes: int, trace: Path, limit: int,
                 client_counts: list[int], speed: float) -> dict[int, dict[str, Any]]:
    """Start a fresh cluster with this pool, replay with each client count, stop it."""
    import ray

    from kvstore.cluster import lifecycle
    from kvstore.cluster.names import store_actor_name

    out: dict[int, dict[str, Any]] = {}
    for num_clients in client_counts:  # a fresh, empty pool per replay
        config = load_config(env={}, overrides={"pool": {"capacity_bytes": capacity_bytes}})
        info = lifecycle.start(config)
        try:
            out[num_clients] = replay(address, config, trace, limit, num_clients, speed)
            (node_id,) = info.nodes
            stats = cast(PoolStats, ray.get(
                ray.get_actor(store_actor_name(node_id)).stats.remote()))
            out[num_clients]["evictions"] = stats.evictions
        finally:
            lifecycle.stop(config)
    return out


def _flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                        help="Mooncake-format JSON lines (default: ../shared/traces/"
                             "synthetic_trace.jsonl beside the repository)")
    parser.add_argument("--requests", type=int, default=None,
                        help="replay the first N requests (default: all; --quick: 200)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4],
                        help="client process counts to replay with (default: 1 4)")
    parser.add_argument("--speed", type=float, default=0.0,
                        help="arrival times divided by this; 0 replays as fast as possible")
    parser.add_argument("--capacities", type=float, nargs="+", default=[0.1, 0.25, 0.5],
                        help="pool sizes as fractions of the working set")


def main() -> None:
    args = parse_args(__doc__.splitlines()[0], _flags)
    trace: Path = args.trace
    if not trace.is_file():
        sys.exit(f"bench_trace: no trace at {trace}: pass --trace PATH (the synthetic one is "
                 "shared/traces/synthetic_trace.jsonl, beside the repository as ../shared)")
    limit = args.requests or (200 if args.quick else 1 << 30)
    requests = load_trace(trace, limit)
    limit = len(requests)
    expander = TraceExpander(NS)
    keys = [expander.expand(r).keys for r in requests]
    working_set = len({k for ks in keys for k in ks})
    slot = align_up(block_nbytes(NS))  # what one block takes in the arena
    low_watermark = load_config(env={}).coordinator.low_watermark
    caps = {round(f * 100): max(1, int(f * working_set)) for f in args.capacities}

    import ray

    from kvstore.cluster.head import keep_loopback_address
    from kvstore.cluster.names import RAY_NAMESPACE

    os.environ["RAY_AUTH_MODE"] = "disabled"  # the same mode for every process we start
    keep_loopback_address()  # a private Ray, as kvstore starts one: on loopback only
    ray.init(address="local", num_cpus=2, namespace=RAY_NAMESPACE, include_dashboard=False,
             logging_level=logging.WARNING, log_to_driver=False)
    address = ray.get_runtime_context().gcs_address
    figures: dict[str, Any] = {"requests": limit, "working_set_blocks": working_set,
                               "block_slot_bytes": slot, "speed": args.speed}
    rows: list[tuple[str, str, str]] = []
    mid = sorted(caps)[len(caps) // 2]
    try:
        for pct, num_blocks in sorted(caps.items()):
            lru, opt = simulate_lru(keys, num_blocks), simulate_belady(keys, num_blocks)
            # The store evicts down to the low watermark: an LRU that small is its floor.
            low = simulate_lru(keys, int(low_watermark * num_blocks))
            # --quick replays the extra client counts at the middle capacity only.
            counts = args.clients if not args.quick or pct == mid else args.clients[:1]
            runs = run_capacity(address, num_blocks * slot, trace, limit, counts, args.speed)
            for n, run in runs.items():
                tag = f"cap{pct}" + ("" if n == args.clients[0] else f"_{n}clients")
                figures.update({
                    f"hit_rate_{tag}": run["hit_rate"],
                    f"ratio_hit_vs_lru_{tag}": run["hit_rate"] / max(lru.prefix_hit_rate,
                                                                     1e-9),
                    f"req_per_s_{tag}": run["req_per_s"], f"p50_ms_{tag}": run["p50_ms"],
                    f"p99_ms_{tag}": run["p99_ms"], f"evictions_{tag}": run["evictions"],
                    f"stale_promises_{tag}": run["stale_promises"],
                    f"wrong_blocks_{tag}": run["wrong_blocks"],
                    f"failed_reads_{tag}": run["failed_reads"],
                    f"errors_{tag}": run["errors"],
                    **{f"{w}_ms_mean_{tag}": run[f"{w}_ms_mean"] for w in ("lookup", "get", "put")},
                    f"ratio_hit_vs_lru_low_watermark_{tag}": run["hit_rate"] / max(
                        low.prefix_hit_rate, 1e-9)})
                rows.append((f"{pct}% = {num_blocks} blocks, {n} cl: hit rate",
                             f"{run['hit_rate']:.2%}",
                             f"LRU {lru.prefix_hit_rate:.2%} (low wm "
                             f"{low.prefix_hit_rate:.2%}), MIN {opt.block_hit_rate:.2%}"))
                rows.append(("  req/s; p50 / p99 ms", f"{run['req_per_s']:.1f}",
                             f"{run['p50_ms']:.0f} / {run['p99_ms']:.0f}"))
                rows.append(("  ms/request: lookup, get, put",
                             f"{run['lookup_ms_mean']:.2f}, {run['get_ms_mean']:.2f}, "
                             f"{run['put_ms_mean']:.2f}",
                             f"of {1e3 * n / run['req_per_s']:.2f} per request"))
                rows.append(("  evicted, stale, wrong, failed, errors",
                             f"{run['evictions']}, {run['stale_promises']}, "
                             f"{run['wrong_blocks']}, {run['failed_reads']}, {run['errors']}",
                             "last three: 0"))
                if run["errors"]:
                    print(f"{run['errors']} calls raised at {pct}% with {n} client(s), "
                          f"first: {run['first_errors']}")
            figures.update({f"capacity_blocks_cap{pct}": num_blocks,
                            f"lru_hit_rate_cap{pct}": lru.prefix_hit_rate,
                            f"lru_block_hit_rate_cap{pct}": lru.block_hit_rate,
                            f"lru_low_watermark_hit_rate_cap{pct}": low.prefix_hit_rate,
                            f"belady_hit_rate_cap{pct}": opt.block_hit_rate})
    finally:
        ray.shutdown()
    # The headline figures: the middle capacity, as the table has them.
    figures["ratio_hit_vs_lru"] = figures[f"ratio_hit_vs_lru_cap{mid}"]
    figures["min_ratio_hit_vs_lru"] = min(figures[f"ratio_hit_vs_lru_cap{p}"] for p in caps)
    figures["p50_ms"] = figures[f"p50_ms_cap{mid}"]
    figures["p99_ms"] = figures[f"p99_ms_cap{mid}"]
    for n in args.clients:
        suffix = "" if n == args.clients[0] else f"_{n}clients"
        figures[f"req_per_s_{n}client{'s' if n > 1 else ''}"] = \
            figures[f"req_per_s_cap{mid}{suffix}"]
    for what in ("wrong_blocks", "failed_reads", "errors", "stale_promises"):
        figures[what] = sum(v for k, v in figures.items() if k.startswith(f"{what}_cap"))
    report(f"trace replay: {limit} requests, {working_set} distinct blocks, "
           f"speed {args.speed or 'max'}", rows, figures, args.json)


if __name__ == "__main__":
    main()
