"""Reading a same-node arena under a lease: taken for the read, or handed over by another
process that took it while it looked the blocks up.

A lease keeps a node from reusing its blocks' memory while a reader copies out of its arena.
Usually the reader takes it (one round trip to the node), reads, and releases it without
waiting. vLLM's connector looks a prompt up in its scheduler process, then loads it in its
worker process, so the scheduler's lookup asks for a lease instead of a yes/no answer (the same
one round trip) and the plan hands it to the worker as a ``HeldLease``: the load reads under it
and takes no lease of its own. ``time.monotonic`` is the system's clock, the same in every
process of a host, so the worker knows how old the lease is; one older than a third of its TTL
is released and a fresh one taken, so a read never starts on a lease about to end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore.client.replies import LeaseInfo
from kvstore.errors import KVStoreError, LeaseExpired
from kvstore.node.block_pool import BlockLocation

Read = Callable[[Any, dict[bytes, BlockLocation], Callable[[], None]], list[Any]]


@dataclass
class HeldLease:
    """A lease one process took on a store node for another to read under (plain data: it
    crosses processes pickled). ``granted_at``: ``time.monotonic()`` just before it was asked."""

    node_id: str
    info: LeaseInfo
    granted_at: float
    ttl_s: float

    def fresh(self, now: float | None = None) -> bool:
        """Young enough to start a read under (less than a third of its TTL gone)."""
        return (time.monotonic() if now is None else now) - self.granted_at < self.ttl_s / 3


def read_under_lease(client: Any, keys: list[bytes], namespace: Any, read: Read, *,
                     files: bool = False, held: HeldLease | None = None) -> list[Any]:
    """``read(reader, locations, keep_alive)`` under a lease on ``keys`` on ``client``'s node:
    ``held`` when it is still fresh (else it is released and a new one taken), else one asked
    now (in ``namespace``; ``files``: as ``StoreNodeClient.lease``'s). The lease is released
    without waiting once ``read`` returns; LeaseExpired if it may have ended before ``read``
    was done with the arena."""
    ttl_s = client.lease_ttl_s
    if held is not None and held.fresh():
        lease, granted = held.info, [held.granted_at]
    else:
        if held is not None:
            client.release_nowait(held.info.lease_id)
        granted = [time.monotonic()]  # before the call: the node's clock starts no earlier
        lease = client.lease(keys, ttl_s, namespace=namespace, files=files)
    renewal = threading.Lock()

    def keep_alive() -> None:
        # Renew inline, between blocks, once a third of the TTL has gone: a block copies in a
        # small part of a TTL, and a renewal thread per fetch would cost more than it saves.
        # Blocks copy on several threads: one of them renews, the others see it done.
        if time.monotonic() - granted[0] <= ttl_s / 3:
            return
        with renewal:
            if time.monotonic() - granted[0] > ttl_s / 3:
                renewing = time.monotonic()
                try:
                    client.renew(lease.lease_id, ttl_s)
                except KVStoreError as exc:
                    raise LeaseExpired(f"lease {lease.lease_id} on {client.address} ended "
                                       f"mid-copy: {exc}") from exc
                granted[0] = renewing

    try:
        out = read(client._reader(), {loc.key: loc for loc in lease.locations}, keep_alive)
        if time.monotonic() - granted[0] >= ttl_s:  # stalled past the TTL
            raise LeaseExpired(f"lease {lease.lease_id} on {client.address} ended mid-copy")
        return out
    finally:
        client.release_nowait(lease.lease_id)
