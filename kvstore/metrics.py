"""Prometheus metrics of kvstore, in one module-level registry, and the HTTP server for it.

Every metric is created once, when this module is first imported, in ``REGISTRY``; components
in one process (a store node, the coordinator) share it, so none of them can register a series
twice. Helpers check label values against fixed sets: an unknown label would silently start a
new time series, so it raises instead.

Who records what (docs/metrics.md lists every series):

- a store node records what it serves, stores and evicts, its pool gauges (read at scrape
  time), and the readers' figures they push to it (``apply_reader_tally``);
- readers never record here: ``kvstore.reader_metrics`` tallies their hits, misses, fetches
  and latencies and ``ClusterStore`` pushes the tally to its store node;
- the coordinator records its table size, drift, orders, liveness and pins.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from kvstore.reader_metrics import (
    PATHS,
    PREFILL_KINDS,
    REJECT_REASONS,
    ReaderTally,
    check_label,
)
from kvstore.reader_metrics import record_prefill_tokens as record_prefill_tokens
from kvstore.records import MISS_REASONS, PoolStats

#: Why a node evicted blocks: its pool was full on a put (capacity), the coordinator's
#: high-watermark plan (watermark), a drain or a namespace invalidation, or an operator's Evict;
#: ``disk``: the coordinator's plan for a disk tier past its high watermark (its LRU dropped).
EVICTION_CAUSES = ("capacity", "watermark", "drain", "invalidate", "admin", "disk")
#: How blocks came into a node's pool: a client's Put, or a copy the coordinator ordered.
STORE_SOURCES = ("put", "replica")
#: Why a node's bulk channel refused a connection or request: a connection cap (all peers, one
#: peer, no thread left), no whole request before the header deadline, a missing or wrong
#: credential, a tenant the credential does not grant, a malformed or oversized request, or a
#: failure of the pool.
BULK_REFUSALS = ("connections", "peer_connections", "threads", "header_timeout",
                 "unauthenticated", "forbidden", "bad_request", "too_large", "error")

#: Why a block was lost to a node's disk tier: the demotion queue was full, the disk had no
#: room (ENOSPC), was read-only or failed (EIO and the rest), a file failed verification on
#: its way back (corrupted), or the tier dropped its least recently used file for a newer one.
TIER_DROP_REASONS = ("queue_full", "no_space", "read_only", "io_error", "corrupted", "lru")
#: The two ways a block moves between a node's tiers.
TIER_MOVES = ("demotion", "promotion")
#: A node's tiers, fastest first.
TIERS = ("arena", "disk")

log = logging.getLogger(__name__)
REGISTRY = CollectorRegistry(auto_describe=True)
_LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5,
                    1.0, 2.5, 5.0, 10.0)  # 100 us (same-node shm) to 10 s (a slow remote node)

# -- readers' figures (pushed by readers, recorded by the store node they push to) ---------------
HITS = Counter("kvstore_hits", "Requested blocks that came back verified", registry=REGISTRY)
MISSES = Counter("kvstore_misses", "Requested blocks that could not be used", ["reason"],
                 registry=REGISTRY)
FETCHED_BLOCKS = Counter("kvstore_fetched_blocks", "Verified blocks readers fetched", ["path"],
                         registry=REGISTRY)
FETCHED_BYTES = Counter("kvstore_fetched_bytes", "Bytes of verified blocks readers fetched",
                        ["path"], registry=REGISTRY)
FETCH_LATENCY = Histogram("kvstore_fetch_latency_seconds",
                          "Time to fetch and verify one batch of blocks from one node", ["path"],
                          buckets=_LATENCY_BUCKETS, registry=REGISTRY)
PREFILL_TOKENS = Counter("kvstore_prefill_tokens",
                         "Prompt tokens by where their KV came from: cached (reused), "
                         "unreused_shared (cached but recomputed), computed",
                         ["kind"], registry=REGISTRY)
# -- both: readers' verification failures and a node's refused puts -----------------------------
REJECTED = Counter("kvstore_rejected_blocks", "Blocks refused by verification or limits",
                   ["reason"], registry=REGISTRY)
# -- a store node's own figures ------------------------------------------------------------------
SERVED_BLOCKS = Counter("kvstore_served_blocks", "Blocks a node served to readers (shm: leased "
                        "to same-node readers)", ["path"], registry=REGISTRY)
SERVED_BYTES = Counter("kvstore_served_bytes", "Bytes of blocks a node served", ["path"],
                       registry=REGISTRY)
STORED_BLOCKS = Counter("kvstore_stored_blocks", "Blocks stored into a node's pool", ["source"],
                        registry=REGISTRY)
STORED_BYTES = Counter("kvstore_stored_bytes", "Bytes of blocks stored into a node's pool",
                       ["source"], registry=REGISTRY)
PUT_LATENCY = Histogram("kvstore_put_latency_seconds",
                        "Time a node took to receive, verify, store and publish one Put call",
                        buckets=_LATENCY_BUCKETS, registry=REGISTRY)
EVICTIONS = Counter("kvstore_evictions", "Blocks evicted from a node's pool", ["node_id", "cause"],
                    registry=REGISTRY)
BULK_REFUSED = Counter("kvstore_bulk_refused", "Connections and requests a node's bulk channel "
                       "refused", ["reason"], registry=REGISTRY)
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
TIER_HITS = Counter("kvstore_tier_hits", "Blocks a node served, by the tier that held them "
                    "(disk: read from the disk tier, then promoted)", ["tier"], registry=REGISTRY)
TIER_MOVES_TOTAL = Counter("kvstore_tier_moves", "Blocks moved between a node's tiers "
                           "(demotion: arena to disk for space; promotion: disk to arena on "
                           "a read)", ["move"], registry=REGISTRY)
TIER_DROPS = Counter("kvstore_tier_drops", "Blocks a node's disk tier lost, by reason",
                     ["reason"], registry=REGISTRY)
DISK_READ_BYTES = Counter("kvstore_disk_read_bytes", "Bytes a node read from its disk tier",
                          registry=REGISTRY)
DISK_READ_LATENCY = Histogram("kvstore_disk_read_seconds",
                              "Time to read one block from the disk tier into the arena",
                              buckets=_LATENCY_BUCKETS, registry=REGISTRY)
DISK_USED_BYTES = Gauge("kvstore_disk_used_bytes", "Bytes of block files in a node's disk tier",
                        ["node_id"], registry=REGISTRY)
DISK_CAPACITY_BYTES = Gauge("kvstore_disk_capacity_bytes", "A node's disk tier capacity "
                            "(0: no disk tier)", ["node_id"], registry=REGISTRY)
DISK_BLOCKS = Gauge("kvstore_disk_blocks", "Blocks held in a node's disk tier", ["node_id"],
                    registry=REGISTRY)
# -- the coordinator's view of the cluster (set in the coordinator actor's process) -------------
COORD_BLOCKS = Gauge("kvstore_coordinator_blocks", "Blocks the coordinator's table tracks",
                     registry=REGISTRY)
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
# -- the workers (set in each prefill/decode worker's process; served only if it serves) --------
REUSE_POLICY = Gauge("kvstore_worker_reuse_policy",
                     "A worker's reuse policy in force (1): where hits resume, the smallest "
                     "piece a chunk is computed in, and whether reuse is bitwise",
                     ["mode", "resume", "min_piece", "exact"], registry=REGISTRY)
PUBLISH_BACKLOG = Gauge("kvstore_worker_publish_backlog_blocks",
                        "Blocks a worker has computed and not yet published (copied off the "
                        "device, encoded, put)", registry=REGISTRY)
PUBLISH_BLOCKS = Counter("kvstore_worker_publish_blocks",
                         "Blocks a worker's background publisher finished, by outcome",
                         ["outcome"], registry=REGISTRY)
PUBLISH_WAIT = Counter("kvstore_worker_publish_wait_seconds",
                       "Seconds requests waited for room in a full publish backlog "
                       "(worker.publish_when_full: wait)", registry=REGISTRY)
PUBLISH_LATENCY = Histogram("kvstore_worker_publish_seconds",
                            "From a prefill's blocks being queued to their put returning",
                            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
                            registry=REGISTRY)
DEVICE_READS = Counter("kvstore_worker_device_reads",
                       "Same-node reads of large blocks into a CUDA device, by path: direct "
                       "(DMA from the page-locked arena) or staged (pinned staging copies)",
                       ["path"], registry=REGISTRY)
#: How a same-node read reaches a CUDA device (``kvstore.client.device_reads``).
DEVICE_READ_PATHS = ("direct", "staged")
#: Outcomes of a background publish: put, dropped (backlog full, publish_when_full: drop),
#: failed (the store refused or was unreachable).
PUBLISH_OUTCOMES = ("published", "dropped", "failed")

# Every fixed label value starts at zero, so a scrape shows 0 rather than no series at all
# (rate() and absent-series alerts then work from the first scrape).
for _path in PATHS:
    for _series in (FETCHED_BLOCKS, FETCHED_BYTES, FETCH_LATENCY, SERVED_BLOCKS, SERVED_BYTES):
        _series.labels(path=_path)
for _reason in MISS_REASONS:
    MISSES.labels(reason=_reason)
for _refusal in REJECT_REASONS:
    REJECTED.labels(reason=_refusal)
for _source in STORE_SOURCES:
    STORED_BLOCKS.labels(source=_source)
    STORED_BYTES.labels(source=_source)
for _kind in PREFILL_KINDS:
    PREFILL_TOKENS.labels(kind=_kind)
for _kind in ("added", "removed"):
    COORD_DRIFT.labels(kind=_kind)
for _refused in BULK_REFUSALS:
    BULK_REFUSED.labels(reason=_refused)
for _outcome in PUBLISH_OUTCOMES:
    PUBLISH_BLOCKS.labels(outcome=_outcome)

for _tier in TIERS:
    TIER_HITS.labels(tier=_tier)
for _move in TIER_MOVES:
    TIER_MOVES_TOTAL.labels(move=_move)
for _drop in TIER_DROP_REASONS:
    TIER_DROPS.labels(reason=_drop)

_servers: list[WSGIServer] = []


# -- a store node -------------------------------------------------------------------------------
def record_served(path: str, num_blocks: int, nbytes: int) -> None:
    """Count blocks a node served over ``path`` (grpc | bulk | shm)."""
    check_label(path, PATHS, "path")
    SERVED_BLOCKS.labels(path=path).inc(num_blocks)
    SERVED_BYTES.labels(path=path).inc(nbytes)


def record_stored(source: str, num_blocks: int, nbytes: int) -> None:
    """Count blocks stored into a node's pool from ``source`` (put | replica)."""
    check_label(source, STORE_SOURCES, "store source")
    STORED_BLOCKS.labels(source=source).inc(num_blocks)
    STORED_BYTES.labels(source=source).inc(nbytes)


