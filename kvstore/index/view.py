"""A reader's view of the index: holders it was told recently, trusted for ``ttl_s``.

With the embedded index every ``lookup_prefix`` and ``holders`` is a Ray actor round trip
(milliseconds), and a request makes two of them (lookup, then ``batch_get``'s holder query for
the same keys). The view remembers each *positive* answer (key -> holders) for ``ttl_s`` and
the keys this reader put itself, and answers from memory when every key asked is fresh; a
lookup that runs into a key it has not seen (or has seen too long ago) asks the index for the
rest of the chain only. Absent keys are never remembered, so a key another client's Put made
visible is found by the next lookup: "Put returns once every key is visible" still holds.

What staleness costs (design.md §4, "the reader's index view"): for at most ``ttl_s`` after
a holder evicts or loses a block, the view may still promise it. ``batch_get`` then reads that
holder, which answers "not found" (or fails); ``batch_get`` then asks the index once for such
keys (trying any other holder), and a block nobody else holds is a ``Miss``: the worker
recomputes it. The view never supplies bytes, and every block read is verified against its key
and tokens, so a stale promise cannot turn into wrong KV. A miss from a holder also drops the
key from the view.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

from kvstore.index.base import Index
from kvstore.records import PrefixHit

#: Keys remembered at most; past it the oldest half is dropped (they would expire anyway).
MAX_KEYS = 1 << 20


class IndexView:
    """``lookup_prefix`` and ``holders`` of ``index``, answered from memory while fresh."""

    def __init__(self, index: Index, ttl_s: float, *,
                 clock: Callable[[], float] = time.monotonic, max_keys: int = MAX_KEYS) -> None:
        self.index = index
        self.ttl_s = ttl_s
        self._clock = clock
        self._max_keys = max_keys
        self._known: dict[bytes, tuple[list[str], float]] = {}  # key -> (holders, expires)
        self._lock = threading.Lock()
        #: Calls answered without the index / calls that asked it (for benchmarks and tests).
        self.num_local = 0
        self.num_remote = 0

    def lookup_prefix(self, keys: Sequence[bytes]) -> PrefixHit:
        """Leading keys with a holder: the fresh known ones, then the index for the rest."""
        keys = [bytes(k) for k in keys]
        known = self._fresh_prefix(keys)
        if len(known) == len(keys):
            self.num_local += 1
            return PrefixHit(len(known), known)
        self.num_remote += 1
        rest = self.index.lookup_prefix(keys[len(known):])
        self._learn(keys[len(known) : len(known) + rest.num_blocks], rest.holders)
        return PrefixHit(len(known) + rest.num_blocks, known + rest.holders)

    def fresh_count(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the view would answer from memory now."""
        return len(self._fresh_prefix([bytes(k) for k in keys]))

    def holders(self, keys: Sequence[bytes]) -> list[list[str]]:
        """Holders per key: fresh known ones from memory, the others in one index call."""
        keys = [bytes(k) for k in keys]
        now = self._clock()
        with self._lock:
            got = [self._get(k, now) for k in keys]
        ask = [i for i, h in enumerate(got) if h is None]
        if not ask:
            self.num_local += 1
            return [list(h) for h in got if h is not None]
        self.num_remote += 1
        answers = self.index.holders([keys[i] for i in ask])
        found = [(keys[i], h) for i, h in zip(ask, answers, strict=True) if h]
        self._learn([k for k, _ in found], [h for _, h in found])
        for i, h in zip(ask, answers, strict=True):
            got[i] = h
        return [list(h or []) for h in got]

    def put(self, keys: Sequence[bytes], node_id: str) -> None:
        """This reader's Put of ``keys`` to ``node_id`` returned: they are held there."""
        if self.ttl_s <= 0:
            return
        now = self._clock()
        with self._lock:
            for k in keys:
                held = self._get(bytes(k), now) or []
                self._known[bytes(k)] = (held if node_id in held else [*held, node_id],
                                         now + self.ttl_s)
            self._trim()

    def forget(self, keys: Sequence[bytes]) -> None:
        """A holder said it no longer has ``keys`` (or failed): ask the index next time."""
        with self._lock:
            for k in keys:
                self._known.pop(bytes(k), None)

    # -- internals --------------------------------------------------------------------------
    def _get(self, key: bytes, now: float) -> list[str] | None:
        entry = self._known.get(key)
        if entry is None or entry[1] <= now:
            return None
        return entry[0]

    def _fresh_prefix(self, keys: list[bytes]) -> list[list[str]]:
        now = self._clock()
        out: list[list[str]] = []
        with self._lock:
            for k in keys:
                h = self._get(k, now)
                if h is None:
                    break
                out.append(list(h))
        return out

    def remember(self, keys: Sequence[bytes], holders: Sequence[list[str]]) -> None:
        """Holders another reader of the same cluster was told moments ago (vLLM's scheduler
        process looks a prefix up, its worker fetches it): trusted like this view's own
        answers, for ``ttl_s``, so the fetch skips a second index round trip."""
        self._learn([bytes(k) for k in keys], holders)

    def _learn(self, keys: Sequence[bytes], holders: Sequence[list[str]]) -> None:
        if self.ttl_s <= 0:
            return
        expires = self._clock() + self.ttl_s
        with self._lock:
            for k, h in zip(keys, holders, strict=True):
                if h:
                    self._known[k] = (list(h), expires)
            self._trim()

    def _trim(self) -> None:
        if len(self._known) > self._max_keys:
            for k in list(self._known)[: len(self._known) // 2]:  # oldest first (insertion)
                del self._known[k]
