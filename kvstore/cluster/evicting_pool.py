"""A store node's pool as its server sees it: a full pool makes room, then the reserve is retried.

The server only calls ``reserve`` and friends, so wrapping the pool is enough to hook eviction
in without the server knowing about the coordinator (``kvstore.cluster.store_node`` passes the
make-room call). The server reserves space only for blocks it holds whole (a Put's unfinished
block waits in its messages, ``kvstore.node.limits``), so room is never made for a Put that
may not finish.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from kvstore.constants import align_up
from kvstore.errors import PoolFull
from kvstore.keys import Namespace
from kvstore.node.block_pool import BlockPool
from kvstore.node.tiered_pool import TieredPool


class EvictingPool:
    """A BlockPool seen through the server: on PoolFull it makes room and retries.

    The server only calls ``reserve`` and friends, so wrapping the pool is enough to hook
    eviction in without the server knowing about the coordinator. Reads are reported by the
    server itself (``on_read``), which knows the reader's node.

    Concurrent Puts share one eviction: room is made by one caller at a time, and a caller
    that finds room was made since its own PoolFull retries before asking again, so four
    full-pool Puts cost one coordinator call, not four plans that each count the same bytes.
    A reservation can still lose the room it waited for to another Put, so it retries up to
    ``max_attempts`` times; it fails at once only when nothing evictable is left.
    """

    def __init__(self, pool: BlockPool | TieredPool, make_room: Callable[[int], bool],
                 max_attempts: int = 8) -> None:
        self._pool = pool
        self._make_room = make_room
        self._max_attempts = max_attempts
        self._room_lock = threading.Lock()
        self._rooms_made = 0  # bumped by each make-room that freed something

    def reserve(self, key: bytes, nbytes: int) -> Any:
        for _ in range(self._max_attempts):
            seen = self._rooms_made
            try:
                return self._pool.reserve(key, nbytes)
            except PoolFull as exc:
                full = exc
                if align_up(nbytes) > self._pool.capacity_bytes:
                    raise  # no eviction can help: keep the pool's contents
                with self._room_lock:
                    if self._rooms_made != seen:
                        continue  # room was made while this one waited: try it first
                    if not self._make_room(nbytes):
                        raise PoolFull(
                            f"{exc}; the coordinator found nothing evictable on this node "
                            "(every block is pinned, leased or already ordered out): "
                            "unpin blocks or raise pool.capacity_bytes") from exc
                    self._rooms_made += 1
        raise PoolFull(f"{full}; concurrent Puts took the room of {self._max_attempts} "
                       "evictions in a row: retry, or raise pool.capacity_bytes")

    def make_room_ahead(self, make_room: Callable[[], bool]) -> bool:
        """Run ``make_room`` (a background caller's: room made before any reserve needs it)
        under the same lock as ``reserve``'s own, so a reserve waiting on it finds room made
        and retries instead of asking again."""
        with self._room_lock:
            if make_room():
                self._rooms_made += 1
                return True
        return False

    def reserve_many(self, keys: Sequence[bytes], nbytes: int) -> list[Any]:
        """The pool's ``reserve_many``, with room made as ``reserve`` makes it: where the pool
        stops short, the next key goes through ``reserve`` (which asks the coordinator, whose
        plan frees down to the low watermark), then the rest are asked for in one go again.
        Returns short when room runs out after some were reserved (the caller stores those
        first; asking again for the rest raises the PoolFull that says why)."""
        out: list[Any] = []
        while len(out) < len(keys):
            try:
                out += self._pool.reserve_many(keys[len(out):], nbytes)
            except PoolFull:
                pass
            if len(out) < len(keys):
                try:
                    out.append(self.reserve(keys[len(out)], nbytes))
                except PoolFull:
                    if any(r is not None for r in out):
                        return out
                    raise
                except BaseException:
                    for res in out:
                        if res is not None:
                            self._pool.abort(res)
                    raise
        return out

    def lease(self, keys: Sequence[bytes], ttl_s: float,
              namespace: Namespace | None = None, *, files: bool = False) -> Any:
        """The pool's lease; with a disk tier, disk blocks the arena has no room for get room
        made as a Put's would (``TieredPool.lease``), so a disk hit is served rather than
        missed while the arena is full of colder blocks. ``files``: as ``TieredPool.lease``'s."""
        if isinstance(self._pool, TieredPool):
            return self._pool.lease(keys, ttl_s, namespace, make_room=self._room_for_read,
                                    files=files)
        return self._pool.lease(keys, ttl_s, namespace)

    def _room_for_read(self, nbytes: int) -> bool:
        with self._room_lock:
            if not self._make_room(nbytes):
                return False
            self._rooms_made += 1
            return True

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)
