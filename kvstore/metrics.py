"""Prometheus metrics of kvstore, in one module-level registry.

Every metric is created once, when this module is first imported, in ``REGISTRY``; components
in one process (a store node, a worker, the coordinator) share it, so none of them can register
a series twice. Helpers check label values against fixed sets: an unknown label would silently
start a new time series, so it raises instead.
"""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from kvstore.api import MISS_CORRUPTED, MISS_MISMATCH, MISS_REASONS, MissReason, PoolStats

#: How block bytes moved: gRPC messages, the bulk byte channel, or same-node shared memory.
PATHS = ("grpc", "bulk", "shm")
#: Why a block was refused on the way in or out (reads reject with the MISS_* verdicts).
REJECT_REASONS = (MISS_CORRUPTED, MISS_MISMATCH, "namespace", "too_large", "malformed",
                  "pool_full", "unauthenticated")

REGISTRY = CollectorRegistry(auto_describe=True)

BLOCKS_IN = Counter("kvstore_blocks_in", "Blocks received (published or fetched in)",
                    ["path"], registry=REGISTRY)
BLOCKS_OUT = Counter("kvstore_blocks_out", "Blocks served to readers", ["path"],
                     registry=REGISTRY)
BYTES_IN = Counter("kvstore_bytes_in", "Block bytes received", ["path"], registry=REGISTRY)
BYTES_OUT = Counter("kvstore_bytes_out", "Block bytes served", ["path"], registry=REGISTRY)
FETCH_LATENCY = Histogram(
    "kvstore_fetch_latency_seconds", "Time to fetch and verify one batch of blocks", ["path"],
    # 100 us (same-node shm) up to 10 s (a slow remote node near its deadline)
    buckets=(1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0,
             2.5, 5.0, 10.0),
    registry=REGISTRY,
)
HITS = Counter("kvstore_hits", "Requested blocks that came back verified", registry=REGISTRY)
MISSES = Counter("kvstore_misses", "Requested blocks that could not be used", ["reason"],
                 registry=REGISTRY)
REJECTED = Counter("kvstore_rejected_blocks", "Blocks refused by verification or limits",
                   ["reason"], registry=REGISTRY)
EVICTIONS = Counter("kvstore_evictions", "Blocks evicted from a node's pool", ["node_id"],
                    registry=REGISTRY)
POOL_USED_BYTES = Gauge("kvstore_pool_used_bytes", "Bytes allocated in a node's pool",
                        ["node_id"], registry=REGISTRY)
POOL_CAPACITY_BYTES = Gauge("kvstore_pool_capacity_bytes", "A node's pool capacity",
                            ["node_id"], registry=REGISTRY)
POOL_BLOCKS = Gauge("kvstore_pool_blocks", "Blocks held in a node's pool", ["node_id"],
                    registry=REGISTRY)
POOL_PINNED_BLOCKS = Gauge("kvstore_pool_pinned_blocks", "Pinned blocks in a node's pool",
                           ["node_id"], registry=REGISTRY)
POOL_LEASED_BLOCKS = Gauge("kvstore_pool_leased_blocks", "Leased blocks in a node's pool",
                           ["node_id"], registry=REGISTRY)
# The coordinator's view of the cluster (set in the coordinator actor's process).
COORD_DRIFT = Counter("kvstore_coordinator_drift_blocks",
                      "Index entries fixed when nodes re-announced (added: missing from the "
                      "index, removed: the node no longer had them)", ["kind"], registry=REGISTRY)
COORD_EVICT_ORDERS = Counter("kvstore_coordinator_evict_orders",
                             "Blocks the coordinator ordered nodes to evict", registry=REGISTRY)
COORD_REPLICATE_ORDERS = Counter("kvstore_coordinator_replicate_orders",
                                 "Hot or soft-pinned blocks ordered copied to a reader's node",
                                 registry=REGISTRY)
COORD_NODES_DEAD = Counter("kvstore_coordinator_nodes_dead",
                           "Store nodes declared dead after node_timeout_s of silence",
                           registry=REGISTRY)
COORD_NODES_ALIVE = Gauge("kvstore_coordinator_nodes_alive", "Store nodes heartbeating",
                          registry=REGISTRY)
COORD_PINS = Gauge("kvstore_coordinator_pins", "Pinned block keys", ["kind"],
                   registry=REGISTRY)
# The workers (set in each prefill/decode worker's process).
REUSE_POLICY = Gauge("kvstore_worker_reuse_policy",
                     "A worker's reuse policy in force (1): where hits resume, the smallest "
                     "piece a chunk is computed in, and whether reuse is bitwise",
                     ["mode", "resume", "min_piece", "exact"], registry=REGISTRY)
PREFILL_TOKENS = Counter("kvstore_prefill_tokens",
                         "Prompt tokens by where their KV came from: cached (reused), "
                         "unreused_shared (cached but recomputed), computed",
                         ["kind"], registry=REGISTRY)

