"""One config dataclass per component, loaded from YAML and ``KVSTORE_*`` variables
(``kvstore.config_loader``).

Precedence: defaults < YAML file < environment. A YAML file has one mapping per component
(``pool:``, ``server:``, ``client:``, ``index:``, ``coordinator:``, ``worker:``, ``serve:``,
``security:``); the variable for a field is ``KVSTORE_<COMPONENT>_<FIELD>``
(``KVSTORE_POOL_CAPACITY_BYTES=4GiB``).
Every dataclass validates itself in ``__post_init__`` with a message that names the setting
and says what to change.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Literal, get_args

from kvstore.errors import ConfigError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "KB": 1000, "KI": 1024, "KIB": 1024, "M": 1000**2,
          "MB": 1000**2, "MI": 1024**2, "MIB": 1024**2, "G": 1000**3, "GB": 1000**3,
          "GI": 1024**3, "GIB": 1024**3, "T": 1000**4, "TB": 1000**4, "TI": 1024**4,
          "TIB": 1024**4}


#: What a size may end with, for error messages (case does not matter).
SIZE_UNITS_HELP = ("a number of bytes with an optional unit: B; KiB, MiB, GiB, TiB (powers of "
                   "1024); K/KB, M/MB, G/GB, T/TB (powers of 1000); e.g. 512MiB, 4GiB, 1073741824")

#: The dtypes a worker's model can run in; int8 and uint8 are namespace dtypes (blocks may
#: carry them) but the model loader has no such path, so validation refuses them instead of
#: the loader, later.
WORKER_DTYPES: tuple[str, ...] = ("float32", "float16", "bfloat16")


def parse_size(value: str | int) -> int:
    """``"4GiB"`` -> 4294967296; ints pass through. Raises ConfigError on anything else."""
    if isinstance(value, int):
        return value
    m = _SIZE.match(str(value))
    if not m:
        sign = "a size is > 0: " if str(value).strip().startswith("-") else ""
        raise ConfigError(f"{value!r} is not a size; {sign}write {SIZE_UNITS_HELP}")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


@dataclass(slots=True)
class PoolConfig:
    """A store node's block memory."""

    capacity_bytes: int = 1 << 30
    shm_dir: str = "/dev/shm"
    # The disk tier under the arena (kvstore.node.tiered_pool): blocks evicted for space are
    # written here instead of dropped, and found again after a restart. None: no disk tier.
    # One directory per store node (a second node on the same directory runs without one).
    disk_dir: str | None = None
    disk_capacity_bytes: int = 0  # required with disk_dir; the tier never holds more
    # Bytes of evicted blocks waiting for the disk writer; past this, demotions are dropped
    # (counted as kvstore_tier_drops{reason="queue_full"}) rather than waited for.
    disk_queue_bytes: int = 256 << 20
    # fdatasync every block file before it becomes visible: survives a power cut, costs a
    # device flush per block. Off: a kill or crash still exposes only whole blocks (write,
    # then rename), and a file a power cut tore fails verification and is a miss.
    disk_fsync: bool = False
    # How block files are read back (kvstore.node.disk_reads): "direct" (O_DIRECT through an
    # aligned buffer: no page-cache copy kept; falls back to "buffered" where the filesystem
    # refuses it) or "buffered" (the page cache, dropped after each read). bench_tier measures
    # both on the disk it is given.
    disk_read_path: str = "direct"

    def __post_init__(self) -> None:
        self.capacity_bytes = parse_size(self.capacity_bytes)
        _check(self.capacity_bytes > 0, "pool.capacity_bytes must be > 0 (e.g. 4GiB)")
        _check(os.path.isdir(self.shm_dir), f"pool.shm_dir {self.shm_dir!r} is not a directory")
        self.disk_capacity_bytes = parse_size(self.disk_capacity_bytes)
        self.disk_queue_bytes = parse_size(self.disk_queue_bytes)
        if self.disk_dir:
            _check(self.disk_capacity_bytes > 0, "pool.disk_dir needs pool.disk_capacity_bytes "
                   "(--disk-capacity), e.g. 100GiB")
            _check(not os.path.exists(self.disk_dir) or os.path.isdir(self.disk_dir),
                   f"pool.disk_dir {self.disk_dir!r} exists and is not a directory")
        _check(self.disk_capacity_bytes >= 0, "pool.disk_capacity_bytes must be >= 0")
        # A capacity with nowhere to put it is a forgotten --disk-dir, not a wish for none.
        _check(bool(self.disk_dir) or not self.disk_capacity_bytes,
               "pool.disk_capacity_bytes needs pool.disk_dir (--disk-dir): where the disk "
               "tier's files go")
        _check(self.disk_queue_bytes > 0, "pool.disk_queue_bytes must be > 0 (e.g. 256MiB)")
        _check(self.disk_read_path in ("direct", "buffered"),
               f"pool.disk_read_path must be 'direct' or 'buffered', got {self.disk_read_path!r}")

    @property
    def disk_enabled(self) -> bool:
        """Whether store nodes keep a disk tier."""
        return bool(self.disk_dir)


