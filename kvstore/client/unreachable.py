"""Store nodes that just failed to answer: skipped for a while, then probed by one read.

A host whose link is cut does not refuse connections, it lets them time out, and the index
keeps naming it as a holder until Ray declares it dead, tens of seconds later. Without a memory
of the failure every read in that window pays the client's timeout (and its retry) before it
recomputes. So a reader keeps one small circuit breaker per node:

- a node that raised ``NodeUnavailable`` is skipped for ``cooldown_s``: lookups do not count
  the blocks only it holds, and reads of them are misses at once (the worker recomputes them,
  as it would after the timeout, only sooner);
- when that time is up, one read probes the node while the others keep skipping it;
- the probe's success ends the cooldown; another failure starts one twice as long, up to
  ``max_cooldown_s``;
- a node the directory names at another address than the one that failed is a replacement
  (the store node restarted, on a new port): trusted at once, not left to wait out a cooldown
  earned by its predecessor.

Skipping costs recomputation, never correctness: a skipped block is a miss with its reason.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvstore.records import PrefixHit

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Suspect:
    """One node's breaker: how many failures in a row, and when it may be tried again."""

    failures: int
    cooldown_s: float
    retry_at: float
    address: str | None = None  # where it failed; None: not known
    probing: bool = False


class UnreachableNodes:
    """Which nodes a reader skips now (thread-safe: a vLLM worker reads from several threads)."""

    def __init__(self, cooldown_s: float, max_cooldown_s: float, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``cooldown_s``: how long a node is skipped after its first failure (0: never skip);
        ``max_cooldown_s``: the longest a repeated failure makes that."""
        if cooldown_s < 0 or max_cooldown_s < cooldown_s:
            raise ValueError(f"need 0 <= cooldown_s ({cooldown_s}) <= max_cooldown_s "
                             f"({max_cooldown_s})")
        self.cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self._clock = clock
        self._suspects: dict[str, _Suspect] = {}
        self._lock = threading.Lock()

    def failed(self, node: str, reason: object = "", *, address: str | None = None) -> None:
        """``node`` did not answer (at ``address``, where known): skip it for the next cooldown
        (longer after each failure)."""
        if self.cooldown_s <= 0:
            return
        now = self._clock()
        with self._lock:
            old = self._suspects.get(node)
            if old is not None and not old.probing and now < old.retry_at:
                return  # a read that started before the cooldown: the same failure
            cooldown = self.cooldown_s if old is None else min(old.cooldown_s * 2,
                                                               self.max_cooldown_s)
            failures = 1 if old is None else old.failures + 1
            known = address or (old.address if old is not None else None)
            self._suspects[node] = _Suspect(failures, cooldown, now + cooldown, known)
        log.warning("store node %s did not answer (%s): reads skip it for %.0f s "
                    "(failure %d in a row)", node[:12], reason, cooldown, failures)

    def answered(self, node: str) -> None:
        """``node`` answered a read: it is trusted again at once."""
        if node not in self._suspects:
            return
        with self._lock:
            gone = self._suspects.pop(node, None)
        if gone is not None:
            log.info("store node %s answers again", node[:12])

    def resolved(self, node: str, address: str) -> None:
        """The directory names ``address`` for ``node``: if that node failed at another
        address, this is a new store node there, and the old one's failures do not count."""
        if node not in self._suspects:
            return
        with self._lock:
            suspect = self._suspects.get(node)
            if suspect is None or suspect.address in (None, address):
                return
            del self._suspects[node]
        log.info("store node %s moved from %s to %s: trusted again", node[:12],
                 suspect.address, address)

    def cooling(self, node: str) -> bool:
        """Whether ``node`` is inside its cooldown or a probe's window (a lookup's question:
        no side effect, so a lookup after the cooldown counts the node's blocks and the read
        then probes it)."""
        if not self._suspects:  # every node answers: the common case costs no lock
            return False
        with self._lock:
            suspect = self._suspects.get(node)
            return suspect is not None and self._clock() < suspect.retry_at

    def skip(self, node: str) -> bool:
        """Whether a read should skip ``node`` now. After the cooldown the first caller is let
        through as the probe, and the others skip until it reports; a probe that never
        reports is given one more cooldown, then another caller probes."""
        if not self._suspects:
            return False
        with self._lock:
            suspect = self._suspects.get(node)
            if suspect is None:
                return False
            now = self._clock()
            if now < suspect.retry_at:
                return True
            suspect.probing = True
            suspect.retry_at = now + suspect.cooldown_s
            return False

    def reachable(self, hit: PrefixHit) -> PrefixHit:
        """``hit`` without the holders skipped now, cut at the first block no other holder
        has: a scheduler then plans to compute that block, rather than to load it and
        recompute after the read misses."""
        if not self._suspects:  # every node answers: the common case costs no lock
            return hit
        holders = [[h for h in hs if not self.cooling(h)] for hs in hit.holders]
        num = next((i for i, hs in enumerate(holders) if not hs), len(holders))
        return hit if num == hit.num_blocks and holders == hit.holders \
            else PrefixHit(num, holders[:num])

    def retry_in(self, node: str) -> float:
        """Seconds until ``node`` may be probed again (0 when it is not skipped)."""
        with self._lock:
            suspect = self._suspects.get(node)
            return 0.0 if suspect is None else max(0.0, suspect.retry_at - self._clock())


_PROCESS_WIDE: dict[tuple[float, float], UnreachableNodes] = {}
_PROCESS_WIDE_LOCK = threading.Lock()


def process_wide(cooldown_s: float, max_cooldown_s: float) -> UnreachableNodes:
    """One set of breakers for every cluster client of this process with these settings:
    what one reader learns, its neighbours skip too. vLLM makes its scheduler's connector and
    its worker's separately, in one process: the worker's read finds the node silent, the
    scheduler's next lookup stops counting that node's blocks. (Ray node ids are never
    reused, so clients of different clusters cannot confuse each other's nodes.)"""
    with _PROCESS_WIDE_LOCK:
        key = (cooldown_s, max_cooldown_s)
        if key not in _PROCESS_WIDE:
            _PROCESS_WIDE[key] = UnreachableNodes(cooldown_s, max_cooldown_s)
        return _PROCESS_WIDE[key]
