"""The global index: which nodes hold which block, its size, parent, namespace and last use.

Metadata only, never bytes (as Mooncake's master): store nodes hold the blocks, the index says
where they are. Three backends keep the same contract: ``kvstore.index.memory.InMemoryIndex``
(dicts, one process, no server: for tests and in-process users),
``kvstore.coordinator.table_index.TableIndex`` (the compact table the coordinator uses in memory
mode: one numpy row per block, no Python object, and the LRU table itself) and
``kvstore.index.redis.RedisIndex`` (shared by a cluster; a longest-prefix lookup is one round
trip). ``kvstore.index.factory.make_index`` picks dicts or Redis from ``IndexConfig``; the
coordinator builds its ``TableIndex`` itself, since it shares the table with its LRU.

Contract shared by every backend (tests/index/test_index.py checks them against one model):
- a key exists while it has at least one holder; removing its last holder removes the key;
- ``lookup_prefix`` counts the *leading* keys that have a holder and stops at the first miss,
  because a chained key is only useful when every block before it is cached too;
- lists come back sorted (holders, keys, nodes), so results do not depend on the backend;
- ``last_use`` only moves forward (``touch`` keeps the later time), so a reader with a lagging
  clock cannot make a hot block look cold to the coordinator's LRU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvstore.records import PrefixHit


@dataclass(slots=True)
class IndexEntry:
    """One holder announcing one block."""

    key: bytes
    node_id: str
    nbytes: int
    parent_key: bytes
    namespace_root: bytes


@dataclass(slots=True)
class KeyInfo:
    """What the index knows about one key."""

    key: bytes
    holders: list[str]
    nbytes: int
    parent_key: bytes
    namespace_root: bytes
    last_use: float


class Index(Protocol):
    """The global index as the coordinator, the router and the store nodes use it."""

    def publish(self, entries: Sequence[IndexEntry]) -> None:
        """Add holders; every reader sees them once this returns."""
        ...

    def lookup_prefix(self, keys: Sequence[bytes]) -> PrefixHit:
        """How many leading ``keys`` have a holder, and the holders of each of them."""
        ...

    def holders(self, keys: Sequence[bytes]) -> list[list[str]]:
        """The holders of each key (empty list for an unknown key)."""
        ...

    def info(self, keys: Sequence[bytes]) -> list[KeyInfo | None]:
        """Everything known about each key, ``None`` for an unknown key."""
        ...

    def touch(self, keys: Sequence[bytes], now: float | None = None) -> None:
        """Record a use of ``keys`` (for LRU); unknown keys are ignored."""
        ...

    def remove(self, keys: Sequence[bytes], node_id: str) -> None:
        """``node_id`` no longer holds ``keys``; a key left without holders disappears."""
        ...

    def drop_node(self, node_id: str) -> int:
        """Forget a node that left; returns how many keys it held."""
        ...

    def keys_of_node(self, node_id: str) -> list[bytes]:
        """The keys a node holds (to reconcile with what it re-announces)."""
        ...

    def keys_of_namespace(self, namespace_root: bytes) -> list[bytes]:
        """The keys of one namespace (for ``kvstore invalidate --namespace``)."""
        ...

    def nodes(self) -> list[str]:
        """The nodes that hold at least one key."""
        ...

    def num_keys(self) -> int:
        """How many keys have at least one holder."""
        ...

    def clear(self) -> None:
        """Forget everything."""
        ...

    def set_marker(self, epoch: int) -> None:
        """Record the coordinator's epoch, so that a later ``claim_marker`` can tell whether the
        index lost its data (a Redis restarted empty) while the coordinator kept running."""
        ...

    def claim_marker(self, epoch: int) -> bool:
        """Write ``epoch`` as the marker if none is there; True means the data was lost."""
        ...

    def close(self) -> None:
        """Release connections; the index is unusable afterwards."""
        ...


class InProcessMarker:
    """The epoch marker of an index that lives and dies with its owner's process.

    Nothing can wipe such an index behind the coordinator's back, so there is no marker to keep
    and it is never found missing.
    """

    def set_marker(self, epoch: int) -> None:
        """Nothing to record."""

    def claim_marker(self, epoch: int) -> bool:
        """Never lost."""
        return False
