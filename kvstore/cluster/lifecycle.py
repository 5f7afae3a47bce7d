"""Bringing kvstore up and down on Ray: the coordinator, one store node per Ray node, connect.

``start`` places the coordinator and a store node on every Ray node, plus the watcher that gives
Ray nodes joining later a store node too; all of them are named, detached actors
(``kvstore.cluster.names``). Readers discover store nodes through the coordinator's
``directory()``, never through hand-kept port lists. ``stop`` tears everything down and sweeps
the arena files of this cluster's nodes.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvstore.api import NodeAddress
from kvstore.cluster.names import (
    COORDINATOR_NAME,
    RAY_NAMESPACE,
    WATCHER_NAME,
    arena_glob,
    coordinator_handle,
    store_actor_name,
)
from kvstore.config import KVStoreConfig
from kvstore.errors import NodeUnavailable

#: How long start() waits for every store node to register before giving up.
START_TIMEOUT_S = 60.0
#: How often the watcher looks for Ray nodes without a store node.
WATCH_INTERVAL_S = 2.0


@dataclass(slots=True)
class ClusterInfo:
    """What start() brought up: the Ray address, the coordinator's epoch and the store nodes."""

    ray_address: str
    epoch: int
    index_backend: str
    nodes: dict[str, NodeAddress] = field(default_factory=dict)


def _running_cluster_address() -> str | None:
    """RAY_ADDRESS, else the cluster `ray start` last brought up on this machine, else None."""
    from ray._private import services  # Ray's own resolution of "auto"

    try:
        return services.canonicalize_bootstrap_address("auto")
    except Exception:  # no address file, unreadable, or malformed: treat as none running
        return None