@dataclass(slots=True)
class ServerConfig:
    """A store node's gRPC server (control + data) and its bulk byte channel."""

    host: str = "127.0.0.1"
    port: int = 0
    bulk_port: int = 0
    advertise_host: str | None = None
    # The cluster token: the root credential (admin, every tenant). Tenant credentials
    # (kvstore.security.grants) are signed with a key derived from it. Unset disables auth,
    # which `kvstore start` refuses off loopback unless security.insecure says so.
    auth_token: str | None = None
    # Still accepted while `kvstore rotate-credentials` hands the new token out.
    previous_auth_token: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    # The same as PEM text, handed to a store node by the code that starts it (per-node
    # certificates issued by the cluster's private CA); the *_file settings win if both are set.
    tls_cert_pem: str | None = None
    tls_key_pem: str | None = None
    max_message_bytes: int = 64 << 20
    max_workers: int = 8
    # Resource bounds a hostile or broken client cannot exceed (docs/security.md).
    max_block_bytes: int = 256 << 20  # one block's encoded size; a namespace above it is refused
    max_concurrent_rpcs: int = 64  # gRPC calls in flight; beyond: RESOURCE_EXHAUSTED at once
    max_concurrent_puts: int = 4  # Put streams at once: reads always keep workers of their own
    put_idle_timeout_s: float = 10.0  # a Put stream silent this long is cancelled
    max_bulk_connections: int = 256  # bulk channel connections open at once, all peers
    max_bulk_connections_per_peer: int = 32  # ... from one peer address
    # A bulk connection must deliver its first whole request (TLS handshake included) within
    # this, and each later request within this once its first bytes arrive; else it is closed.
    bulk_header_timeout_s: float = 10.0
    max_lease_ttl_s: float = 300.0  # a lease asked for longer is clamped to this
    # Prometheus /metrics of the node: 0 picks a free port (shown by `kvstore status`), None
    # turns it off; loopback unless metrics_host says otherwise.
    metrics_port: int | None = 0
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        self.max_message_bytes = parse_size(self.max_message_bytes)
        for name in ("port", "bulk_port", "metrics_port"):
            v = getattr(self, name)
            _check(v is None or 0 <= v < 65536,
                   f"server.{name} must be in [0, 65535] (0 picks a free port)")
        _check((self.tls_cert_file is None) == (self.tls_key_file is None),
               "server.tls_cert_file and server.tls_key_file must be set together")
        _check(self.max_message_bytes >= 4 << 20, "server.max_message_bytes must be >= 4MiB")
        _check(self.max_workers >= 1, "server.max_workers must be >= 1")
        self.max_block_bytes = parse_size(self.max_block_bytes)
        _check(self.max_block_bytes >= 4096, "server.max_block_bytes must be >= 4KiB")
        _check((self.tls_cert_pem is None) == (self.tls_key_pem is None),
               "server.tls_cert_pem and server.tls_key_pem must be set together")
        for name in ("max_concurrent_rpcs", "max_concurrent_puts", "max_bulk_connections",
                     "max_bulk_connections_per_peer"):
            _check(getattr(self, name) >= 1, f"server.{name} must be >= 1")
        _check(self.put_idle_timeout_s > 0, "server.put_idle_timeout_s must be > 0 seconds")
        _check(self.bulk_header_timeout_s > 0,
               "server.bulk_header_timeout_s must be > 0 seconds (e.g. 10)")
        _check(self.max_lease_ttl_s > 0, "server.max_lease_ttl_s must be > 0 seconds")

    @property
    def tls_enabled(self) -> bool:
        return bool((self.tls_cert_file and self.tls_key_file)
                    or (self.tls_cert_pem and self.tls_key_pem))


