"""The Index protocol over the coordinator actor, for readers when the index is in-memory.

With the embedded index the coordinator holds it, so readers and the router ask it. The data
path's two calls, ``lookup_prefix`` and ``holders``, go over the coordinator's gRPC index
service when it has one (``kvstore.coordinator.index_service``: a few times cheaper than an
actor call), and over the actor when it has none or cannot be reached. Writes come from store
nodes through their own coordinator calls (publish/removed), which keep the LRU table in step;
this view forwards them too so it satisfies the whole protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import ray

from kvstore.config import ClientConfig
from kvstore.coordinator.index_service import FastPath, NoAnswer
from kvstore.index.base import IndexEntry, InProcessMarker, KeyInfo
from kvstore.index.checks import check_keys
from kvstore.records import PrefixHit


class CoordinatorIndex(InProcessMarker):
    """``kvstore.index.base.Index`` answered by the coordinator actor behind ``handle``."""

    def __init__(self, handle: Any, config: ClientConfig | None = None, *,
                 fast_path: bool = True) -> None:
        """``fast_path=False``: every call is an actor call (tests compare the two)."""
        self.handle = handle
        self._fast = FastPath(lambda: ray.get(handle.index_address.remote()), config) \
            if fast_path else None

    def publish(self, entries: Sequence[IndexEntry]) -> None:
        """Publish per node, as the store nodes do."""
        by_node: dict[str, list[IndexEntry]] = {}
        for e in entries:
            by_node.setdefault(e.node_id, []).append(e)
        ray.get([self.handle.publish.remote(n, es) for n, es in by_node.items()])

    def lookup_prefix(self, keys: Sequence[bytes]) -> PrefixHit:
        """Leading keys with a holder."""
        check_keys(keys)
        if self._fast is not None:
            hit = self._fast.attempt(lambda c: c.lookup_prefix(keys))
            if not isinstance(hit, NoAnswer):
                return hit
        return ray.get(self.handle.lookup_prefix.remote(list(keys)))

    def holders(self, keys: Sequence[bytes]) -> list[list[str]]:
        """Holders per key."""
        check_keys(keys)
        if self._fast is not None:
            holders = self._fast.attempt(lambda c: c.holders(keys))
            if not isinstance(holders, NoAnswer):
                return holders
        return ray.get(self.handle.holders.remote(list(keys)))

    def info(self, keys: Sequence[bytes]) -> list[KeyInfo | None]:
        """Holders only: the coordinator does not ship per-key metadata to readers."""
        holders = self.holders(keys)
        return [KeyInfo(k, h, 0, b"", b"", 0.0) if h else None
                for k, h in zip(keys, holders, strict=True)]

    def touch(self, keys: Sequence[bytes], now: float | None = None) -> None:
        """Record uses (readers normally let their store node batch these)."""
        check_keys(keys)
        ray.get(self.handle.touch.remote(list(keys)))

    def remove(self, keys: Sequence[bytes], node_id: str) -> None:
        """A node no longer holds ``keys``."""
        ray.get(self.handle.removed.remote(node_id, list(keys)))

    def drop_node(self, node_id: str) -> int:
        """Forget a node."""
        return ray.get(self.handle.remove_node.remote(node_id))

    def keys_of_node(self, node_id: str) -> list[bytes]:
        """The keys the coordinator's index gives ``node_id``."""
        return ray.get(self.handle.keys_of_node.remote(node_id))

    def keys_of_namespace(self, namespace_root: bytes) -> list[bytes]:
        """The keys of one namespace."""
        return ray.get(self.handle.keys_of_namespace.remote(namespace_root))

    def nodes(self) -> list[str]:
        """Live nodes known to the coordinator."""
        return sorted(ray.get(self.handle.directory.remote()))

    def num_keys(self) -> int:
        """Blocks the coordinator tracks."""
        return int(ray.get(self.handle.status.remote())["totals"]["blocks"])

    def clear(self) -> None:
        """Not allowed through readers: the index is the cluster's."""
        raise NotImplementedError("clear the cluster index with `kvstore stop`")

    def close(self) -> None:
        """The index service's channel; the actor outlives its readers."""
        if self._fast is not None:
            self._fast.close()
