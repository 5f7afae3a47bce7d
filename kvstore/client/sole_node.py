"""Whether this host's store node is the cluster's only one, known without asking per lookup.

A lookup asks this host's node for the leading run of blocks it holds, then the index for the
rest. On a cluster whose only store node is this one (the single-machine default, a laptop, one
GPU box) the index can name no other holder, so that second round trip (a Ray actor call for
the coordinator's index) buys nothing. ``SoleNode`` keeps the answer from the coordinator's
directory, asked again on the lookup's own thread once it is ``max_age_s`` old (never from a
background thread: a Ray call from a thread that outlives ``ray.shutdown()`` would start a Ray
instance of its own). A directory that fails or that cannot list its nodes counts as "not
alone", so the index is asked as before. A node that joined since the last answer is missed for
at most ``max_age_s``: a lookup that stops short (a miss), never a wrong block.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

log = logging.getLogger(__name__)

#: How old an answer may be before a lookup asks the directory again (one call per this long).
MAX_AGE_S = 10.0


class SoleNode:
    """``alone()``: this host's node was the directory's only node at the last refresh."""

    def __init__(self, node_id: str, nodes: Callable[[], Mapping[str, Any]] | None, *,
                 max_age_s: float = MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic,
                 on_listing: Callable[[Mapping[str, Any]], None] | None = None) -> None:
        """``nodes``: the directory as a zero-argument call returning every node by id, or
        None where the directory only resolves one id at a time (never alone then);
        ``on_listing``: also told each listing (what else the caller learns from it)."""
        self.node_id = node_id
        self.max_age_s = max_age_s
        self._nodes = nodes
        self._on_listing = on_listing
        self._clock = clock
        self._alone = False
        self._checked_at: float | None = None
        self._lock = threading.Lock()

    def alone(self) -> bool:
        with self._lock:
            fresh = (self._checked_at is not None
                     and self._clock() - self._checked_at <= 2 * self.max_age_s)
            return fresh and self._alone

    def alone_now(self) -> bool:
        """``alone()``, asking the directory first if the answer is ``max_age_s`` old."""
        self.refresh()
        return self.alone()

    def refresh(self, *, if_older: bool = True) -> None:
        """Ask the directory again (``if_older``: only once ``max_age_s`` has passed)."""
        if self._nodes is None:
            return
        with self._lock:
            checked = self._checked_at
        if if_older and checked is not None and self._clock() - checked < self.max_age_s:
            return
        try:
            listing = self._nodes()
            alone = set(listing) == {self.node_id}
        except Exception as exc:  # the coordinator is away: ask the index meanwhile
            log.debug("the store directory did not answer: %s", exc)
            listing, alone = None, False
        if listing is not None and self._on_listing is not None:
            self._on_listing(listing)
        with self._lock:
            self._alone, self._checked_at = alone, self._clock()
