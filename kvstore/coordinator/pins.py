"""Pins: blocks the coordinator must keep (hard) or keep while anything else can go (soft).

Pins are few (system prompts, few-shot blocks), so a plain dict keyed by block key is the
source of truth; the LRU table carries one pin byte per block so the planner stays vectorised.
A pin may precede the block's publication: it applies as soon as the key appears.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.coordinator.lru import PIN_HARD, PIN_NONE, PIN_SOFT


@dataclass(slots=True)
class Pin:
    """One pinned key: hard pins are never evicted; ``expires_at`` None means no expiry."""

    hard: bool
    expires_at: float | None

    @property
    def level(self) -> int:
        return PIN_HARD if self.hard else PIN_SOFT


class PinTable:
    """Pinned keys with their level and expiry."""

    def __init__(self) -> None:
        self._pins: dict[bytes, Pin] = {}

    def __len__(self) -> int:
        return len(self._pins)

    def __contains__(self, key: bytes) -> bool:
        return key in self._pins

    def pin(self, keys: Sequence[bytes], *, hard: bool, expires_at: float | None) -> None:
        """Pin (or re-pin, replacing level and expiry) ``keys``."""
        for key in keys:
            self._pins[key] = Pin(hard, expires_at)

    def unpin(self, keys: Sequence[bytes]) -> list[bytes]:
        """Drop pins; returns the keys that were pinned."""
        return [k for k in keys if self._pins.pop(k, None) is not None]

    def level(self, key: bytes) -> int:
        """PIN_NONE, PIN_SOFT or PIN_HARD."""
        pin = self._pins.get(key)
        return PIN_NONE if pin is None else pin.level

    def is_soft(self, key: bytes) -> bool:
        """Soft-pinned keys are the ones worth replicating to every reader's node."""
        pin = self._pins.get(key)
        return pin is not None and not pin.hard

    def levels(self, keys: Sequence[bytes]) -> dict[int, list[bytes]]:
        """The pinned ones among ``keys``, grouped by level (cheap when nothing is pinned)."""
        out: dict[int, list[bytes]] = {}
        if self._pins:
            for k in keys:
                pin = self._pins.get(k)
                if pin is not None:
                    out.setdefault(pin.level, []).append(k)
        return out

    def expire(self, now: float) -> list[bytes]:
        """Remove pins whose TTL has passed; returns their keys."""
        gone = [k for k, p in self._pins.items()
                if p.expires_at is not None and p.expires_at <= now]
        for k in gone:
            del self._pins[k]
        return gone

    def counts(self) -> dict[str, int]:
        """How many hard and soft pins exist (for status)."""
        hard = sum(1 for p in self._pins.values() if p.hard)
        return {"hard": hard, "soft": len(self._pins) - hard}
