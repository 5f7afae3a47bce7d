"""Picks the prefill replica for a prompt: most cached prefix on its node, then least load."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.api import KVStore, TokenIds
from kvstore.keys import BlockHasher


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

    def overlap(self, token_ids: TokenIds) -> dict[str, int]:
        """Per node: how many blocks of the prompt's longest cached prefix it holds."""
        if self.store is None:
            return {}
        keys = self.hasher.block_keys(token_ids)
        hit = self.store.lookup_prefix(self.hasher.namespace, keys)
        counts: dict[str, int] = {}
        for holders in hit.holders[:hit.num_blocks]:
            for node in set(holders):
                counts[node] = counts.get(node, 0) + 1
        return counts

    def choose(self, token_ids: TokenIds) -> int:
        """The index of the replica to use; counts it as in flight until ``done``."""
        counts = self.overlap(token_ids)
        with self._lock:
            n = len(self.replicas)
            # Round-robin start so equal scores spread over replicas.
            order = [(self._next + i) % n for i in range(n)]
            best = max(order, key=lambda i: counts.get(self.replicas[i].node_id, 0)
                       - self.blocks_per_request * self.replicas[i].in_flight)
            self._next = (best + 1) % n
            self.replicas[best].in_flight += 1
            return best

    def done(self, index: int) -> None:
        """The request sent to replica ``index`` finished."""
        with self._lock:
            self.replicas[index].in_flight = max(0, self.replicas[index].in_flight - 1)
