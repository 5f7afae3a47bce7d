"""Bringing kvstore up and down on Ray: the coordinator, one store node per Ray node, connect.

``start`` places the coordinator and a store node on every Ray node, plus the watcher that gives
Ray nodes joining later a store node too; all of them are named, detached actors
(``kvstore.cluster.names``). Readers discover store nodes through the coordinator's
``directory()``, never through hand-kept port lists. ``stop`` tears everything down and sweeps
the arena files of this cluster's nodes.

A ``start`` is all or nothing: the Redis index is checked before any actor exists, a store
already running with other settings is refused (same settings: nothing changes), and a start
that fails part-way stops whatever it started, so no watcher is left re-creating a
crash-looping store node. Which Ray cluster is used is ``kvstore.cluster.address``'s decision.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, cast

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from kvstore.api import NodeAddress
from kvstore.cluster.address import (
    LOCAL,
    Resolved,
    answers,
    auth_mode_for_private_ray,
    resolve,
)
from kvstore.cluster.names import (
    COORDINATOR_NAME,
    RAY_NAMESPACE,
    WATCHER_NAME,
    arena_glob,
    coordinator_handle,
    store_actor_name,
)
from kvstore.config import KVStoreConfig
from kvstore.errors import ClusterConflict, ClusterUnavailable

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
    capacity_bytes: int  # per node, as the running store has it (not as a re-start asked)
    nodes: dict[str, NodeAddress] = field(default_factory=dict)
    already_running: bool = False  # start found it running with these settings


def ensure_ray(address: str | Resolved | None = None, *, start_local: bool = True) -> None:
    """Connect this process to Ray: the cluster ``address.resolve`` names, else a private one.

    With nothing named and ``start_local`` false (operator commands), raise instead: acting on
    a Ray instance that lives only as long as this command would be a silent no-op. A caller
    that already resolved the address passes the ``Resolved`` (no second stale-record note).
    """
    if ray.is_initialized():
        return
    kwargs: dict[str, Any] = {
        "namespace": RAY_NAMESPACE,
        "logging_level": logging.WARNING,
        "log_to_driver": False,
    }
    resolved = address if isinstance(address, Resolved) else resolve(address)
    if resolved.address is None and not start_local:
        raise ClusterUnavailable(
            "no Ray cluster to act on: run `kvstore start` (it starts a local Ray head when "
            "none is named), or pass --address HOST:PORT / set RAY_ADDRESS")
    if resolved.address in (None, LOCAL):
        os.environ.setdefault("RAY_AUTH_MODE", auth_mode_for_private_ray())
        # "local", never None: Ray would read its own address file and attach to whatever
        # `ray start` left there, alive or stale.
        ray.init(address="local", include_dashboard=False, **kwargs)
        return
    target = str(resolved.address)
    if resolved.recorded is not None and resolved.recorded.auth_mode:
        os.environ.setdefault("RAY_AUTH_MODE", resolved.recorded.auth_mode)
    if not target.startswith("ray://") and not answers(target):
        raise ClusterUnavailable(f"no Ray cluster answers at {target} (from "
                                 f"{resolved.source}): check it, or run `kvstore start`")
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


#: The sections a running store was built from; client and worker settings are per caller.
STORE_SECTIONS = ("pool", "server", "index", "coordinator")


def config_differences(running: KVStoreConfig, requested: KVStoreConfig) -> list[str]:
    """``section.field: running X, asked Y`` per differing store setting (secrets masked)."""
    out = []
    for section in STORE_SECTIONS:
        have, want = getattr(running, section), getattr(requested, section)
        for f in dataclasses.fields(have):
            a, b = getattr(have, f.name), getattr(want, f.name)
            if a != b:
                out.append(f"{section}.{f.name}: running {_shown(f.name, a)}, "
                           f"asked {_shown(f.name, b)}")
    return out


def _shown(name: str, value: Any) -> str:
    if value is None:
        return "none"
    if "token" in name or "password" in name:
        return "***"
    if name == "redis_url":
        from kvstore.index.redis import redact_url

        return redact_url(str(value))
    return str(value)


def check_index(config: KVStoreConfig) -> None:
    """Reach the configured Redis now, from here: a bad URL or password fails before any actor."""
    if config.index.backend != "redis":
        return
    from kvstore.index.factory import make_index

    make_index(config.index).close()


def running_config() -> KVStoreConfig | None:
    """The settings of the coordinator running on this Ray cluster, or None when none runs."""
    try:
        handle = ray.get_actor(COORDINATOR_NAME, namespace=RAY_NAMESPACE)
    except ValueError:
        return None
    config: Any = ray.get(handle.config.remote(), timeout=START_TIMEOUT_S)
    return cast(KVStoreConfig, config)


def start(config: KVStoreConfig | None = None, *, address: str | Resolved | None = None,
          start_local: bool = True) -> ClusterInfo:
    """Start the coordinator, a store node per Ray node and the watcher; all or nothing.

    Against a running store with the same settings this changes nothing and reports it; with
    other settings it raises ``ClusterConflict`` naming each difference.
    """
    config = config or KVStoreConfig()
    check_index(config)
    ensure_ray(address, start_local=start_local)
    try:
        running = running_config()
    except ray.exceptions.RayActorError:  # a dead leftover of an earlier failure: clear it
        stop(config)
        running = None
    if running is not None:
        differences = config_differences(running, config)
        if differences:
            raise ClusterConflict(
                "kvstore already runs on this Ray cluster with other settings ("
                + "; ".join(differences) + "): run `kvstore stop` first to change them, or "
                "start with the settings it runs with")
        info = _bring_up(running)
        info.already_running = True
        return info
    try:
        return _bring_up(config)
    except BaseException:
        stop(config)  # nothing ran before: undo all of it, the watcher first
        raise


def _bring_up(config: KVStoreConfig) -> ClusterInfo:
    coordinator = start_coordinator(config)
    # The coordinator first: its own error (say, Redis refused it) is the one worth reporting,
    # not the store nodes' failure to register with it.
    epoch = ray.get(coordinator.epoch.remote(), timeout=START_TIMEOUT_S)
    handles = {node_id: start_store_node(config, node_id) for node_id in _alive_node_ids()}
    Watcher.options(  # type: ignore[attr-defined]
        name=WATCHER_NAME, namespace=RAY_NAMESPACE, lifetime="detached", get_if_exists=True,
        max_restarts=-1,
    ).remote(config)
    # Each store node registers in its constructor; a ping returns once it has.
    ray.get([h.ping.remote() for h in handles.values()], timeout=START_TIMEOUT_S)
    directory = _wait_directory(coordinator, set(handles), START_TIMEOUT_S)
    return ClusterInfo(
        ray_address=ray.get_runtime_context().gcs_address,
        epoch=int(epoch),
        index_backend=config.index.backend,
        capacity_bytes=config.pool.capacity_bytes,
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
        coordinator, config.client)
    return ClusterStore(
        node_id, index, lambda: ray.get(coordinator.directory.remote()), config.client,
        local_node_id=node_id, lease_ttl_s=config.coordinator.lease_ttl_s, owns_index=True,
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


def stop(config: KVStoreConfig | None = None, *, address: str | Resolved | None = None
         ) -> int:
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