@dataclass(slots=True)
class ClientConfig:
    """How clients reach store nodes."""

    timeout_s: float = 30.0
    retries: int = 2
    # The cluster token, or a tenant credential from `kvstore credentials issue`.
    auth_token: str | None = None
    tls_ca_file: str | None = None
    tls_ca_pem: str | None = None  # the CA as PEM text (handed out by `kvstore start`)
    max_message_bytes: int = 64 << 20
    node_id: str | None = None
    # A bulk read of many blocks goes out as requests of this many blocks, this many in flight
    # on one connection: the node streams one while the next is already queued.
    bulk_request_blocks: int = 32
    bulk_pipeline_depth: int = 4
    # A read of more than one request's blocks is split over up to this many connections
    # (the node serves each on its own thread): one TCP stream caps a large read.
    bulk_streams: int = 4
    # How long a reader trusts a holder the index told it (or its own Put), without asking
    # again; 0 asks the index every time. Staleness costs misses, never wrong KV (design.md §4).
    index_view_ttl_s: float = 1.0
    # A node that did not answer is skipped (its blocks recomputed) this long, then probed by
    # one read; each failure in a row doubles it up to the max (kvstore.client.unreachable).
    unreachable_cooldown_s: float = 5.0
    unreachable_max_cooldown_s: float = 30.0

    def __post_init__(self) -> None:
        self.max_message_bytes = parse_size(self.max_message_bytes)
        _check(self.timeout_s > 0, "client.timeout_s must be > 0 seconds")
        _check(0 <= self.index_view_ttl_s <= 60, "client.index_view_ttl_s must be in [0, 60]")
        _check(self.retries >= 0, "client.retries must be >= 0")
        _check(1 <= self.bulk_request_blocks <= 4096,
               "client.bulk_request_blocks must be between 1 and 4096")
        _check(self.bulk_pipeline_depth >= 1, "client.bulk_pipeline_depth must be >= 1")
        _check(1 <= self.bulk_streams <= 16, "client.bulk_streams must be between 1 and 16")
        _check(0 <= self.unreachable_cooldown_s <= self.unreachable_max_cooldown_s <= 3600,
               "client.unreachable_cooldown_s must be >= 0 (0: never skip a node) and at most "
               "client.unreachable_max_cooldown_s, which must be <= 3600")


#: The index backends ``kvstore.index.factory`` can build.
IndexBackend = Literal["memory", "redis"]


@dataclass(slots=True)
class IndexConfig:
    """The global index: ``memory`` (embedded default) or ``redis``."""

    backend: IndexBackend = "memory"
    redis_url: str | None = None
    key_prefix: str = "kvstore:"
    redis_ca_file: str | None = None  # CA bundle for rediss:// (TLS) with a private CA
    # The same as PEM text: `kvstore start` reads the file (or, on a secure cluster with a
    # rediss:// URL and no CA named, takes the cluster CA) so store nodes need no file.
    redis_ca_pem: str | None = None
    # The Redis password, kept out of redis_url (and so out of argv and `ps`): a file holding
    # it, or KVSTORE_INDEX_REDIS_PASSWORD. A password inside redis_url still works.
    redis_password_file: str | None = None
    redis_password: str | None = None

    def __post_init__(self) -> None:
        _check(self.backend in get_args(IndexBackend),
               f"index.backend must be one of {list(get_args(IndexBackend))}, "
               f"got {self.backend!r}")
        if self.backend == "redis":
            _check(bool(self.redis_url), "index.backend=redis needs index.redis_url "
                   "(redis://[:password@]host:port/db or rediss:// for TLS)")


@dataclass(slots=True)
class CoordinatorConfig:
    """Cluster LRU, watermarks, leases, pins and liveness."""

    # Kept close to full: each point of capacity held back costs hit rate against an exact
    # LRU of the whole pool; a full pool's Put evicts down to the low watermark
    # synchronously, so the heartbeat's plan is only headroom.
    high_watermark: float = 0.97
    low_watermark: float = 0.95
    lease_ttl_s: float = 30.0
    soft_pin_ttl_s: float = 3600.0
    node_timeout_s: float = 10.0
    heartbeat_interval_s: float = 1.0
    hot_fetch_threshold: int = 3
    # the coordinator's Prometheus /metrics: 0 picks a free port, None turns it off
    metrics_port: int | None = 0
    metrics_host: str = "127.0.0.1"
    # The data path's lookups and publishes over gRPC (kvstore.coordinator.index_service),
    # bound and authenticated as the store nodes are (server.*): 0 picks a free port, None
    # turns it off (every caller then uses the Ray actor).
    index_port: int | None = 0

    def __post_init__(self) -> None:
        _check(self.metrics_port is None or 0 <= self.metrics_port < 65536,
               "coordinator.metrics_port must be in [0, 65535] (0 picks a free port)")
        _check(self.index_port is None or 0 <= self.index_port < 65536,
               "coordinator.index_port must be in [0, 65535] (0 picks a free port; null: off)")
        _check(0 < self.low_watermark < self.high_watermark <= 1.0,
               "coordinator watermarks need 0 < low_watermark < high_watermark <= 1 "
               f"(got low={self.low_watermark}, high={self.high_watermark})")
        _check(self.lease_ttl_s > 0, "coordinator.lease_ttl_s must be > 0")
        _check(self.node_timeout_s > self.heartbeat_interval_s > 0,
               "coordinator.node_timeout_s must exceed heartbeat_interval_s > 0")


