"""Cache-aware routing inside Serve: a prompt goes to a replica on the node holding its prefix.

A replica reads blocks held on its own Ray node from shared memory, and others' over the
network, so the jobs' router (``kvstore.workers.replicas.router``) prefers the replica whose node
holds most of the prompt's longest cached prefix, then the least loaded. Serve's default router
knows nothing of blocks, so the front end looks the prefix up (``PrefixLocator``) and puts the
blocks per node on the call (``EngineCall.node_blocks``); ``PrefixAffinityRouter`` ranks the
replicas on the best node first and otherwise routes as Serve does (power of two choices by
queue length), so a full replica on the right node still yields to a free one elsewhere.

With every replica on one node there is nothing to prefer, and the lookup is skipped
(``serve.prefix_routing``: ``auto``; ``always`` looks up anyway, ``off`` never does).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import ray
from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import PendingRequest, RunningReplica

from kvstore.errors import KVStoreError
from kvstore.keys import BlockHasher, Namespace

log = logging.getLogger(__name__)

#: How often the front end checks whether Ray has more than one node.
NODES_RECHECK_S = 30.0
#: Tenants whose namespace the locator remembers.
MAX_NAMESPACES = 1024


def rank_by_blocks(candidates: list[Any], blocks: dict[str, int]) -> list[Any]:
    """The candidates on the node(s) holding most of the prefix (none if no node holds any)."""
    best = max((blocks.get(r.node_id, 0) for r in candidates), default=0)
    if best == 0:
        return []
    return [r for r in candidates if blocks.get(r.node_id, 0) == best]


class PrefixAffinityRouter(PowerOfTwoChoicesRequestRouter):
    """Serve's router, with the replicas on the prefix's node ranked first."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        ranks = await super().choose_replicas(candidate_replicas, pending_request)
        call = pending_request.args[0] if pending_request and pending_request.args else None
        blocks = getattr(call, "node_blocks", None)
        preferred = rank_by_blocks(candidate_replicas, blocks) if blocks else []
        return [preferred, *ranks] if preferred else ranks


class PrefixLocator:
    """Where a prompt's cached prefix is, from the front end: blocks per store node."""

    def __init__(self, config: Any, prefill: Any) -> None:
        self.config = config
        self.prefill = prefill
        self._store: Any = None
        self._namespaces: dict[str | None, Namespace] = {}
        self._multi_node = False
        self._checked = 0.0
        self.mode = config.serve.prefix_routing
        #: Lookups that found the prefix on some node (for /health and tests).
        self.located = 0

    def _spans_nodes(self) -> bool:
        if self.mode != "auto":
            return self.mode == "always"
        now = time.monotonic()
        if now - self._checked > NODES_RECHECK_S:
            self._checked = now
            try:
                self._multi_node = sum(1 for n in ray.nodes() if n.get("Alive")) > 1
            except Exception:  # noqa: BLE001 - a preference, never a failure
                self._multi_node = False
        return self._multi_node

    async def _namespace(self, salt: str | None) -> Namespace:
        ns = self._namespaces.get(salt)
        if ns is None:
            ns = await self.prefill.namespace.remote(salt)
            if len(self._namespaces) >= MAX_NAMESPACES:
                self._namespaces.clear()
            self._namespaces[salt] = ns
        return ns

    def _lookup(self, ns: Namespace, tokens: list[int]) -> dict[str, int]:
        if self._store is None:
            from kvstore.cluster.lifecycle import connect

            self._store = connect(self.config)
        hit = self._store.lookup_prefix(ns, BlockHasher(ns).block_keys(tokens))
        return hit.blocks_per_node()

    async def locate(self, salt: str | None, tokens: list[int]) -> dict[str, int]:
        """Blocks of the prompt's cached prefix per node; ``{}`` when it does not matter."""
        if not self._spans_nodes():
            return {}
        try:
            ns = await self._namespace(salt)
            blocks = await asyncio.to_thread(self._lookup, ns, tokens)
            self.located += bool(blocks)
            return blocks
        except (KVStoreError, ray.exceptions.RayError, OSError) as exc:
            log.warning("prefix lookup for routing failed (routing as Serve does): %s", exc)
            return {}