def observe_put(seconds: float) -> None:
    """Record one Put call's latency at the node."""
    PUT_LATENCY.observe(seconds)


def record_rejected(reason: str, num_blocks: int = 1) -> None:
    """Count blocks a node refused on the way in, by one of ``REJECT_REASONS``."""
    REJECTED.labels(reason=check_label(reason, REJECT_REASONS, "reject reason")).inc(num_blocks)


def record_bulk_refused(reason: str) -> None:
    """Count one connection or request the bulk channel refused, by one of ``BULK_REFUSALS``."""
    BULK_REFUSED.labels(reason=check_label(reason, BULK_REFUSALS, "bulk refusal")).inc()


def record_evictions(node_id: str, cause: str, num_blocks: int) -> None:
    """Count blocks a node evicted, by one of ``EVICTION_CAUSES``."""
    check_label(cause, EVICTION_CAUSES, "eviction cause")
    if num_blocks:
        EVICTIONS.labels(node_id=node_id, cause=cause).inc(num_blocks)


def record_tier_hits(tier: str, num_blocks: int) -> None:
    """Count blocks served from ``tier`` (one of ``TIERS``)."""
    TIER_HITS.labels(tier=check_label(tier, TIERS, "tier")).inc(num_blocks)


def record_tier_moves(move: str, num_blocks: int) -> None:
    """Count blocks demoted to or promoted from the disk tier (one of ``TIER_MOVES``)."""
    TIER_MOVES_TOTAL.labels(move=check_label(move, TIER_MOVES, "tier move")).inc(num_blocks)