def _answers(address: str, timeout_s: float = 3.0) -> bool:
    """Whether anything accepts TCP at ``host:port`` (Ray itself retries for minutes)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def ensure_ray(address: str | None = None, *, start_local: bool = True) -> None:
    """Connect this process to Ray: ``address``, else a running cluster, else a local one."""
    if ray.is_initialized():
        return
    kwargs: dict[str, Any] = {
        "namespace": RAY_NAMESPACE,
        "logging_level": logging.WARNING,
        "log_to_driver": False,
    }
    target = _running_cluster_address() if address in (None, "auto") else address
    if target is None:
        if not start_local:
            raise NodeUnavailable(
                "no running Ray cluster found: run `ray start --head` first, or pass "
                "--address / set RAY_ADDRESS"
            )
        ray.init(**kwargs)
        return
    if not target.startswith("ray://") and not _answers(target):
        raise NodeUnavailable(f"no Ray cluster answers at {target}: check --address / "
                              "RAY_ADDRESS, or run `ray start --head`")
    ray.init(address=target, **kwargs)


def _alive_node_ids() -> list[str]:
    return [n["NodeID"] for n in ray.nodes() if n.get("Alive")]


def _pinned(node_id: str, *, soft: bool = False) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=soft)


def start_coordinator(config: KVStoreConfig) -> Any:
    """Start (or find) the named, detached coordinator actor.

    Ray restarts it when it dies (``max_restarts=-1``) and replays callers' calls across the
    restart (``max_task_retries=-1``); the restart bumps the epoch, and store nodes then
    re-announce what they hold.
    """
    from kvstore.coordinator.actor import Coordinator

    return ray.remote(Coordinator).options(
        name=COORDINATOR_NAME, namespace=RAY_NAMESPACE, lifetime="detached",
        get_if_exists=True, max_restarts=-1, max_task_retries=-1, num_cpus=0,
        max_concurrency=64,
    ).remote(config)


def start_store_node(config: KVStoreConfig, node_id: str) -> Any:
    """Start (or find) the store-node actor on Ray node ``node_id``."""
    from kvstore.cluster.store_node import StoreNodeActor

    return StoreNodeActor.options(
        name=store_actor_name(node_id),
        namespace=RAY_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_concurrency=16,
        scheduling_strategy=_pinned(node_id),
    ).remote(config)


@ray.remote(num_cpus=0)
class Watcher:
    """Gives every Ray node a store node, including nodes that join (or whose store died) later."""

    def __init__(self, config: KVStoreConfig) -> None:
        self.config = config
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kvstore-watcher", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL_S):
            with contextlib.suppress(Exception):  # a failed round is retried on the next one
                self.reconcile()

    def reconcile(self) -> list[str]:
        """Start a store node on each alive Ray node lacking one; returns the nodes started."""
        started = []
        for node_id in _alive_node_ids():
            try:
                ray.get_actor(store_actor_name(node_id), namespace=RAY_NAMESPACE)
            except ValueError:
                start_store_node(self.config, node_id)
                started.append(node_id)
        return started

    def stop(self) -> None:
        self._stop.set()


def start(config: KVStoreConfig | None = None, *, address: str | None = None,
          start_local: bool = True) -> ClusterInfo:
    """Start the coordinator, a store node per Ray node and the watcher; idempotent."""
    config = config or KVStoreConfig()
    ensure_ray(address, start_local=start_local)
    coordinator = start_coordinator(config)
    handles = {node_id: start_store_node(config, node_id) for node_id in _alive_node_ids()}
    Watcher.options(  # type: ignore[attr-defined]
        name=WATCHER_NAME, namespace=RAY_NAMESPACE, lifetime="detached", get_if_exists=True,
        max_restarts=-1,
    ).remote(config)
    # Each store node registers in its constructor; a ping returns once it has.
    ray.get([h.ping.remote() for h in handles.values()], timeout=START_TIMEOUT_S)
    directory = _wait_directory(coordinator, set(handles), START_TIMEOUT_S)
    epoch = ray.get(coordinator.epoch.remote())
    return ClusterInfo(
        ray_address=ray.get_runtime_context().gcs_address,
        epoch=int(epoch),
        index_backend=config.index.backend,
        nodes=directory,
    )


def _wait_directory(coordinator: Any, node_ids: set[str], timeout_s: float
                    ) -> dict[str, NodeAddress]:
    deadline = time.monotonic() + timeout_s
    while True:
        directory: dict[str, NodeAddress] = ray.get(coordinator.directory.remote())
        if node_ids <= set(directory) or time.monotonic() > deadline:
            return directory
        time.sleep(0.1)


def connect(config: KVStoreConfig | None = None, *, address: str | None = None) -> Any:
    """A ClusterStore for this process, discovered through the coordinator."""
    from kvstore.cluster_store import ClusterStore
    from kvstore.coordinator.index_proxy import CoordinatorIndex
    from kvstore.index.factory import make_index

    config = config or KVStoreConfig()
    ensure_ray(address, start_local=False)
    coordinator = coordinator_handle()
    # Same node means same Ray node (not same /dev/shm): that is what lets a reader map a
    # holder's arena instead of fetching over gRPC.
    node_id = config.client.node_id or ray.get_runtime_context().get_node_id()
    index = make_index(config.index) if config.index.backend == "redis" else CoordinatorIndex(
        coordinator)
    return ClusterStore(
        node_id, index, lambda: ray.get(coordinator.directory.remote()), config.client,
        local_node_id=node_id, lease_ttl_s=config.coordinator.lease_ttl_s,
    )


def _kill(name: str) -> bool:
    try:
        handle = ray.get_actor(name, namespace=RAY_NAMESPACE)
    except ValueError:
        return False
    ray.kill(handle, no_restart=True)
    return True


@ray.remote(num_cpus=0)
def _unlink_arenas(patterns: list[str]) -> int:
    removed = 0
    for pattern in patterns:
        for path in glob.glob(pattern):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
                removed += 1
    return removed


def stop(config: KVStoreConfig | None = None, *, address: str | None = None) -> int:
    """Tear everything down: the watcher first (so nothing respawns), stores, coordinator."""
    config = config or KVStoreConfig()
    ensure_ray(address, start_local=False)
    num_killed = int(_kill(WATCHER_NAME))
    node_ids = _alive_node_ids()
    for node_id in node_ids:
        try:
            handle = ray.get_actor(store_actor_name(node_id), namespace=RAY_NAMESPACE)
        except ValueError:
            continue
        with contextlib.suppress(Exception):  # a dead or wedged node is killed below anyway
            ray.get(handle.shutdown.remote(), timeout=10)
        ray.kill(handle, no_restart=True)
        num_killed += 1
    num_killed += int(_kill(COORDINATOR_NAME))
    # An actor killed mid-flight cannot unlink its arena: sweep every node's shm dir for the
    # arenas of this cluster's nodes (dead ones too), never another cluster's on the machine.
    patterns = [arena_glob(config.pool.shm_dir, n) for n in {n["NodeID"] for n in ray.nodes()}]
    refs = [_unlink_arenas.options(scheduling_strategy=_pinned(n)).remote(patterns)
            for n in node_ids]
    with contextlib.suppress(Exception):
        ray.get(refs, timeout=30)
    return num_killed
