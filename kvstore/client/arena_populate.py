"""Map a whole arena into this process's page tables ahead of its reads.

A process that maps the store node's arena takes a page fault the first time it touches each
few pages of it (the kernel maps at most 64 KiB of a shared file per fault). A fresh reader's
first pass over the blocks it loads pays for those inside its copies (in a vLLM worker, a
large part of each layer's copy out of the arena, and of the headers' check before the
forward: docs/vllm-measurements.md). ``Populator`` maps every page once, in the background,
with ``MADV_POPULATE_READ`` (Linux 5.14 and later) called through ctypes, which leaves
Python's lock to the other threads while the kernel works (``mmap.madvise`` holds it); a step
at a time, so unmapping waits for one step at most. It costs page tables of about 0.2 % of the
arena, what reading every block once costs anyway. Elsewhere (an older kernel, another system)
it maps nothing, and reads fault pages in as before.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

#: ``MADV_POPULATE_READ`` from Linux's ``mman-common.h`` (Python 3.11's mmap does not name it).
MADV_POPULATE_READ = 22
#: Bytes mapped per call: a step that unmapping, or a forward's own mmap (the kernel lets it
#: wait for the address space's lock), may wait for: well under a millisecond.
STEP = 4 << 20


@functools.cache
def libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise(addr, length, advice)``, called without Python's lock; None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    madvise.restype = ctypes.c_int
    return madvise  # type: ignore[no-any-return]


class Populator:
    """Maps ``[address, address + size)`` (a page-aligned read mapping) on a thread of its own,
    pinned to ``cores`` when given; ``stop`` ends it after the current step, before unmapping."""

    def __init__(self, address: int, size: int, cores: set[int] | None = None) -> None:
        self.address, self.size, self.cores = address, size, cores
        self.mapped = 0  # bytes mapped so far
        self.done = False  # every page mapped
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="kvstore-arena-populate")
        self._thread.start()

    def _run(self) -> None:
        if self.cores:
            try:
                os.sched_setaffinity(0, self.cores)
            except OSError as exc:  # then on whatever cores the process may use
                log.debug("populating the arena off cores %s failed: %s", sorted(self.cores),
                          exc)
        madvise = libc_madvise()
        if madvise is None:
            return
        for start in range(0, self.size, STEP):
            if self._stop.is_set():
                return
            length = min(STEP, self.size - start)
            if madvise(self.address + start, length, MADV_POPULATE_READ) != 0:
                log.debug("populating the arena stopped at %d bytes: %s", start,
                          os.strerror(ctypes.get_errno()))
                return  # an older kernel (EINVAL): reads fault pages in as they go
            self.mapped = start + length
        self.done = True

    def join(self, timeout: float | None = None) -> None:
        """Until every page is mapped, or mapping gave up."""
        self._thread.join(timeout)

    def stop(self) -> None:
        """End after the current step (before the mapping goes away)."""
        self._stop.set()
        self._thread.join()