def record_tier_drops(reason: str, num_blocks: int) -> None:
    """Count blocks the disk tier lost, by one of ``TIER_DROP_REASONS``."""
    TIER_DROPS.labels(reason=check_label(reason, TIER_DROP_REASONS, "tier drop reason")
                      ).inc(num_blocks)


def observe_disk_read(seconds: float, nbytes: int) -> None:
    """Record one block read from the disk tier."""
    DISK_READ_LATENCY.observe(seconds)
    DISK_READ_BYTES.inc(nbytes)


def observe_pool(node_id: str, stats: PoolStats) -> None:
    """Publish a pool's occupancy once (``watch_pool`` keeps it current instead)."""
    POOL_USED_BYTES.labels(node_id=node_id).set(stats.used_bytes)
    POOL_CAPACITY_BYTES.labels(node_id=node_id).set(stats.capacity_bytes)
    POOL_BLOCKS.labels(node_id=node_id).set(stats.num_blocks)
    POOL_PINNED_BLOCKS.labels(node_id=node_id).set(stats.num_pinned)
    POOL_LEASED_BLOCKS.labels(node_id=node_id).set(stats.num_leased)


def watch_pool(node_id: str, stats: Callable[[], PoolStats]) -> None:
    """Read the pool gauges from ``stats()`` at every scrape, so they are never a beat old."""
    def reader(field: str) -> Callable[[], float]:
        return lambda: float(getattr(stats(), field))

    for gauge, field in ((POOL_USED_BYTES, "used_bytes"), (POOL_CAPACITY_BYTES, "capacity_bytes"),
                         (POOL_BLOCKS, "num_blocks"), (POOL_PINNED_BLOCKS, "num_pinned"),
                         (POOL_LEASED_BLOCKS, "num_leased"),
                         (DISK_USED_BYTES, "disk_used_bytes"),
                         (DISK_CAPACITY_BYTES, "disk_capacity_bytes"),
                         (DISK_BLOCKS, "disk_blocks")):
        gauge.labels(node_id=node_id).set_function(reader(field))
    for cause in EVICTION_CAUSES:  # zero until the first eviction, not absent
        EVICTIONS.labels(node_id=node_id, cause=cause)


