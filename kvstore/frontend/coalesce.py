"""Requests that arrive together with a long shared prefix compute it once.

Without this, every request of a burst that shares a system prompt misses the store (none of
them has published yet) and each computes the whole prefix: the first round of a multi-user
chat is slower with the store than without it. So a request whose prompt shares at least
``min_tokens`` with a prefill in flight (same tenant) waits for that prefill to finish, then
finds the prefix published — the rule the jobs' request pipeline follows too
(``kvstore.workers.replicas.request_pipeline``). The wait ends when the earlier prefill ends,
whatever its outcome: never a hang.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


def shared_prefix(a: list[int], b: list[int]) -> int:
    """Length of the common prefix (binary search over C-level slice comparisons)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(slots=True)
class _Running:
    salt: str | None
    tokens: list[int]
    done: asyncio.Event = field(default_factory=asyncio.Event)


class InFlightPrefills:
    """The prefills this front end has in flight, and who should wait for whom."""

    def __init__(self, min_tokens: int) -> None:
        self.min_tokens = max(1, min_tokens)
        self._running: dict[str, _Running] = {}
        #: Requests that waited for an earlier prefill (for tests and the closing figures).
        self.waited = 0

    def leader(self, salt: str | None, tokens: list[int]) -> _Running | None:
        """The in-flight prefill sharing the longest prefix (at least ``min_tokens``)."""
        best, best_len = None, self.min_tokens - 1
        for run in self._running.values():
            if run.salt == salt:
                n = shared_prefix(tokens, run.tokens)
                if n > best_len:
                    best, best_len = run, n
        return best

    @contextlib.asynccontextmanager
    async def turn(self, request_id: str, salt: str | None, tokens: list[int]
                   ) -> AsyncIterator[None]:
        """Wait for a prefill computing this prompt's prefix, then run as one in flight."""
        lead = self.leader(salt, tokens)
        if lead is not None:
            self.waited += 1
            await lead.done.wait()
        run = _Running(salt, tokens)
        self._running[request_id] = run
        try:
            yield
        finally:
            run.done.set()
            self._running.pop(request_id, None)
