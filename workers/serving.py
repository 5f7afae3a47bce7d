"""A deployment of prefill and decode replicas over one store, in-process or on Ray.

Jobs, the demo and the end-to-end benchmark all drive requests through ``Deployment``: the
router picks a prefill replica, the prefill publishes and returns the first token and its
private tail, a decode replica fetches and generates. ``inprocess`` mode shares one LocalStore
between replicas in this process (tests, and runs without Ray); ``ray`` mode runs replicas as
actors on the kvstore cluster, starting an embedded one when none is running (``own_ray``:
on a private local Ray instance, as the demo does).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from kvstore.api import TokenIds
from kvstore.config import KVStoreConfig
from kvstore.errors import ConfigError, NodeUnavailable
from kvstore.keys import BlockHasher
from kvstore.local import LocalStore
from workers.decode import DecodeWorker
from workers.engine import DecodeResult, PrefillResult, SamplingParams
from workers.prefill import PrefillWorker
from workers.replica import cluster_store_factory, replica_actor
from workers.router import ReplicaSlot, Router

#: ``inprocess``: replicas in this process over one LocalStore; ``ray``: replicas as actors.
DeploymentMode = Literal["ray", "inprocess"]
MODES: tuple[DeploymentMode, ...] = get_args(DeploymentMode)


@dataclass(slots=True)
class RequestOutput:
    """One finished request, as jobs print it."""

    id: str
    output_token_ids: list[int]
    cached_tokens: int
    num_prompt_tokens: int
    ttft_s: float
    bytes_fetched: int
    sources: dict[str, int]
    decode_tokens_per_s: float
    prefill_replica: str = ""
    text: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    unreused_shared_tokens: int = 0
    resume: str = ""  # where the prefill may resume from cached blocks: "block" or "chunk"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id, "output_token_ids": self.output_token_ids,
            "cached_tokens": self.cached_tokens, "num_prompt_tokens": self.num_prompt_tokens,
            "ttft_s": round(self.ttft_s, 6), "bytes_fetched": self.bytes_fetched,
            "sources": self.sources, "prefill_replica": self.prefill_replica,
            "unreused_shared_tokens": self.unreused_shared_tokens,
        }
        if self.resume:
            out["resume"] = self.resume
        if self.text is not None:
            out["text"] = self.text
        return out


class Deployment:
    """``num_prefill`` prefill and ``num_decode`` decode replicas behind a router."""

    def __init__(self, config: KVStoreConfig, *, num_prefill: int = 1, num_decode: int = 1,
                 mode: DeploymentMode = "inprocess", address: str | None = None,
                 own_ray: bool = False, prefill_resources: dict[str, float] | None = None,
                 decode_resources: dict[str, float] | None = None) -> None:
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
        if num_prefill < 1 or num_decode < 1:
            raise ConfigError("--prefill-replicas and --decode-replicas must be >= 1")
        if mode == "inprocess" and (prefill_resources or decode_resources):
            raise ConfigError("--prefill-resource/--decode-resource place Ray actors: drop "
                              "--in-process")
        self.config = config
        self.mode = mode
        self.started_cluster = False
        self.started_ray = False
        self._ids = itertools.count()
        if mode == "inprocess":
            self.store: Any = LocalStore()
            self.prefills: list[Any] = [PrefillWorker(config, lambda: self.store, f"prefill-{i}")
                                        for i in range(num_prefill)]
            self.decodes: list[Any] = [DecodeWorker(config, lambda: self.store, f"decode-{i}")
                                       for i in range(num_decode)]
            node_ids = [p.node_id() for p in self.prefills]
        else:
            import ray

            from kvstore.cluster import lifecycle
            from kvstore.cluster.names import RAY_NAMESPACE, coordinator_handle

            if own_ray and address is None and not ray.is_initialized():
                # A private local Ray: never attach to someone else's cluster by accident.
                ray.init(address="local", namespace=RAY_NAMESPACE,
                         include_dashboard=False,
                         logging_level=logging.WARNING, log_to_driver=False)
                self.started_ray = True
            lifecycle.ensure_ray(address)
            try:
                coordinator_handle()
            except NodeUnavailable:  # nothing running: the embedded default
                lifecycle.start(config)
                self.started_cluster = True
            self.store = lifecycle.connect(config)
            factory = cluster_store_factory(config)
            check_resources(prefill_resources, "--prefill-resource")
            check_resources(decode_resources, "--decode-resource")
            # Placement by custom resource (the prefill/decode node types of the deploy files).
            pre = replica_actor(PrefillWorker, prefill_resources)
            dec = replica_actor(DecodeWorker, decode_resources)
            self.prefills = [pre.remote(config, factory, f"prefill-{i}")
                             for i in range(num_prefill)]
            self.decodes = [dec.remote(config, factory, f"decode-{i}")
                            for i in range(num_decode)]
            node_ids = ray.get([p.node_id.remote() for p in self.prefills])
        self.namespace = self._call(self.prefills[0], "namespace")
        #: The prefill replicas' reuse policy (``workers.reuse.ReusePolicy.as_dict``).
        self.reuse: dict[str, Any] = self._call(self.prefills[0], "reuse_policy")
        self.vocab_size: int = self._call(self.prefills[0], "vocab_size")
        self.router = Router(self.store, BlockHasher(self.namespace),
                             [ReplicaSlot(f"prefill-{i}", node)
                              for i, node in enumerate(node_ids)])

    def _call(self, replica: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.mode == "inprocess":
            return getattr(replica, method)(*args, **kwargs)
        import ray

        return ray.get(getattr(replica, method).remote(*args, **kwargs))

    def prefill(self, token_ids: TokenIds, sampling: SamplingParams, *, use_cache: bool = True,
                request_id: str | None = None) -> tuple[PrefillResult, int]:
        """Prefill on the router's choice; returns the result and the replica index."""
        rid = request_id or f"req-{next(self._ids)}"
        index = self.router.choose(token_ids)
        try:
            return self._call(self.prefills[index], "prefill", token_ids, rid, sampling,
                              use_cache), index
        finally:
            self.router.done(index)

    def decode(self, token_ids: TokenIds, first_token: int | None, sampling: SamplingParams, *,
               tail: Any = None, use_cache: bool = True, request_id: str | None = None,
               replica: int = 0) -> DecodeResult:
        rid = request_id or f"req-{next(self._ids)}"
        return self._call(self.decodes[replica % len(self.decodes)], "decode", token_ids,
                          first_token, rid, tail, sampling, use_cache)

    def generate(self, request_id: str, token_ids: TokenIds, sampling: SamplingParams, *,
                 use_cache: bool = True, decode_replica: int = 0) -> RequestOutput:
        """The disaggregated path; ``use_cache=False`` runs locally with the store bypassed."""
        if not use_cache:
            pre, index = self.prefill(token_ids, sampling, use_cache=False)
            dec = self._call(self.decodes[decode_replica % len(self.decodes)], "generate",
                             token_ids, f"{request_id}-nocache", sampling, False)
        else:
            pre, index = self.prefill(token_ids, sampling, request_id=f"{request_id}-p")
            dec = self.decode(token_ids, pre.first_token, sampling, tail=pre.tail,
                              request_id=f"{request_id}-d", replica=decode_replica)
        return RequestOutput(
            id=request_id, output_token_ids=dec.output_token_ids,
            cached_tokens=pre.cached_tokens, num_prompt_tokens=pre.num_prompt_tokens,
            ttft_s=pre.ttft_s, bytes_fetched=pre.bytes_fetched + dec.bytes_fetched,
            sources=_merge(pre.sources, dec.sources),
            decode_tokens_per_s=dec.decode_tokens_per_s, prefill_replica=f"prefill-{index}",
            unreused_shared_tokens=pre.unreused_shared_tokens, resume=self.reuse["resume"])

    def close(self) -> None:
        """Stop the replicas (and the embedded cluster if this deployment started it)."""
        if self.mode == "inprocess":
            self.store.close()
            return
        import ray

        from kvstore.cluster import lifecycle

        actors = self.prefills + self.decodes
        with contextlib.suppress(Exception):  # a dead replica is killed below all the same
            ray.get([actor.close.remote() for actor in actors], timeout=30)
        for actor in actors:
            ray.kill(actor)
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


def _merge(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    out = dict(a)
    for k, v in b.items():
        out[k] = out.get(k, 0) + v
    return out