def forget_node(node_id: str) -> None:
    """Drop a departed node's series so dashboards do not show a dead node's last values."""
    for gauge in (POOL_USED_BYTES, POOL_CAPACITY_BYTES, POOL_BLOCKS, POOL_PINNED_BLOCKS,
                  POOL_LEASED_BLOCKS, DISK_USED_BYTES, DISK_CAPACITY_BYTES, DISK_BLOCKS):
        try:
            gauge.remove(node_id)
        except KeyError:
            pass  # the node never reported this series
    for cause in EVICTION_CAUSES:
        try:
            EVICTIONS.remove(node_id, cause)
        except KeyError:
            pass


def apply_reader_tally(tally: ReaderTally) -> None:
    """Record a reader's pushed tally; ValueError (nothing recorded) on an unknown label."""
    for reason in tally.misses:
        check_label(reason, MISS_REASONS, "miss reason")
    for reason in tally.rejected:
        check_label(reason, REJECT_REASONS, "reject reason")
    for path in (*tally.fetched_blocks, *tally.fetched_bytes, *tally.fetch_seconds):
        check_label(path, PATHS, "path")
    for kind in tally.prefill_tokens:
        check_label(kind, PREFILL_KINDS, "prefill token kind")
    if tally.hits:
        HITS.inc(tally.hits)
    for series, counts in ((MISSES, tally.misses), (REJECTED, tally.rejected)):
        for reason, n in counts.items():
            series.labels(reason=reason).inc(n)
    for series, counts in ((FETCHED_BLOCKS, tally.fetched_blocks),
                           (FETCHED_BYTES, tally.fetched_bytes)):
        for path, n in counts.items():
            series.labels(path=path).inc(n)
    for path, seconds in tally.fetch_seconds.items():
        child = FETCH_LATENCY.labels(path=path)
        for s in seconds:
            child.observe(s)
    for kind, n in tally.prefill_tokens.items():
        PREFILL_TOKENS.labels(kind=kind).inc(n)


