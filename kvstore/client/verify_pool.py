"""The read path's byte work over a few threads: copy and verify the blocks of one batch at once.

Why threads work here: numpy copies and python-xxhash release the GIL over large buffers, so W
threads copy and hash W blocks at once. One thread caps a read well below what memory and a
GPU's DMA allow; xxh3 scales with threads up to near memory bandwidth. The AES-GMAC of keyed
namespaces (``cryptography``) holds the GIL, so MAC checks do not scale this way: they stay at
one core's speed whatever the thread count.

One pool per process, sized from ``os.cpu_count()`` and bounded: readers are many (a store per
worker, a client per node), cores are not. The caller takes items too and waits only for items
some thread has claimed, so a busy pool means the caller does more of the work itself, and a
pool thread that calls ``parallel_map`` again cannot deadlock waiting for its own pool.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar

from kvstore.block import verify_block
from kvstore.errors import BlockCorrupted, BlockMismatch
from kvstore.keys import Namespace

T = TypeVar("T")

#: At most this many threads (the caller included) work on one batch: by then xxh3 runs near
#: memory bandwidth and more threads stop helping.
MAX_THREADS = 16
#: A thread is worth its handoff only for this many bytes of a batch.
MIN_BYTES_PER_THREAD = 1 << 20
#: Nor for items smaller than this: a small block's check is mostly Python (GIL held), not
#: hashing, so more threads only contend for the GIL.
MIN_BYTES_PER_ITEM = 256 << 10

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


_cap: int | None = None  # cap_threads: this process's own limit, if it set one


def num_threads() -> int:
    """Threads that work on one batch, the caller included: the cores this process may run
    on (its affinity, not the machine's count), at most ``MAX_THREADS`` and any cap set."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, MAX_THREADS, _cap or MAX_THREADS))


def cap_threads(limit: int | None) -> None:
    """Let at most ``limit`` threads (the caller included) work on one batch in this process
    (None: no cap). For a process whose cores its own compute threads hold, like an inference
    engine on the CPU, where helper threads only wait on those threads and on each other for
    the GIL."""
    global _cap
    _cap = None if limit is None else max(1, limit)


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(1, num_threads() - 1),
                                       thread_name_prefix="kvstore-verify")
        return _pool


def _forget_pool() -> None:
    """In a forked child the pool's threads do not exist: make a new pool on first use."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


class _Batch(Generic[T]):
    """Items ``0..n-1`` claimed one at a time by whichever thread is free."""

    def __init__(self, fn: Callable[[int], T], n: int) -> None:
        self.fn, self.n = fn, n
        self.claims = itertools.count()  # next() is atomic under the GIL
        self.results: list[Any] = [None] * n
        self.error: BaseException | None = None
        self.left = n
        self.lock = threading.Lock()
        self.finished = threading.Event()

    def run(self) -> None:
        while (i := next(self.claims)) < self.n:
            if self.error is None:  # after a failure the rest are only counted off
                try:
                    self.results[i] = self.fn(i)
                except BaseException as exc:
                    with self.lock:
                        self.error = self.error or exc
            with self.lock:
                self.left -= 1
                if self.left == 0:
                    self.finished.set()


def parallel_map(fn: Callable[[int], T], n: int, *, nbytes: int = 0,
                 max_threads: int | None = None) -> list[T]:
    """``[fn(0), ..., fn(n - 1)]`` computed by up to ``num_threads()`` threads (at most
    ``max_threads``), the caller one of them; ``nbytes`` (the batch's bytes, when known) keeps
    small batches, and batches of small items, on fewer threads.

    Returns only once every item that was started has finished, so no thread still writes into
    a caller's buffer (or reads a leased mapping) afterwards; the first exception an item
    raised is raised then, and items not yet started when it happened are skipped.
    """
    threads = min(num_threads(), n, max_threads or n)
    if nbytes:
        threads = min(threads, max(1, nbytes // MIN_BYTES_PER_THREAD))
        if nbytes < n * MIN_BYTES_PER_ITEM:
            threads = 1
    if threads <= 1:
        return [fn(i) for i in range(n)]
    batch = _Batch(fn, n)
    pool = _executor()
    for _ in range(threads - 1):
        pool.submit(batch.run)
    batch.run()
    batch.finished.wait()
    if batch.error is not None:
        raise batch.error
    return batch.results


def verify_landed(namespace: Namespace, keys: Sequence[bytes], token_ids: Sequence[Any],
                  buffers: Sequence[memoryview], sizes: Sequence[int | None]
                  ) -> list[int | BlockCorrupted | BlockMismatch | None]:
    """Verdicts for blocks that landed whole in ``buffers`` (flat byte views; blocks off the
    wire): per block its size (verified: header, tokens, tag), the error that rejected it, or
    None where ``sizes`` says the node did not hold it. Verified in parallel (``parallel_map``).
    """

    def one(i: int) -> int | BlockCorrupted | BlockMismatch | None:
        size = sizes[i]
        if size is None:
            return None
        try:
            verify_block(buffers[i][:size], namespace, keys[i], token_ids[i])
        except (BlockCorrupted, BlockMismatch) as exc:  # NamespaceMismatch included
            return exc
        return size

    return parallel_map(one, len(sizes), nbytes=sum(s or 0 for s in sizes))
