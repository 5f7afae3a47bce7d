"""What prefill and decode workers share: a model, a store and an engine, in-process or on Ray.

A worker is a plain class (``kvstore.workers.replicas.roles.PrefillWorker``,
``kvstore.workers.replicas.roles.DecodeWorker``) that runs in-process as it is, or as a Ray actor
through ``replica_actor``; the work itself is in ``kvstore.workers.engine.prefill_decode``
(docs/design.md §4).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import ray

from kvstore.api import KVStore
from kvstore.client.cluster_store import ClusterStore
from kvstore.config import KVStoreConfig
from kvstore.errors import KVStoreError
from kvstore.keys import Namespace
from kvstore.security.data_keys import parse_data_key
from kvstore.workers.engine.prefill_decode import Engine
from kvstore.workers.model.causal_lm import load_worker_model
from kvstore.workers.model.device import describe_numerics

log = logging.getLogger(__name__)

#: Builds the replica's store inside the replica's own process (stores do not pickle).
StoreFactory = Callable[[], "KVStore | None"]


def cluster_store_factory(config: KVStoreConfig) -> StoreFactory:
    """A factory that connects to the running kvstore cluster from inside an actor."""

    def factory() -> KVStore:
        from kvstore.cluster.lifecycle import connect

        return connect(config)

    return factory


class Replica:
    """What prefill and decode replicas share: a model, a store and an engine."""

    def __init__(self, config: KVStoreConfig, store_factory: StoreFactory | None,
                 replica_id: str = "replica-0") -> None:
        wc = config.worker
        self.replica_id = replica_id
        self.model = load_worker_model(wc)
        self.store = store_factory() if store_factory is not None else None
        self.engine = Engine(self.model, self.store, wc,
                             data_key=parse_data_key(config.security.data_key))
        self.worker_id = f"{replica_id}-{os.getpid()}"
        if isinstance(self.store, ClusterStore):
            self._report()

    def _report(self) -> None:
        """Tell the coordinator what this worker runs, for ``kvstore status``."""
        from kvstore.cluster import operations

        wc = self.engine.config
        info = {"replica": self.replica_id, "node_id": self.node_id(), "model": wc.model,
                "dtype": self.model.dtype, "attn": self.model.attn_implementation,
                "device": str(self.model.device), "numerics": self.model.numerics,
                "numerics_promise": describe_numerics(self.model.numerics),
                "block_size": wc.block_size, "chunk_tokens": wc.prefill_chunk_tokens,
                "reuse": self.engine.policy.as_dict(),
                "namespace": operations.describe_namespace(self.engine.namespace, wc.model)}
        try:
            operations.report_worker(self.worker_id, info)
        except (KVStoreError, ray.exceptions.RayError) as exc:  # status is a view, not a duty
            log.warning("kvstore worker %s could not report to the coordinator: %s",
                        self.worker_id, exc)

    def reuse_policy(self) -> dict[str, object]:
        """How this replica reuses cached blocks (``ReusePolicy.as_dict``)."""
        return self.engine.policy.as_dict()

    def node_id(self) -> str:
        """Where this replica's store client lives (the router matches it with holders)."""
        return self.store.node_id if self.store is not None else "none"

    def namespace(self) -> Namespace:
        """The namespace this replica reads and writes (the router hashes prompts in it)."""
        return self.engine.namespace

    def vocab_size(self) -> int:
        return self.model.shape.vocab_size

    def in_flight(self) -> int:
        return self.engine.num_active

    def visible_gpus(self) -> str | None:
        """``CUDA_VISIBLE_DEVICES`` of this replica's process: the GPUs Ray gave it (what its
        ``cuda:0`` is), or None where it asked Ray for none
        (``kvstore.workers.replicas.placement``)."""
        return os.environ.get("CUDA_VISIBLE_DEVICES")

    def cancel(self, request_id: str) -> None:
        self.engine.cancel(request_id)

    def close(self) -> None:
        if isinstance(self.store, ClusterStore):
            from kvstore.cluster import operations

            try:
                operations.forget_worker(self.worker_id)
            except (KVStoreError, ray.exceptions.RayError):
                pass  # the coordinator is gone: nothing left to tell
        self.engine.close()  # publish what is queued before the store goes
        if self.store is not None:
            self.store.close()


def replica_actor(cls: type[Replica], resources: dict[str, float] | None = None,
                  num_gpus: float = 0.0) -> Any:
    """``cls`` as a Ray actor class, ready for ``.remote(config, store_factory, replica_id)``.

    ``num_cpus=0``: replicas fix their own torch thread count, and Ray's CPU accounting would
    otherwise refuse to place more replicas than cores on a laptop. Threaded
    (``max_concurrency``) so a ``cancel`` reaches a running request and the deployment's
    ``MAX_IN_FLIGHT`` requests (2) run side by side: one fetching or publishing while the
    other computes, since the engine runs one model forward at a time. ``resources`` places it
    by custom resource (the prefill/decode node types of the deploy files); ``num_gpus`` (from
    ``kvstore.workers.replicas.placement``) gives it GPUs of its own.
    """
    return ray.remote(cls).options(num_cpus=0, max_concurrency=4,  # type: ignore[call-overload]
                                   num_gpus=num_gpus, resources=resources or {})
