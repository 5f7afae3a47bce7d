"""Bringing kvstore up and down on Ray: the coordinator, one store node per Ray node, connect.

``start`` places the coordinator and a store node on every Ray node, plus the watcher that gives
Ray nodes joining later a store node too; all of them are named, detached actors
(``kvstore.cluster.names``). Readers discover store nodes through the coordinator's
``directory()``, never through hand-kept port lists. ``stop`` tears everything down and sweeps
the arena files of this cluster's nodes.

A ``start`` is all or nothing: the Redis index is checked before any actor exists, a store
already running with other settings is refused (same settings: nothing changes), and a start
that fails part-way stops whatever it started, so no watcher is left re-creating a
crash-looping store node. Which Ray cluster is used is ``kvstore.cluster.address``'s decision;
what security it runs with (token, TLS, data key) is ``kvstore.cluster.credentials``'s.
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

from kvstore.cluster.address import (
    LOCAL,
    Resolved,
    answers,
    auth_mode_for_private_ray,
    resolve,
)
from kvstore.cluster.credentials import (
    NodeInfo,
    SecurityPlan,
    alive_nodes,
    client_config,
    plan_security,
    ray_is_private,
    secured_config,
    with_certificate,
    with_redis_password,
)
from kvstore.cluster.head import keep_loopback_address
from kvstore.cluster.host_signals import own_process_groups, sigterm_kept
from kvstore.cluster.names import (
    COORDINATOR_NAME,
    RAY_NAMESPACE,
    WATCHER_NAME,
    arena_glob,
    coordinator_handle,
    store_actor_name,
)
from kvstore.cluster.rotation import apply_overlay, clear_overlay
from kvstore.config import KVStoreConfig
from kvstore.errors import ClusterConflict, ClusterUnavailable
from kvstore.node.grpc_setup import LOCAL_HOSTS
from kvstore.records import NodeAddress

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
    security: str = "loopback"  # secure | insecure | loopback (kvstore.cluster.credentials)
    secrets_dir: str | None = None  # where the cluster's secrets are kept (secure only)
    secrets_created: bool = False  # this start made them


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
        # The embedded default's Ray lives and dies with this process and serves nobody else:
        # its GCS, raylet and object manager listen on loopback, never on the network.
        keep_loopback_address()
        # "local", never None: Ray would read its own address file and attach to whatever
        # `ray start` left there, alive or stale.
        target, kwargs["include_dashboard"] = "local", False
    else:
        target = str(resolved.address)
        if resolved.recorded is not None and resolved.recorded.auth_mode:
            os.environ.setdefault("RAY_AUTH_MODE", resolved.recorded.auth_mode)
        if resolved.recorded is not None and resolved.recorded.loopback:
            keep_loopback_address()  # a head `kvstore start` made: it listens on loopback only
        if not target.startswith("ray://") and not answers(target):
            # Not "run `kvstore start`": with this address still given, it fails the same way.
            drop = ("leave --address out" if resolved.source == "--address"
                    else "unset RAY_ADDRESS")
            raise ClusterUnavailable(f"no Ray cluster answers at {target} (from "
                                     f"{resolved.source}): check it, or {drop}")
    # A process with its own way to stop keeps it (vLLM's, serve's), and a private Ray's
    # processes are out of the reach of a signal to the caller's process group.
    with sigterm_kept(), own_process_groups():
        ray.init(address=target, **kwargs)


def _alive_node_ids() -> list[str]:
    return [n["NodeID"] for n in ray.nodes() if n.get("Alive")]


def _pinned(node_id: str, *, soft: bool = False) -> NodeAffinitySchedulingStrategy:
    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=soft)


def start_coordinator(config: KVStoreConfig, head_node_id: str | None = None) -> Any:
    """Start (or find) the named, detached coordinator actor.

    Ray restarts it when it dies (``max_restarts=-1``) and replays callers' calls across the
    restart (``max_task_retries=-1``); the restart bumps the epoch, and store nodes then
    re-announce what they hold. With TLS it is kept on the head node where it can (its
    certificate names the nodes alive at start; elsewhere readers use the actor instead).
    """
    from kvstore.coordinator.actor import Coordinator

    placement: dict[str, Any] = {}
    if head_node_id is not None:
        placement["scheduling_strategy"] = _pinned(head_node_id, soft=True)
    return ray.remote(Coordinator).options(
        name=COORDINATOR_NAME, namespace=RAY_NAMESPACE, lifetime="detached",
        get_if_exists=True, max_restarts=-1, max_task_retries=-1, num_cpus=0,
        max_concurrency=64, **placement,
    ).remote(config)


def start_store_node(config: KVStoreConfig, node_id: str) -> Any:
    """Start (or find) the store-node actor on Ray node ``node_id``."""
    from kvstore.cluster.store_node_actor import StoreNodeActor

    return StoreNodeActor.options(
        name=store_actor_name(node_id),
        namespace=RAY_NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        num_cpus=0,
        max_concurrency=16,
        scheduling_strategy=_pinned(node_id),
    ).remote(config)


def node_config(config: KVStoreConfig, plan: SecurityPlan | None, node: NodeInfo
                ) -> KVStoreConfig:
    """A store node's own config: ``config`` with a certificate for ``node`` when the plan
    issues certificates (each node gets its own, as PEM text: nothing to copy onto hosts)."""
    return config if plan is None else with_certificate(config, plan, [node])


@ray.remote(num_cpus=0)
class Watcher:
    """Gives every Ray node a store node, including nodes that join (or whose store died) later.

    It holds the cluster's CA (when kvstore issues the certificates) to give a joining node its
    own certificate; ``kvstore rotate-credentials`` hands it the new token (``update``).
    """

    def __init__(self, config: KVStoreConfig, plan: SecurityPlan | None = None) -> None:
        self.config = config
        self.plan = plan
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
        config = None
        for node in alive_nodes():
            try:
                ray.get_actor(store_actor_name(node.node_id), namespace=RAY_NAMESPACE)
            except ValueError:
                config = config or apply_overlay(self.config)
                start_store_node(node_config(config, self.plan, node), node.node_id)
                started.append(node.node_id)
        return started

    def set_tokens(self, token: str, previous: str | None) -> None:
        """New tokens (``kvstore rotate-credentials``): nodes started from now on get them.
        A watcher Ray restarts with its first arguments reads them from the overlay."""
        self.config = apply_overlay(self.config)
        if self.plan is not None:
            self.plan = dataclasses.replace(self.plan, token=token, previous_token=previous)

    def stop(self) -> None:
        self._stop.set()


#: The sections a running store was built from; client and worker settings are per caller.
STORE_SECTIONS = ("pool", "server", "index", "coordinator")
#: Settings a start fills in itself (secure by default): a re-start that leaves them unset
#: asks for "whatever runs", never for "none"; node certificates differ per node anyway.
_GENERATED = {"server.auth_token", "server.previous_auth_token", "server.tls_cert_pem",
              "server.tls_key_pem", "server.advertise_host"}


def config_differences(running: KVStoreConfig, requested: KVStoreConfig) -> list[str]:
    """``section.field: running X, asked Y`` per differing store setting (secrets masked)."""
    out = []
    for section in STORE_SECTIONS:
        have, want = getattr(running, section), getattr(requested, section)
        for f in dataclasses.fields(have):
            a, b = getattr(have, f.name), getattr(want, f.name)
            if f"{section}.{f.name}" in _GENERATED and (b is None or f.name.endswith("_pem")):
                continue
            if a != b:
                out.append(f"{section}.{f.name}: running {_shown(f.name, a)}, "
                           f"asked {_shown(f.name, b)}")
    return out


def _shown(name: str, value: Any) -> str:
    if value is None:
        return "none"
    if "token" in name or "password" in name or name.endswith("_pem"):
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
    return apply_overlay(cast(KVStoreConfig, config))


def start(config: KVStoreConfig | None = None, *, address: str | Resolved | None = None,
          start_local: bool = True) -> ClusterInfo:
    """Start the coordinator, a store node per Ray node and the watcher; all or nothing.

    Against a running store with the same settings this changes nothing and reports it; with
    other settings it raises ``ClusterConflict`` naming each difference. Security is decided
    by ``kvstore.cluster.credentials.plan_security``: on a cluster (store nodes off loopback)
    it is on, with secrets loaded from or made in the secrets directory, unless
    ``security.insecure`` says otherwise.
    """
    config = with_redis_password(config or KVStoreConfig())
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
        info = _already_running(running)
        info.already_running = True
        return info
    nodes = alive_nodes()
    private = ray_is_private()
    plan = plan_security(config, nodes, private=private)
    base = secured_config(config, plan)
    if private and plan.mode == "loopback":
        base = loopback_only(base)
    try:
        info = _bring_up(base, plan, nodes)
    except BaseException:
        stop(config)  # nothing ran before: undo all of it, the watcher first
        raise
    info.security, info.secrets_dir, info.secrets_created = (
        plan.mode, plan.secrets_dir, plan.created)
    return info


def loopback_only(config: KVStoreConfig) -> KVStoreConfig:
    """The embedded default stays on this machine: a private Ray still names the host's
    network address as its node IP, but plain store nodes and the index service must not be
    reachable from the network, so they bind and advertise 127.0.0.1 (``bind_node_ip`` keeps an
    explicit loopback advertise address). An operator's own non-loopback host is kept."""
    server = config.server
    if server.host not in LOCAL_HOSTS or server.advertise_host is not None:
        return config
    return dataclasses.replace(config, server=dataclasses.replace(
        server, host="127.0.0.1", advertise_host="127.0.0.1"))