# -- the coordinator ----------------------------------------------------------------------------
def observe_coordinator(nodes_alive: int, pins: dict[str, int]) -> None:
    """Publish the coordinator's live-node count and pin counts (``{"hard": n, "soft": m}``)."""
    COORD_NODES_ALIVE.set(nodes_alive)
    for kind in ("hard", "soft"):
        COORD_PINS.labels(kind=kind).set(pins.get(kind, 0))


def watch_coordinator_table(num_blocks: Callable[[], int]) -> None:
    """Read the coordinator's table size at every scrape."""
    COORD_BLOCKS.set_function(lambda: float(num_blocks()))


def record_drift(added: int, removed: int) -> None:
    """Count index entries a reconcile added and removed."""
    if added:
        COORD_DRIFT.labels(kind="added").inc(added)
    if removed:
        COORD_DRIFT.labels(kind="removed").inc(removed)


# -- a worker -----------------------------------------------------------------------------------
def observe_reuse_policy(policy: dict[str, object]) -> None:
    """Publish the reuse policy a worker runs with (``ReusePolicy.as_dict``)."""
    sizes = policy["piece_sizes"]
    REUSE_POLICY.labels(mode=str(policy["mode"]), resume=str(policy["resume"]),
                        min_piece=str(sizes[0]) if isinstance(sizes, list) and sizes else "any",
                        exact=str(policy["exact"]).lower()).set(1)


def record_device_read(path: str) -> None:
    """One same-node read into a CUDA device over ``path`` (``DEVICE_READ_PATHS``)."""
    check_label(path, DEVICE_READ_PATHS, "path")
    DEVICE_READS.labels(path).inc()


def record_publish(outcome: str, num_blocks: int, seconds: float | None = None) -> None:
    """A background publish finished (``PUBLISH_OUTCOMES``), after ``seconds`` in the backlog."""
    PUBLISH_BLOCKS.labels(outcome=outcome).inc(num_blocks)
    if seconds is not None:
        PUBLISH_LATENCY.observe(seconds)


# -- serving ------------------------------------------------------------------------------------
def start_metrics_server(port: int = 0, addr: str = "127.0.0.1") -> int:
    """Serve ``REGISTRY`` over HTTP at ``/metrics``; port 0 picks a free port. Returns it.

    Loopback unless told otherwise: the series name nodes and key counts, which is nobody's
    business off the machine unless an operator says so (``server.metrics_host``).
    """
    server, _thread = start_http_server(port, addr=addr, registry=REGISTRY)
    _servers.append(server)
    return int(server.server_port)


def serve_metrics(port: int | None, host: str, advertise_ip: str, what: str) -> str | None:
    """Start this process's /metrics server; the ``host:port`` to advertise, or None when
    ``port`` is None (off) or taken: the component still runs, and logs why it has no metrics."""
    if port is None:
        return None
    try:
        bound = start_metrics_server(port, addr=host)
    except OSError as exc:
        log.error("kvstore %s cannot serve metrics on %s:%s: %s (pick a free metrics_port, or "
                  "0)", what, host, port, exc)
        return None
    return f"{advertise_ip if host in ('0.0.0.0', '::', '') else host}:{bound}"


def stop_metrics_servers() -> None:
    """Shut down every server ``start_metrics_server`` started (tests, clean exits)."""
    while _servers:
        server = _servers.pop()
        server.shutdown()
        server.server_close()
