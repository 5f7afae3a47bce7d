"""``PrefillWorker``: a Ray actor around the engine's prefill (design.md §4, request flow 2).

The actor is a thin shell: the work is in ``workers.engine``. ``PrefillReplica`` is the plain
class (usable in-process); ``PrefillWorker`` is the same class as a Ray actor, threaded so a
``cancel`` can reach a running request.
"""

from __future__ import annotations

from collections.abc import Callable

import ray

from kvstore.api import KVStore, TokenIds
from kvstore.config import KVStoreConfig
from kvstore.keys import Namespace
from workers.engine import Engine, PrefillResult, SamplingParams
from workers.model import load_model

#: Builds the replica's store inside the replica's own process (stores do not pickle).
StoreFactory = Callable[[], "KVStore | None"]


def cluster_store_factory(config: KVStoreConfig) -> StoreFactory:
    """A factory that connects to the running kvstore cluster from inside an actor."""

    def factory() -> KVStore:
        from kvstore import cluster

        return cluster.connect(config)

    return factory


class Replica:
    """What prefill and decode replicas share: a model, a store and an engine."""

    def __init__(self, config: KVStoreConfig, store_factory: StoreFactory | None,
                 replica_id: str = "replica-0") -> None:
        wc = config.worker
        self.replica_id = replica_id
        self.model = load_model(wc.model, seed=wc.seed, dtype=wc.dtype,
                                num_threads=wc.num_threads)
        self.store = store_factory() if store_factory is not None else None
        self.engine = Engine(self.model, self.store, wc)

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

    def cancel(self, request_id: str) -> None:
        self.engine.cancel(request_id)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()


class PrefillReplica(Replica):
    """Computes only the uncached suffix of a prompt, publishes it, returns the first token."""

    def prefill(self, token_ids: TokenIds, request_id: str,
                sampling: SamplingParams | None = None, use_cache: bool = True,
                return_logits: bool = False) -> PrefillResult:
        return self.engine.prefill(token_ids, request_id=request_id, sampling=sampling,
                                   use_cache=use_cache, return_logits=return_logits)


# num_cpus=0: replicas fix their own torch thread count; Ray's CPU accounting would otherwise
# refuse to place more replicas than cores on a laptop.
PrefillWorker = ray.remote(num_cpus=0, max_concurrency=4)(  # type: ignore[call-overload]
    PrefillReplica)