@dataclass(slots=True)
class SecurityConfig:
    """Secrets and the secure-by-default switch (docs/security.md).

    ``data_key`` (hex) is the cluster's data secret: it is mixed into every namespace root (so
    nobody outside can precompute a public prompt's keys) and every tenant's block MAC key (so
    a block verifies only if a holder of that tenant's key wrote it). It is not rotated with the
    auth token: blocks stay valid across `kvstore rotate-credentials`. Unset (the embedded
    default on loopback): public roots and an xxh3 checksum.
    """

    insecure: bool = False  # run a cluster without auth and TLS on purpose (logged loudly)
    secrets_dir: str | None = None  # where `kvstore start` keeps and finds the cluster secrets
    data_key: str | None = None

    def __post_init__(self) -> None:
        if self.data_key is not None:
            try:
                raw = bytes.fromhex(self.data_key)
            except ValueError:
                raw = b""
            _check(len(raw) >= 16, "security.data_key must be at least 32 hex digits "
                   "(16 bytes); `kvstore start` generates one")


#: How a worker reuses cached blocks (``kvstore.workers.engine.reuse_policy``): ``exact`` (bitwise
#: equal to ``--no-cache``, at block granularity where the probe allows), ``block`` (any block
#: boundary, approximate where the probe fails), ``chunk`` (whole chunks only).
ReuseMode = Literal["exact", "block", "chunk"]
PublishWhenFull = Literal["wait", "drop"]  # a full publish backlog: wait for room, or drop


@dataclass(slots=True)
class WorkerConfig:
    """Model and engine settings of prefill/decode workers (docs/configuration.md). ``auto``
    device, dtype and attention resolve where the model loads (``kvstore.workers.model.device``)."""

    model: str = "tiny"
    seed: int = 0
    dtype: str = "auto"
    device: str = "auto"
    # auto, or the GPUs each Ray replica asks for (kvstore.workers.replicas.placement); loaded
    # as text
    gpus_per_replica: str | float = "auto"
    attn_implementation: str = "auto"
    numerics: str = "auto"  # auto (tagged), portable (no tag) or a tag given literally
    block_size: int = 16
    prefill_chunk_tokens: int = 256
    reuse: ReuseMode = "exact"
    num_threads: int = 1
    cache_salt: str = ""
    max_new_tokens: int = 16
    request_timeout_s: float = 300.0
    publish_backlog_blocks: int = 8192  # 0: publish on the request's own thread
    publish_backlog_bytes: int = 4 << 30  # device memory the queued blocks may hold
    publish_when_full: PublishWhenFull = "wait"
    publish_wait_s: float = 10.0  # a decode waiting for a prefill's queued blocks

    def __post_init__(self) -> None:
        _check(self.block_size > 0, "worker.block_size must be > 0")
        _check(self.dtype == "auto" or self.dtype in WORKER_DTYPES,
               f"worker.dtype {self.dtype!r} is not supported; use auto or one of "
               f"{list(WORKER_DTYPES)}")
        _check(self.attn_implementation in ("auto", "eager", "sdpa"),
               f"worker.attn_implementation must be auto, eager or sdpa, got "
               f"{self.attn_implementation!r}")
        _check(isinstance(self.device, str) and bool(self.device.strip()),
               "worker.device must be auto or a torch device string such as cpu, cuda:0")
        if self.gpus_per_replica != "auto":
            try:
                gpus = float(self.gpus_per_replica)
            except (TypeError, ValueError):
                gpus = math.nan
            _check(math.isfinite(gpus) and gpus >= 0 and (gpus <= 1 or gpus.is_integer()),
                   "worker.gpus_per_replica must be auto, a share of one GPU (0 to 1, e.g. 0.5) "
                   f"or a whole number of GPUs, got {self.gpus_per_replica!r}")
            self.gpus_per_replica = gpus
        _check(isinstance(self.numerics, str) and bool(self.numerics),
               "worker.numerics must be auto, portable or a numerics tag (as kvstore status "
               "shows it)")
        _check(self.publish_wait_s >= 0, "worker.publish_wait_s must be >= 0")
        _check(self.publish_backlog_blocks >= 0,
               "worker.publish_backlog_blocks must be >= 0 (0: publish on the request's thread)")
        self.publish_backlog_bytes = parse_size(self.publish_backlog_bytes)
        _check(self.publish_backlog_bytes > 0,
               "worker.publish_backlog_bytes must be > 0 (e.g. 4GiB); to publish on the "
               "request's thread set worker.publish_backlog_blocks: 0")
        _check(self.publish_when_full in get_args(PublishWhenFull),
               f"worker.publish_when_full must be one of {list(get_args(PublishWhenFull))}, "
               f"got {self.publish_when_full!r}")
        _check(self.prefill_chunk_tokens > 0 and self.prefill_chunk_tokens % self.block_size == 0,
               f"worker.prefill_chunk_tokens ({self.prefill_chunk_tokens}) must be a positive "
               f"multiple of worker.block_size ({self.block_size})")
        _check(self.num_threads >= 1, "worker.num_threads must be >= 1")
        _check(self.max_new_tokens >= 0,
               "worker.max_new_tokens must be >= 0 (0: prefill and publish only, a warm-up)")
        _check(self.reuse in get_args(ReuseMode),
               f"worker.reuse must be one of {list(get_args(ReuseMode))}, got {self.reuse!r}")