_servers: list[WSGIServer] = []


def _check(value: str, allowed: tuple[str, ...], what: str) -> str:
    if value not in allowed:
        raise ValueError(f"unknown metrics {what} {value!r}; use one of {list(allowed)}")
    return value


def record_in(path: str, num_blocks: int, nbytes: int) -> None:
    """Count blocks received over ``path`` (grpc | bulk | shm)."""
    _check(path, PATHS, "path")
    BLOCKS_IN.labels(path=path).inc(num_blocks)
    BYTES_IN.labels(path=path).inc(nbytes)


def record_out(path: str, num_blocks: int, nbytes: int) -> None:
    """Count blocks served over ``path`` (grpc | bulk | shm)."""
    _check(path, PATHS, "path")
    BLOCKS_OUT.labels(path=path).inc(num_blocks)
    BYTES_OUT.labels(path=path).inc(nbytes)


def observe_fetch(path: str, seconds: float) -> None:
    """Record one batch fetch's latency."""
    FETCH_LATENCY.labels(path=_check(path, PATHS, "path")).observe(seconds)


def record_hits(num_blocks: int = 1) -> None:
    HITS.inc(num_blocks)


def record_miss(reason: MissReason, num_blocks: int = 1) -> None:
    """Count misses by one of the ``kvstore.api.MISS_*`` reasons."""
    MISSES.labels(reason=_check(reason, MISS_REASONS, "miss reason")).inc(num_blocks)


def record_rejected(reason: str, num_blocks: int = 1) -> None:
    """Count refused blocks by one of ``REJECT_REASONS``."""
    REJECTED.labels(reason=_check(reason, REJECT_REASONS, "reject reason")).inc(num_blocks)


def record_evictions(node_id: str, num_blocks: int) -> None:
    EVICTIONS.labels(node_id=node_id).inc(num_blocks)


def observe_pool(node_id: str, stats: PoolStats) -> None:
    """Publish a pool's occupancy (call after changes or on each heartbeat)."""
    POOL_USED_BYTES.labels(node_id=node_id).set(stats.used_bytes)
    POOL_CAPACITY_BYTES.labels(node_id=node_id).set(stats.capacity_bytes)
    POOL_BLOCKS.labels(node_id=node_id).set(stats.num_blocks)
    POOL_PINNED_BLOCKS.labels(node_id=node_id).set(stats.num_pinned)
    POOL_LEASED_BLOCKS.labels(node_id=node_id).set(stats.num_leased)


def observe_coordinator(nodes_alive: int, pins: dict[str, int]) -> None:
    """Publish the coordinator's live-node count and pin counts (``{"hard": n, "soft": m}``)."""
    COORD_NODES_ALIVE.set(nodes_alive)
    for kind in ("hard", "soft"):
        COORD_PINS.labels(kind=kind).set(pins.get(kind, 0))


def observe_reuse_policy(policy: dict[str, object]) -> None:
    """Publish the reuse policy a worker runs with (``ReusePolicy.as_dict``)."""
    sizes = policy["piece_sizes"]
    REUSE_POLICY.labels(mode=str(policy["mode"]), resume=str(policy["resume"]),
                        min_piece=str(sizes[0]) if isinstance(sizes, list) and sizes else "any",
                        exact=str(policy["exact"]).lower()).set(1)


def record_prefill_tokens(cached: int, unreused_shared: int, computed: int) -> None:
    """Count one prefill's prompt tokens by where their KV came from."""
    for kind, n in (("cached", cached), ("unreused_shared", unreused_shared),
                    ("computed", computed)):
        if n:
            PREFILL_TOKENS.labels(kind=kind).inc(n)


def record_drift(added: int, removed: int) -> None:
    """Count index entries a reconcile added and removed."""
    if added:
        COORD_DRIFT.labels(kind="added").inc(added)
    if removed:
        COORD_DRIFT.labels(kind="removed").inc(removed)


def forget_node(node_id: str) -> None:
    """Drop a departed node's series so dashboards do not show a dead node's last values."""
    for metric in (EVICTIONS, POOL_USED_BYTES, POOL_CAPACITY_BYTES, POOL_BLOCKS,
                   POOL_PINNED_BLOCKS, POOL_LEASED_BLOCKS):
        try:
            metric.remove(node_id)
        except KeyError:
            pass  # the node never reported this series


def start_metrics_server(port: int = 0, addr: str = "0.0.0.0") -> int:
    """Serve ``REGISTRY`` over HTTP at ``/metrics``; port 0 picks a free port. Returns it."""
    server, _thread = start_http_server(port, addr=addr, registry=REGISTRY)
    _servers.append(server)
    return int(server.server_port)


def stop_metrics_servers() -> None:
    """Shut down every server ``start_metrics_server`` started (tests, clean exits)."""
    while _servers:
        server = _servers.pop()
        server.shutdown()
        server.server_close()
