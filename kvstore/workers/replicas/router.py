"""Picks a replica for a prompt: most cached prefix on its node, then least load.

The deployment keeps one router for its prefill replicas and one for its decode replicas.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.api import KVStore, PrefixHit, TokenIds
from kvstore.errors import KVStoreError
from kvstore.keys import BlockHasher, BlockKey


@dataclass(slots=True)
class ReplicaSlot:
    """One prefill replica as the router sees it."""

    name: str
    node_id: str
    in_flight: int = 0


class Router:
    """Scores replicas by blocks of the longest cached prefix held on their node, minus load.

    A block on the replica's own node is read from shared memory instead of over gRPC, so
    overlap is worth more than a short queue, up to ``blocks_per_request`` blocks per request
    already in flight there.
    """

    def __init__(self, store: KVStore | None, hasher: BlockHasher,
                 replicas: Sequence[ReplicaSlot], blocks_per_request: float = 8.0) -> None:
        if not replicas:
            raise ValueError("a router needs at least one replica")
        self.store = store
        self.hasher = hasher
        self.replicas = list(replicas)
        self.blocks_per_request = blocks_per_request
        self._lock = threading.Lock()
        self._next = 0

    def lookup(self, token_ids: TokenIds) -> tuple[list[BlockKey], PrefixHit]:
        """The prompt's block keys and its longest cached prefix (none without a store).

        An index that cannot answer counts as a cold start, as in the engine: routing is a
        preference, and a job must not fail over it.
        """
        keys = self.hasher.block_keys(token_ids)
        if self.store is None:
            return keys, PrefixHit(0, [])
        try:
            return keys, self.store.lookup_prefix(self.hasher.namespace, keys)
        except KVStoreError:
            return keys, PrefixHit(0, [])

    def choose(self, token_ids: TokenIds, *, hit: PrefixHit | None = None,
               max_in_flight: int | None = None) -> int | None:
        """The index of the replica to use; counts it as in flight until ``done``.

        ``hit`` saves a second index lookup when the caller has one. With ``max_in_flight``
        only replicas with fewer requests in flight qualify, and ``None`` means all are full.
        """
        if hit is None:
            hit = self.lookup(token_ids)[1]
        counts = hit.blocks_per_node()
        with self._lock:
            n = len(self.replicas)
            # Round-robin start so equal scores spread over replicas.
            order = [(self._next + i) % n for i in range(n)
                     if max_in_flight is None
                     or self.replicas[(self._next + i) % n].in_flight < max_in_flight]
            if not order:
                return None
            best = max(order, key=lambda i: counts.get(self.replicas[i].node_id, 0)
                       - self.blocks_per_request * self.replicas[i].in_flight)
            self._next = (best + 1) % n
            self.replicas[best].in_flight += 1
            return best

    def has_room(self, max_in_flight: int) -> bool:
        """Whether some replica has fewer than ``max_in_flight`` requests in flight."""
        with self._lock:
            return any(r.in_flight < max_in_flight for r in self.replicas)

    def done(self, index: int) -> None:
        """The request sent to replica ``index`` finished."""
        with self._lock:
            self.replicas[index].in_flight = max(0, self.replicas[index].in_flight - 1)
