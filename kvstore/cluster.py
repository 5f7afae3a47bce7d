"""Ray wiring: the coordinator, one store node per Ray node, discovery, start/connect/stop.

Everything is a named actor in the Ray namespace ``kvstore``, so any process on the cluster
finds it by name: the coordinator (``kvstore-coordinator``), the store nodes
(``kvstore-store-<ray node id>``) and the watcher (``kvstore-watcher``) that gives Ray nodes
joining later a store node too. Readers discover store nodes through the coordinator's
``directory()``, never through hand-kept port lists.
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
from kvstore.config import KVStoreConfig
from kvstore.errors import NodeUnavailable

RAY_NAMESPACE = "kvstore"
COORDINATOR_NAME = "kvstore-coordinator"
WATCHER_NAME = "kvstore-watcher"
STORE_PREFIX = "kvstore-store-"
ARENA_PREFIX = "kvstore-arena-"

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


def store_actor_name(node_id: str) -> str:
    """The name of the store-node actor on the Ray node ``node_id``."""
    return STORE_PREFIX + node_id


def arena_name(node_id: str) -> str:
    """The arena file name of a store node; the pid keeps a restarted node off its old file."""
    return f"{ARENA_PREFIX}{node_id[:16]}-{os.getpid()}"


def sweep_stale_arenas(shm_dir: str, node_id: str) -> int:
    """Unlink arena files an earlier, dead store node of this Ray node left behind.

    A store node killed by SIGKILL (OOM killer, node restart, ``ray.kill``) cannot unlink its
    arena, and the file is RAM on tmpfs: without this sweep a crash-looping node would eat the
    machine's memory one capacity at a time. Files whose pid is alive are left alone.
    """
    removed = 0
    for path in glob.glob(os.path.join(shm_dir, f"{ARENA_PREFIX}{node_id[:16]}-*")):
        try:
            pid = int(path.rsplit("-", 1)[1])
        except ValueError:
            continue
        if pid == os.getpid() or _pid_alive(pid):
            continue
        try:
            os.unlink(path)
            removed += 1
        except FileNotFoundError:
            pass
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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


def coordinator_handle() -> Any:
    """The running coordinator actor; raises NodeUnavailable when the cluster is not started."""
    # A busy GCS can fail a name lookup transiently: retry briefly before saying "not running".
    for attempt in range(3):
        try:
            return ray.get_actor(COORDINATOR_NAME, namespace=RAY_NAMESPACE)
        except ValueError:
            if attempt < 2:
                time.sleep(1.0)
    raise NodeUnavailable(
        "the kvstore coordinator is not running on this Ray cluster: run `kvstore start`"
    )


def _start_coordinator(config: KVStoreConfig) -> Any:
    from kvstore.coordinator import start_coordinator

    return start_coordinator(config)


def start_store_node(config: KVStoreConfig, node_id: str) -> Any:
    """Start (or find) the store-node actor on Ray node ``node_id``."""
    from kvstore.store_node import StoreNodeActor

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
    coordinator = _start_coordinator(config)
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
    from kvstore.coordinator_index import CoordinatorIndex
    from kvstore.index import make_index

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


def status() -> dict[str, Any]:
    """The coordinator's json-able view of the cluster."""
    return ray.get(coordinator_handle().status.remote())


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
    patterns = [os.path.join(config.pool.shm_dir, arena_name(n).rsplit("-", 1)[0] + "-*")
                for n in {n["NodeID"] for n in ray.nodes()}]
    refs = [_unlink_arenas.options(scheduling_strategy=_pinned(n)).remote(patterns)
            for n in node_ids]
    with contextlib.suppress(Exception):
        ray.get(refs, timeout=30)
    return num_killed
