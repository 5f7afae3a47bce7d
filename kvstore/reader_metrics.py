"""Reader-side metrics: tallied in the reader's process, pushed to its store node, served there.

Hits, misses, fetched blocks and fetch latency happen in worker processes (a ``ClusterStore``
inside a Ray actor) that nobody scrapes. So the helpers here never touch a Prometheus registry:
they add to one process-wide ``ReaderTally``, and ``ClusterStore`` hands it to its own store
node (``ReportReads``) every ``FLUSH_INTERVAL_S`` and on close. The node records the deltas in
its registry (``kvstore.metrics.apply_reader_tally``) and serves them on its ``/metrics``, so a
figure is counted exactly once, by whoever serves it. A push that fails is merged back and goes
with the next one.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field

from kvstore.records import MISS_CORRUPTED, MISS_MISMATCH, MISS_REASONS, MissReason

#: How block bytes moved: gRPC messages, the bulk byte channel, or same-node shared memory.
PATHS = ("grpc", "bulk", "shm")
#: Why a block was refused on the way in or out (reads reject with the MISS_* verdicts).
REJECT_REASONS = (MISS_CORRUPTED, MISS_MISMATCH, "namespace", "too_large", "malformed",
                  "pool_full", "unauthenticated")
#: Where a prefill's prompt tokens got their KV.
PREFILL_KINDS = ("cached", "unreused_shared", "computed")
#: How often a reader pushes its tally (and on close): short enough for a scrape to be current.
FLUSH_INTERVAL_S = 1.0
#: Latency samples kept per path between pushes; past this a reader with no node drops them.
MAX_SAMPLES = 100_000


def check_label(value: str, allowed: tuple[str, ...], what: str) -> str:
    """``value`` if it is one of ``allowed``: an unknown label would start a new series."""
    if value not in allowed:
        raise ValueError(f"unknown metrics {what} {value!r}; use one of {list(allowed)}")
    return value


@dataclass(slots=True)
class ReaderTally:
    """Counter deltas and latency samples since the last push."""

    hits: int = 0
    misses: Counter[str] = field(default_factory=Counter)
    rejected: Counter[str] = field(default_factory=Counter)
    fetched_blocks: Counter[str] = field(default_factory=Counter)
    fetched_bytes: Counter[str] = field(default_factory=Counter)
    fetch_seconds: dict[str, list[float]] = field(default_factory=dict)
    prefill_tokens: Counter[str] = field(default_factory=Counter)

    def empty(self) -> bool:
        """True when there is nothing to push."""
        return not (self.hits or self.misses or self.rejected or self.fetched_blocks
                    or self.fetch_seconds or self.prefill_tokens)

    def merge(self, other: ReaderTally) -> None:
        """Add ``other`` into this tally (a failed push goes back this way)."""
        self.hits += other.hits
        self.misses.update(other.misses)
        self.rejected.update(other.rejected)
        self.fetched_blocks.update(other.fetched_blocks)
        self.fetched_bytes.update(other.fetched_bytes)
        self.prefill_tokens.update(other.prefill_tokens)
        for path, seconds in other.fetch_seconds.items():
            kept = self.fetch_seconds.setdefault(path, [])
            kept.extend(seconds[: max(0, MAX_SAMPLES - len(kept))])


_lock = threading.Lock()
_pending = ReaderTally()


def take_pending() -> ReaderTally:
    """Everything tallied in this process since the last take (the caller pushes it)."""
    global _pending
    with _lock:
        tally, _pending = _pending, ReaderTally()
    return tally


def restore_pending(tally: ReaderTally) -> None:
    """Put back a tally whose push failed, to go with the next one."""
    with _lock:
        _pending.merge(tally)


def record_hits(num_blocks: int = 1) -> None:
    """Count requested blocks that came back verified."""
    if num_blocks:
        with _lock:
            _pending.hits += num_blocks


def record_miss(reason: MissReason, num_blocks: int = 1) -> None:
    """Count misses by one of the ``kvstore.records.MISS_*`` reasons."""
    check_label(reason, MISS_REASONS, "miss reason")
    with _lock:
        _pending.misses[reason] += num_blocks


def record_rejected(reason: str, num_blocks: int = 1) -> None:
    """Count blocks a reader refused (failed verification) by one of ``REJECT_REASONS``."""
    check_label(reason, REJECT_REASONS, "reject reason")
    with _lock:
        _pending.rejected[reason] += num_blocks


def record_fetch(path: str, num_blocks: int, nbytes: int, seconds: float) -> None:
    """One batch fetch over ``path``: its verified blocks, their bytes, and its latency."""
    check_label(path, PATHS, "path")
    with _lock:
        _pending.fetched_blocks[path] += num_blocks
        _pending.fetched_bytes[path] += nbytes
        samples = _pending.fetch_seconds.setdefault(path, [])
        if len(samples) < MAX_SAMPLES:
            samples.append(seconds)


def record_prefill_tokens(cached: int, unreused_shared: int, computed: int) -> None:
    """Count one prefill's prompt tokens by where their KV came from."""
    with _lock:
        for kind, n in zip(PREFILL_KINDS, (cached, unreused_shared, computed), strict=True):
            if n:
                _pending.prefill_tokens[kind] += n