#: Whether the HTTP front end looks a prompt's prefix up to route it to the node holding it:
#: ``auto`` when Ray has more than one node, ``always``, or ``off`` (Serve's own routing).
PrefixRouting = Literal["auto", "always", "off"]


@dataclass(slots=True)
class ServeConfig:
    """``kvstore serve``: the OpenAI-compatible HTTP front end and its Ray Serve replicas.

    ``api_key`` comes from the file, ``KVSTORE_SERVE_API_KEY`` or ``api_key_file`` — never
    from a command line, where ``ps`` would show it. With ``autoscaling`` on, Serve scales
    each kind of replica between ``min_replicas`` and ``max_replicas`` to keep about
    ``target_ongoing_requests`` per replica; otherwise the replica counts are fixed.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None
    api_key: str | None = None
    api_key_file: str | None = None
    prefill_replicas: int = 1
    decode_replicas: int = 1
    autoscaling: bool = False
    min_replicas: int = 1
    max_replicas: int = 4
    target_ongoing_requests: float = 2.0
    max_ongoing_requests: int = 4
    max_queued_requests: int = 64
    default_max_tokens: int = 256
    max_stop_sequences: int = 4
    prefix_routing: PrefixRouting = "auto"

    def __post_init__(self) -> None:
        # Not 0: the server must know its own address (clients, --ready-file, the health
        # wait), and Serve's proxy does not say which port it picked.
        _check(0 < self.port < 65536, "serve.port must be in [1, 65535] (the server's "
               "address must be known: pick a free port)")
        _check(self.prefix_routing in get_args(PrefixRouting),
               f"serve.prefix_routing must be one of {list(get_args(PrefixRouting))}, got "
               f"{self.prefix_routing!r}")
        for name in ("prefill_replicas", "decode_replicas", "min_replicas",
                     "max_ongoing_requests", "max_queued_requests", "default_max_tokens",
                     "max_stop_sequences"):
            _check(getattr(self, name) >= 1, f"serve.{name} must be >= 1")
        _check(self.max_replicas >= self.min_replicas,
               "serve.max_replicas must be >= serve.min_replicas")
        _check(self.target_ongoing_requests > 0, "serve.target_ongoing_requests must be > 0")
        _check(self.api_key is None or len(self.api_key) >= 8,
               "serve.api_key must be at least 8 characters (or unset for no key)")


@dataclass(slots=True)
class KVStoreConfig:
    """All components' settings."""

    pool: PoolConfig = field(default_factory=PoolConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    index: IndexConfig = field(default_factory=IndexConfig)
    coordinator: CoordinatorConfig = field(default_factory=CoordinatorConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