def _head_node(nodes: list[NodeInfo]) -> NodeInfo | None:
    return next((n for n in nodes if n.is_head), None)


def _bring_up(config: KVStoreConfig, plan: SecurityPlan, nodes: list[NodeInfo]
              ) -> ClusterInfo:
    head = _head_node(nodes) if plan.ca is not None else None
    # The coordinator's index service may land on any node alive now: its certificate names
    # them all (it prefers the head).
    coordinator = start_coordinator(with_certificate(config, plan, nodes),
                                    head.node_id if head is not None else None)
    # The coordinator first: its own error (say, Redis refused it) is the one worth reporting,
    # not the store nodes' failure to register with it.
    ray.get(coordinator.epoch.remote(), timeout=START_TIMEOUT_S)
    handles = {n.node_id: start_store_node(node_config(config, plan, n), n.node_id)
               for n in nodes}
    Watcher.options(  # type: ignore[attr-defined]
        name=WATCHER_NAME, namespace=RAY_NAMESPACE, lifetime="detached", get_if_exists=True,
        max_restarts=-1,
    ).remote(config, plan)
    return _wait_up(coordinator, handles, config)


def _wait_up(coordinator: Any, handles: dict[str, Any], config: KVStoreConfig) -> ClusterInfo:
    # Each store node registers in its constructor; a ping returns once it has.
    ray.get([h.ping.remote() for h in handles.values()], timeout=START_TIMEOUT_S)
    directory = _wait_directory(coordinator, set(handles), START_TIMEOUT_S)
    return ClusterInfo(
        ray_address=ray.get_runtime_context().gcs_address,
        epoch=int(ray.get(coordinator.epoch.remote(), timeout=START_TIMEOUT_S)),
        index_backend=config.index.backend,
        capacity_bytes=config.pool.capacity_bytes,
        nodes=directory,
    )


