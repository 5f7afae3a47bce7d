"""The coordinator Ray actor: a thin shell over ``CoordinatorCore``.

``kvstore.cluster.lifecycle.start_coordinator`` runs it as one named, detached actor that Ray
restarts when it dies. Every method delegates to the plain-Python core, which holds all the
policy and is tested without Ray. A restart bumps the epoch; store nodes then re-announce what
they hold. The reaper thread runs here, not in the core, because only a live actor has time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore.config import KVStoreConfig
from kvstore.coordinator.core import CoordinatorCore
from kvstore.coordinator.index_service import IndexServer
from kvstore.coordinator.liveness import NodeStatus, Reaper
from kvstore.coordinator.messages import HeartbeatReply
from kvstore.coordinator.worker_reports import WorkerTable
from kvstore.gc_tuning import freeze_startup_objects
from kvstore.index.base import IndexEntry
from kvstore.node.grpc_setup import bind_node_ip
from kvstore.process_priority import serve_at_normal_priority
from kvstore.records import NodeAddress, PoolStats, PrefixHit


class Coordinator:
    """Cluster LRU, watermarks, pins, liveness and recovery, as one Ray actor."""

    def __init__(self, config: KVStoreConfig) -> None:
        # Its index service answers lookups and publishes on the data path (below): at
        # Ray's worker niceness a busy engine on its core would keep them waiting.
        serve_at_normal_priority("the coordinator")
        self._core = CoordinatorCore(config)
        self._workers = WorkerTable()
        cfg = config.coordinator
        # Liveness does not wait for heartbeats: a lone node that dies must still be dropped.
        # The actor is threaded (max_concurrency > 1) and the core is locked, so a thread is
        # safe here; a sweep every quarter timeout declares a node dead within 1.25 timeouts.
        self._reaper = Reaper(self._tick, min(cfg.heartbeat_interval_s, cfg.node_timeout_s / 4))
        # Loopback unless coordinator.metrics_host says otherwise; the address is in status().
        import ray

        from kvstore.metrics import serve_metrics

        self.metrics_address = serve_metrics(cfg.metrics_port, cfg.metrics_host,
                                             ray.util.get_node_ip_address(), "coordinator")
        # Lookups and publishes on the data path, without an actor call (index_service).
        self._index_server: IndexServer | None = None
        if cfg.index_port is not None:
            self._index_server = IndexServer(self._core, bind_node_ip(
                config.server, ray.util.get_node_ip_address()), cfg.index_port)
            self._index_server.start()
        freeze_startup_objects()

    def index_address(self) -> str | None:
        """Where readers and store nodes reach the gRPC index service (None: it is off)."""
        return self._index_server.address if self._index_server is not None else None

    def _tick(self) -> None:
        """The reaper's sweep: an index that lost its data first, then silent nodes."""
        self._core.check_index()
        self._core.check_liveness()

    def epoch(self) -> int:
        """Changes on every (re)start: nodes re-register when they see a new one."""
        return self._core.epoch

    def config(self) -> KVStoreConfig:
        """The settings this coordinator was started with (a second `start` compares them)."""
        return self._core.config

    def reload_credentials(self, auth_token: str | None, previous_auth_token: str | None,
                           client_auth_token: str | None) -> bool:
        """``kvstore rotate-credentials``: the config clients fetch carries the new token, and
        the index service accepts both tokens (when it can swap them live; returns whether)."""
        import dataclasses

        cfg = self._core.config
        self._core.config = dataclasses.replace(
            cfg, server=dataclasses.replace(cfg.server, auth_token=auth_token,
                                            previous_auth_token=previous_auth_token),
            client=dataclasses.replace(cfg.client, auth_token=client_auth_token))
        if self._index_server is None:
            return True
        setter = getattr(self._index_server, "set_auth_tokens", None)
        if setter is None:
            return False
        setter(auth_token, previous_auth_token)
        return True

    def register_node(self, node_id: str, address: NodeAddress, capacity_bytes: int,
                      entries: list[IndexEntry], disk_keys: list[bytes] | None = None) -> int:
        """A node announces itself and everything it holds; returns the epoch."""
        return self._core.register_node(node_id, address, capacity_bytes, entries,
                                        disk_keys or ())

    def report_tiers(self, node_id: str, to_disk: list[bytes], to_arena: list[bytes]) -> None:
        """The node moved blocks between its arena and its disk tier."""
        self._core.report_tiers(node_id, to_disk, to_arena)

    def publish(self, node_id: str, entries: list[IndexEntry]) -> None:
        """Make blocks visible before the node's put returns."""
        self._core.publish(node_id, entries)

    def heartbeat(self, node_id: str, stats: PoolStats, touched: list[bytes],
                  remote_reads: dict[str, list[bytes]]) -> HeartbeatReply:
        """Stats and batched touches in, eviction and replication orders out."""
        return self._core.heartbeat(node_id, stats, touched, remote_reads)

    def request_eviction(self, node_id: str, nbytes_needed: int,
                         used_bytes: int | None = None) -> list[bytes]:
        """What a full node should evict now (``used_bytes``: its use at the time)."""
        return self._core.request_eviction(node_id, nbytes_needed, used_bytes)

    def removed(self, node_id: str, keys: list[bytes]) -> None:
        """The node evicted or deleted these."""
        self._core.removed(node_id, keys)

    def lookup_prefix(self, keys: Sequence[bytes]) -> PrefixHit:
        """The longest cached prefix and its holders."""
        return self._core.lookup_prefix(keys)

    def holders(self, keys: Sequence[bytes]) -> list[list[str]]:
        """The holders of each key."""
        return self._core.holders(keys)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Record uses from a reader outside the store nodes' heartbeats."""
        self._core.touch(keys)

    def keys_of_node(self, node_id: str) -> list[bytes]:
        """The keys the index says ``node_id`` holds."""
        return self._core.index.keys_of_node(node_id)

    def keys_of_namespace(self, namespace_root: bytes) -> list[bytes]:
        """The keys of one namespace."""
        return self._core.index.keys_of_namespace(namespace_root)

    def directory(self) -> dict[str, NodeAddress]:
        """Live nodes' addresses."""
        return self._core.directory()

    def nodes(self) -> list[NodeStatus]:
        """Every node, live and dead."""
        return self._core.nodes_status()

    def pin(self, keys: Sequence[bytes], *, hard: bool = False, ttl_s: float | None = None,
            ahead: bool = True) -> tuple[int, int]:
        """Pin keys (hard: never evicted; soft: last, with a TTL); ``(pinned, cached)``."""
        return self._core.pin(keys, hard=hard, ttl_s=ttl_s, ahead=ahead)

    def unpin(self, keys: Sequence[bytes]) -> tuple[int, int]:
        """Remove pins; ``(unpinned, cached)``."""
        return self._core.unpin(keys), self._core.num_cached(keys)

    def ls(self, limit: int = 20) -> dict[str, Any]:
        """Namespaces and the most recent cached prefixes (``kvstore ls``)."""
        return self._core.listing(limit)

    def drain(self, node_id: str) -> int:
        """Move a node's blocks elsewhere (or evict them) so it can be removed."""
        return self._core.drain(node_id)

    def remove_node(self, node_id: str) -> int:
        """Forget a node on purpose."""
        return self._core.remove_node(node_id)

    def invalidate(self, namespace_root: bytes) -> int:
        """Evict a namespace everywhere."""
        return self._core.invalidate(namespace_root)

    def invalidate_keys(self, keys: Sequence[bytes]) -> int:
        """Evict exactly these blocks everywhere."""
        return self._core.invalidate_keys(keys)

    def status(self) -> dict[str, Any]:
        """The json-able operator view, with the workers' reports."""
        return {**self._core.status(), "metrics_address": self.metrics_address,
                "workers": self._workers.as_list()}

    def report_worker(self, worker_id: str, info: dict[str, Any]) -> None:
        """A prefill or decode worker says what it runs (model, device, reuse policy) and,
        under ``namespace``, the namespace it publishes in (for ``kvstore ls``)."""
        self._workers.report(worker_id, info)
        if isinstance(info.get("namespace"), dict):
            self._core.namespaces.describe(info["namespace"])

    def forget_worker(self, worker_id: str) -> bool:
        """A worker closed."""
        return self._workers.forget(worker_id)

    def metrics_text(self) -> str:
        """This process's Prometheus exposition (the coordinator's series live here)."""
        from prometheus_client import generate_latest

        from kvstore.metrics import REGISTRY

        return generate_latest(REGISTRY).decode()

    def ping(self) -> int:
        """A no-op round trip (the benchmark's actor-call overhead)."""
        return self._core.epoch
