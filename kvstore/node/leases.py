"""The leases a store node handed out over gRPC: unguessable ids, bound to the credential that
took them, with lifetimes clamped (docs/security.md §Bounds).

The pool numbers its leases sequentially; those numbers never leave the node. A reader gets a
random wire id (128 bits), and the node remembers whose it is: a release by another credential
is ignored (releases are fire-and-forget, and telling a stranger whether an id exists would
help it guess), a renew by another is refused with PermissionDenied. TTLs: 0 means the node's
default; NaN or a negative TTL is refused; anything longer than ``server.max_lease_ttl_s``
(infinity included) is clamped to it, so a lease cannot pin blocks against eviction for good.
"""

from __future__ import annotations

import math
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvstore.errors import LeaseExpired, Overloaded, PermissionDenied

#: Open leases one credential may hold; readers release theirs once the blocks are copied.
MAX_LEASES_PER_SUBJECT = 4096
#: How long an expired lease's id is remembered (a late release is then a quiet no-op).
_FORGET_AFTER_S = 60.0


def clamp_ttl(ttl_s: float, default_s: float, max_s: float) -> float:
    """The TTL a lease gets: ``default_s`` for 0 (unset), at most ``max_s``; ValueError for
    NaN or a negative TTL."""
    if math.isnan(ttl_s) or ttl_s < 0:
        raise ValueError(f"lease ttl_s must be a number >= 0 (0 = the node's default), "
                         f"got {ttl_s}")
    return min(ttl_s if ttl_s > 0 else default_s, max_s)


@dataclass(slots=True)
class _Held:
    pool_id: Any
    subject: str
    expires_at: float  # the pool's monotonic clock


class LeaseTable:
    """Wire lease id -> the pool's lease and the subject that holds it; thread-safe."""

    def __init__(self, max_per_subject: int = MAX_LEASES_PER_SUBJECT) -> None:
        self.max_per_subject = max_per_subject
        self._held: dict[str, _Held] = {}
        self._per_subject: dict[str, int] = {}
        self._next_sweep = 0.0
        self._lock = threading.Lock()

    def check_room(self, subject: str) -> None:
        """Overloaded if ``subject`` holds as many open leases as allowed."""
        with self._lock:
            self._sweep_locked(time.monotonic())
            if self._per_subject.get(subject, 0) >= self.max_per_subject:
                raise Overloaded(f"credential {subject!r} holds {self.max_per_subject} open "
                                 "leases, the node's limit: release finished ones")

    def track(self, pool_id: Any, expires_at: float, subject: str) -> str:
        """A fresh wire id for the pool's lease ``pool_id``, bound to ``subject``."""
        wire_id = secrets.token_urlsafe(16)
        with self._lock:
            self._sweep_locked(time.monotonic())
            self._held[wire_id] = _Held(pool_id, subject, expires_at)
            self._per_subject[subject] = self._per_subject.get(subject, 0) + 1
        return wire_id

    def for_renew(self, wire_id: str, subject: str) -> Any:
        """The pool's lease behind ``wire_id``: LeaseExpired if unknown, PermissionDenied if
        another credential holds it."""
        with self._lock:
            held = self._held.get(wire_id)
        if held is None:
            raise LeaseExpired(f"lease {wire_id!r} is unknown or already released")
        if held.subject != subject:
            raise PermissionDenied(f"lease {wire_id!r} belongs to another credential")
        return held.pool_id

    def pool_id(self, wire_id: str) -> Any:
        """The pool's lease behind ``wire_id``, whoever holds it (LeaseExpired if unknown)."""
        with self._lock:
            held = self._held.get(wire_id)
        if held is None:
            raise LeaseExpired(f"lease {wire_id!r} is unknown or already released")
        return held.pool_id

    def renewed(self, wire_id: str, expires_at: float) -> None:
        with self._lock:
            held = self._held.get(wire_id)
            if held is not None:
                held.expires_at = expires_at

    def take(self, wire_id: str, subject: str) -> Any:
        """Forget ``wire_id`` and return its pool lease, if ``subject`` holds it (else None:
        another credential's lease is left alone, silently)."""
        with self._lock:
            held = self._held.get(wire_id)
            if held is None or held.subject != subject:
                return None
            self._drop_locked(wire_id, held)
        return held.pool_id

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def _drop_locked(self, wire_id: str, held: _Held) -> None:
        del self._held[wire_id]
        n = self._per_subject.get(held.subject, 0) - 1
        if n > 0:
            self._per_subject[held.subject] = n
        else:
            self._per_subject.pop(held.subject, None)

    def _sweep_locked(self, now: float) -> None:
        """Forget leases long expired (at most once a second: the walk is O(open leases))."""
        if now < self._next_sweep:
            return
        self._next_sweep = now + 1.0
        for wire_id, held in [(k, h) for k, h in self._held.items()
                              if h.expires_at < now - _FORGET_AFTER_S]:
            self._drop_locked(wire_id, held)