def _already_running(running: KVStoreConfig) -> ClusterInfo:
    """What runs: its store nodes (the watcher gives nodes without one theirs, with the
    certificate only it can issue) and its security as the running config says."""
    coordinator = coordinator_handle()
    handles = {}
    for node_id in _alive_node_ids():
        try:
            handles[node_id] = ray.get_actor(store_actor_name(node_id), namespace=RAY_NAMESPACE)
        except ValueError:
            continue
    info = _wait_up(coordinator, handles, running)
    info.security = ("insecure" if running.security.insecure else
                     "secure" if running.server.auth_token else "loopback")
    info.secrets_dir = running.security.secrets_dir
    return info


def _wait_directory(coordinator: Any, node_ids: set[str], timeout_s: float
                    ) -> dict[str, NodeAddress]:
    deadline = time.monotonic() + timeout_s
    while True:
        directory: dict[str, NodeAddress] = ray.get(coordinator.directory.remote())
        if node_ids <= set(directory) or time.monotonic() > deadline:
            return directory
        time.sleep(0.1)


def cluster_config(config: KVStoreConfig | None = None, *, address: str | None = None
                   ) -> KVStoreConfig:
    """``config`` completed with what a client of the running cluster needs and did not set
    itself: the cluster token, the CA and the data key (``credentials.client_config``); these
    come from the coordinator, over Ray, never from argv or files on the client's host."""
    config = config or KVStoreConfig()
    ensure_ray(address, start_local=False)
    try:
        running = running_config()
    except ray.exceptions.RayActorError:
        running = None
    return client_config(config, running)


def connect(config: KVStoreConfig | None = None, *, address: str | None = None) -> Any:
    """A ClusterStore for this process, discovered through the coordinator."""
    from kvstore.client.cluster_store import ClusterStore
    from kvstore.client.unreachable import process_wide
    from kvstore.coordinator.index_proxy import CoordinatorIndex
    from kvstore.index.factory import make_index

    config = cluster_config(config, address=address)
    coordinator = coordinator_handle()
    # Same node means same Ray node (not same /dev/shm): that is what lets a reader map a
    # holder's arena instead of fetching over gRPC.
    node_id = config.client.node_id or ray.get_runtime_context().get_node_id()
    index = make_index(config.index) if config.index.backend == "redis" else CoordinatorIndex(
        coordinator, config.client)
    return ClusterStore(
        node_id, index, lambda: ray.get(coordinator.directory.remote()), config.client,
        local_node_id=node_id, lease_ttl_s=config.coordinator.lease_ttl_s, owns_index=True,
        unreachable=process_wide(config.client.unreachable_cooldown_s,
                                 config.client.unreachable_max_cooldown_s),
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


def stop(config: KVStoreConfig | None = None, *, address: str | Resolved | None = None,
         purge: bool = False) -> int:
    """Tear everything down: the watcher first (so nothing respawns), stores, coordinator.
    Disk tiers stay for the next start unless ``purge`` (then each node removes its own)."""
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
            ray.get(handle.shutdown.remote(purge=purge), timeout=30)
        ray.kill(handle, no_restart=True)
        num_killed += 1
    num_killed += int(_kill(COORDINATOR_NAME))
    clear_overlay()
    # An actor killed mid-flight cannot unlink its arena: sweep every node's shm dir for the
    # arenas of this cluster's nodes (dead ones too), never another cluster's on the machine.
    patterns = [arena_glob(config.pool.shm_dir, n) for n in {n["NodeID"] for n in ray.nodes()}]
    refs = [_unlink_arenas.options(scheduling_strategy=_pinned(n)).remote(patterns)
            for n in node_ids]
    with contextlib.suppress(Exception):
        ray.get(refs, timeout=30)
    return num_killed
