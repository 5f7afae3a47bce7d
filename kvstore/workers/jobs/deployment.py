"""A deployment of prefill and decode replicas over one store, in-process or on Ray.

Jobs, the demo and the end-to-end benchmark all drive requests through ``Deployment``: a
router picks a prefill replica, the prefill publishes and returns the first token and its
private tail, another router picks a decode replica, which fetches and generates. ``run`` keeps
up to ``max_in_flight`` requests on every replica at once
(``kvstore.workers.replicas.request_pipeline``). ``inprocess`` mode shares one LocalStore between
replicas in this process (tests, and runs without Ray); ``ray`` mode runs replicas as actors on the
kvstore cluster, starting an embedded one when none is running (``own_ray``: on a private local Ray
instance, as the demo does). The slow parts of a start and a close (Ray, the store, the replicas
loading their model) are phases of the caller's ``Steps``, so a command shows what it waits for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Literal, get_args

from kvstore.api import TokenIds
from kvstore.client.local_store import LocalStore
from kvstore.command_output import Steps
from kvstore.config import KVStoreConfig
from kvstore.errors import ClusterUnavailable, ConfigError, NodeUnavailable
from kvstore.keys import BlockHasher
from kvstore.workers.model.sampling import SamplingParams
from kvstore.workers.replicas.placement import not_started_message, replica_gpus
from kvstore.workers.replicas.replica import cluster_store_factory, replica_actor
from kvstore.workers.replicas.request_pipeline import (
    InlineCalls,
    JobKind,
    RayCalls,
    RequestOutput,
    RequestPipeline,
)
from kvstore.workers.replicas.roles import DecodeWorker, PrefillWorker
from kvstore.workers.replicas.router import ReplicaSlot, Router

#: Requests in flight on one replica at most: one computing, one fetching or queued behind it.
MAX_IN_FLIGHT = 2

#: How long replicas may take to be placed and load their model: Ray waits for busy GPUs (or
#: resources) forever, so a deployment gives up with what they asked for and what is free.
REPLICA_START_TIMEOUT_S = 600.0

#: ``inprocess``: replicas in this process over one LocalStore; ``ray``: replicas as actors.
DeploymentMode = Literal["ray", "inprocess"]
MODES: tuple[DeploymentMode, ...] = get_args(DeploymentMode)


class Deployment:
    """``num_prefill`` prefill and ``num_decode`` decode replicas, a router for each kind."""

    def __init__(self, config: KVStoreConfig, *, num_prefill: int = 1, num_decode: int = 1,
                 mode: DeploymentMode = "inprocess", address: str | None = None,
                 own_ray: bool = False, prefill_resources: dict[str, float] | None = None,
                 decode_resources: dict[str, float] | None = None,
                 max_in_flight: int = MAX_IN_FLIGHT,
                 start_timeout_s: float = REPLICA_START_TIMEOUT_S,
                 steps: Steps | None = None) -> None:
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
        if num_prefill < 1 or num_decode < 1:
            raise ConfigError("--prefill-replicas and --decode-replicas must be >= 1")
        if max_in_flight < 1:
            raise ConfigError(f"max_in_flight must be >= 1, got {max_in_flight}")
        if mode == "inprocess" and (prefill_resources or decode_resources):
            raise ConfigError("--prefill-resource/--decode-resource place Ray actors: drop "
                              "--in-process")
        self.config = config
        self.mode = mode
        self.steps = steps or Steps.silent()
        self.started_cluster = False
        self.started_ray = False
        #: GPUs each Ray replica asked for (``kvstore.workers.replicas.placement``); 0 in-process.
        self.gpus_per_replica = 0.0
        self.prefills: list[Any] = []
        self.decodes: list[Any] = []
        try:
            self._bring_up(address, own_ray, num_prefill, num_decode, max_in_flight,
                           start_timeout_s, prefill_resources, decode_resources)
        except BaseException:  # Ctrl-C, SIGTERM's SystemExit, a replica that fails to start
            self.close()  # what started stops in order (the store node unlinks its arena)
            raise

    def _bring_up(self, address: str | None, own_ray: bool, num_prefill: int,
                  num_decode: int, max_in_flight: int, start_timeout_s: float,
                  prefill_resources: dict[str, float] | None,
                  decode_resources: dict[str, float] | None) -> None:
        config = self.config
        replicas = (f"{num_prefill} prefill and {num_decode} decode replicas of model "
                    f"{config.worker.model}")
        if self.mode == "inprocess":
            self.store: Any = LocalStore()
            with self.steps.phase(f"loading {replicas} in this process"):
                self.prefills = [PrefillWorker(config, lambda: self.store, f"prefill-{i}")
                                 for i in range(num_prefill)]
                self.decodes = [DecodeWorker(config, lambda: self.store, f"decode-{i}")
                                for i in range(num_decode)]
            prefill_nodes = [p.node_id() for p in self.prefills]
            decode_nodes = [d.node_id() for d in self.decodes]
            calls: InlineCalls | RayCalls = InlineCalls()
        else:
            prefill_nodes, decode_nodes = self._start_on_ray(
                address, own_ray, num_prefill, num_decode, replicas, start_timeout_s,
                prefill_resources, decode_resources)
            calls = RayCalls()
        self.namespace = self._call(self.prefills[0], "namespace")
        #: The prefill replicas' reuse policy
        #: (``kvstore.workers.engine.reuse_policy.ReusePolicy.as_dict``).
        self.reuse: dict[str, Any] = self._call(self.prefills[0], "reuse_policy")
        self.vocab_size: int = self._call(self.prefills[0], "vocab_size")
        hasher = BlockHasher(self.namespace)
        self.router = Router(self.store, hasher, [ReplicaSlot(f"prefill-{i}", node)
                                                  for i, node in enumerate(prefill_nodes)])
        self.decode_router = Router(self.store, hasher, [ReplicaSlot(f"decode-{i}", node)
                                                         for i, node in enumerate(decode_nodes)])
        self.pipeline = RequestPipeline(calls, self.prefills, self.decodes, self.router,
                                   self.decode_router, max_in_flight, self.reuse["resume"])

    def _start_on_ray(self, address: str | None, own_ray: bool, num_prefill: int,
                      num_decode: int, replicas: str, start_timeout_s: float,
                      prefill_resources: dict[str, float] | None,
                      decode_resources: dict[str, float] | None
                      ) -> tuple[list[str], list[str]]:
        """Ray, the store when none runs (the embedded default), then the replicas; each
        recorded on ``self`` as it starts, so ``close`` stops what did. Their nodes."""
        from kvstore.cluster import lifecycle
        from kvstore.cluster.names import coordinator_handle

        config = self.config
        self.started_ray = connect_ray(address, own_ray, self.steps)
        # Decided before anything starts: too few GPUs in the cluster fail here, at once.
        self.gpus_per_replica = replica_gpus(config.worker, num_prefill + num_decode)
        try:
            coordinator_handle()
        except NodeUnavailable:  # nothing running: the embedded default
            with self.steps.phase("starting the store (a coordinator and a store node)"):
                lifecycle.start(config)
            self.started_cluster = True
        # What the running cluster hands its clients and this config lacks: the token, the
        # CA and the data key (a secure cluster's keyed namespaces), for every replica too.
        config = lifecycle.cluster_config(config)
        self.store = lifecycle.connect(config)
        factory = cluster_store_factory(config)
        check_resources(prefill_resources, "--prefill-resource")
        check_resources(decode_resources, "--decode-resource")
        # Placement by custom resource (the prefill/decode node types of the deploy files)
        # and by GPU.
        pre = replica_actor(PrefillWorker, prefill_resources, self.gpus_per_replica)
        dec = replica_actor(DecodeWorker, decode_resources, self.gpus_per_replica)
        with self.steps.phase(f"starting {replicas}"):
            self.prefills = [pre.remote(config, factory, f"prefill-{i}")
                             for i in range(num_prefill)]
            self.decodes = [dec.remote(config, factory, f"decode-{i}")
                            for i in range(num_decode)]
            nodes = self._wait_started(start_timeout_s, {"prefill": prefill_resources,
                                                         "decode": decode_resources})
        return nodes[:num_prefill], nodes[num_prefill:]

    def _wait_started(self, timeout_s: float,
                      resources: dict[str, dict[str, float] | None]) -> list[str]:
        """Every Ray replica's node once all are up; past ``timeout_s`` they are killed and the
        error says what they asked for and what the cluster has free."""
        import ray

        actors = self.prefills + self.decodes
        try:
            return list(ray.get([a.node_id.remote() for a in actors], timeout=timeout_s))
        except ray.exceptions.GetTimeoutError:
            for actor in actors:  # a replica Ray has not placed yet would take GPUs later
                ray.kill(actor)
            raise ClusterUnavailable(not_started_message(
                len(actors), self.gpus_per_replica, timeout_s, resources)) from None

    def _call(self, replica: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.mode == "inprocess":
            return getattr(replica, method)(*args, **kwargs)
        import ray

        return ray.get(getattr(replica, method).remote(*args, **kwargs))

    def run(self, kind: JobKind, requests: Sequence[tuple[str, TokenIds]],
            sampling: SamplingParams, on_done: Callable[[], None] | None = None
            ) -> list[RequestOutput]:
        """A job's requests, several in flight on every replica; outputs in input order.

        ``kind``: ``prefill`` (publish, first token), ``decode`` (fetch what was published,
        generate), ``generate`` (both, disaggregated) or ``reference`` (``--no-cache``: each
        prompt computed once on a decode replica with the store bypassed). With
        ``sampling.max_new_tokens == 0`` a request is a cache warm-up: prefill and publish, no
        tokens out.
        """
        ids = [(rid, [int(t) for t in (toks.tolist() if hasattr(toks, "tolist") else toks)])
               for rid, toks in requests]
        return self.pipeline.run(kind, ids, sampling, on_done)

    def generate(self, request_id: str, token_ids: TokenIds, sampling: SamplingParams, *,
                 use_cache: bool = True) -> RequestOutput:
        """One request, disaggregated; ``use_cache=False`` is the ``--no-cache`` reference."""
        kind: JobKind = "generate" if use_cache else "reference"
        return self.run(kind, [(request_id, token_ids)], sampling)[0]

    def close(self) -> None:
        """Stop the replicas (and the embedded cluster if this deployment started it); also
        what a start that failed part-way had started."""
        store = getattr(self, "store", None)  # a start that failed early has none
        actors = self.prefills + self.decodes
        if self.mode == "inprocess" or not (actors or self.started_cluster or self.started_ray):
            if store is not None:
                store.close()
            return
        import ray

        from kvstore.cluster import lifecycle

        with self.steps.phase("stopping the replicas"
                              + (" and the store" if self.started_cluster else "")):
            with contextlib.suppress(Exception):  # a dead replica is killed below all the same
                ray.get([actor.close.remote() for actor in actors], timeout=30)
            for actor in actors:
                ray.kill(actor)
            # The routers' store: its connections and its metrics pusher end with the
            # deployment, and this process's last tallies go to its node while it is up (a
            # cluster already gone loses them, never the stop below).
            with contextlib.suppress(Exception):
                if store is not None:
                    store.close()
            if self.started_cluster:
                lifecycle.stop(self.config)
            if self.started_ray:
                ray.shutdown()


def parse_resource(spec: str) -> dict[str, float]:
    """``NAME`` or ``NAME=AMOUNT`` as Ray's actor ``resources``; a bare name asks for 0.01.

    A small default amount makes the resource a placement tag: a node started with
    ``--resources '{"prefill": 1}'`` takes up to 100 replicas, not one.
    """
    name, sep, amount = spec.partition("=")
    name = name.strip()
    if not name or name in ("CPU", "GPU", "memory", "object_store_memory"):
        raise ConfigError(f"resource {spec!r}: give a custom Ray resource name, e.g. prefill")
    try:
        value = float(amount) if sep else 0.01
    except ValueError:
        raise ConfigError(f"resource {spec!r}: AMOUNT must be a number (NAME=0.5)") from None
    if not 0 < value <= 1e6:
        raise ConfigError(f"resource {spec!r}: AMOUNT must be > 0")
    return {name: value}


def check_resources(resources: dict[str, float] | None, flag: str) -> None:
    """Fail now, naming the flag, when no alive Ray node offers a resource (actors would hang)."""
    if not resources:
        return
    import ray

    offered = ray.cluster_resources()
    for name, amount in resources.items():
        if offered.get(name, 0.0) < amount:
            raise ConfigError(f"{flag} {name}: no alive Ray node offers {amount} of resource "
                              f"{name!r}; start one with ray start --resources "
                              f"'{{\"{name}\": 1}}'")



def connect_ray(address: str | None, own_ray: bool, steps: Steps) -> bool:
    """Attach to the cluster ``address`` names (``kvstore.cluster.address``), else start a
    private local Ray: always with ``own_ray`` (the demo), never someone else's cluster by
    accident. Every private one is ``ensure_ray``'s (loopback only, its processes out of the
    caller's process group). Whether this call started a private Ray of its own."""
    import ray

    from kvstore.cluster import lifecycle
    from kvstore.cluster.address import LOCAL, Resolved, resolve

    if ray.is_initialized():
        return False
    resolved = (Resolved(LOCAL, "none") if own_ray and address is None else resolve(address))
    private = resolved.address in (None, LOCAL)
    with steps.phase("starting a private Ray instance" if private
                     else f"connecting to Ray at {resolved.address}"):
        lifecycle.ensure_ray(resolved)
    return private and own_ray
